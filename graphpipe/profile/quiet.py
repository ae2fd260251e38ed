"""torch.profiler's informational log lines, kept off stderr.

Kineto (torch.profiler's C++ side) writes lines like ``USDT:YYYY-MM-DD hh:mm:ss PID:TID
SyncActivityProfilerHandler.cpp:52] profiler_start`` straight to file descriptor 2 (its
``std::cerr`` logger) whenever a profiler starts or stops; Python cannot redirect them through
``sys.stderr``. ``KINETO_LOG_LEVEL=6`` would silence them, but also kineto's warnings and
errors. ``kineto_info_dropped`` instead sends fd 2 to a temporary file around the call and
then writes back everything but kineto's informational lines (``VERBOSE``, ``INFO``,
``STAGE``, ``USDT``): its warnings and errors, and whatever else was written, still reach
stderr, in order, once the block ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["kineto_info_dropped"]

# Kineto's Logger: "<SEVERITY>:<YYYY-MM-DD HH:MM:SS> <pid>:<tid> <file>:<line>] <message>".
_KINETO_INFO = re.compile(
    r"(VERBOSE|INFO|STAGE|USDT):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ [\w.]+:\d+\] "
)


@contextlib.contextmanager
def kineto_info_dropped() -> Iterator[None]:
    """Run the block with kineto's informational lines dropped from fd 2 (see the module)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            kept = [x for x in text.splitlines(keepends=True) if not _KINETO_INFO.match(x)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
