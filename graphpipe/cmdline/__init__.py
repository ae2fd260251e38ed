"""What every subcommand shares, below the packages that define subcommands.

``options``: argument types and the options several commands have (``--device``, the built-in
model's sizes); ``outputs``: an output path checked before any work; ``launch``: one process
per rank, ``torchrun``-like, with the job's store. ``graphpipe.cli`` (the parser) and the
subcommands of ``graphpipe.train``, ``graphpipe.bench`` and ``graphpipe.profile`` import these;
nothing here imports them.
"""
