"""``graphpipe profile``: turn traces of a pipeline run into the answer.

Modules, one concern each:

* ``ranges``: ``Range`` and the naming contract with the runtime (step / action / wait).
"""

from __future__ import annotations

from .ranges import STEP, WAIT_PREFIX, Kind, Range, kind_of

__all__ = ["STEP", "WAIT_PREFIX", "Kind", "Range", "kind_of"]
