"""Entry points for code written against other pipeline APIs.

``torch_pipelining``: the schedules of ``torch.distributed.pipelining``
(``ScheduleDualPipeV``, ``Schedule1F1B``, ...) with torch's constructor and ``step`` /
``eval``, running graphpipe's ``Pipeline`` on the ``PipelineStage`` objects' modules.

Nothing here is imported by ``graphpipe`` itself; the integrations import the runtime.
"""

from __future__ import annotations

__all__: list[str] = []
