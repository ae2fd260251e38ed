"""The step's core: what runs one rank's schedule, whatever the composition.

``stage`` (the F / I / B / W / overlap handlers), ``comm`` (asynchronous transfers), ``program``
(the compiled per-rank program), ``step`` (the step loop), ``loss`` (the loss buffers and the
mean loss on every rank), ``messages`` (headers and message checks), ``batch`` (agreement on
each batch), ``structured`` (``PerMicrobatch``), ``tensors`` (values as tuples of tensors,
micro-batch splits), ``context`` (who this rank is). Imports ``runtime.coordination`` below
it; nothing of ``runtime.parts`` or ``runtime.capture`` above it.
"""
