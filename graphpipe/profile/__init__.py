"""``graphpipe profile``: turn traces of a pipeline run into the answer.

Where is each rank idle, how much time is spent waiting on communication, and does the
measured step match the schedule? The package reads the runtime's named ranges (``step``,
one per schedule action, ``wait ...`` per communication wait) from torch.profiler Chrome
traces or from an Nsight Systems SQLite export, and writes ``report.json``,
``timeline.svg`` and a table.

Modules, one concern each:

* ``ranges``: ``Range`` and the naming contract with the runtime (step / action / wait);
* ``chrome``: torch.profiler Chrome traces -> ranges per rank;
* ``nsys``: an nsys SQLite export -> ranges per process, and processes -> ranks;
* ``analysis``: ranges -> per-rank step, busy, idle, bubble, communication wait, and the
  simulator's prediction from the measured action costs;
* ``report``: ``report.json``, ``timeline.svg`` and the terminal table;
* ``command``: the ``graphpipe profile`` command (runs the built-in model under
  torch.profiler on every rank, or reads ``--from-nsys``);
* ``quiet``: keeps torch.profiler's informational C++ log lines off stderr.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from graphpipe._lazy import lazy_attributes

if TYPE_CHECKING:
    from .analysis import Analysis, StepFigures, analyse, step_figures
    from .chrome import load_chrome_traces
    from .nsys import assign_ranks, load_nsys
    from .ranges import STEP, WAIT_PREFIX, Kind, Range, kind_of

__all__ = [
    "STEP",
    "WAIT_PREFIX",
    "Analysis",
    "Kind",
    "Range",
    "StepFigures",
    "add_parser",
    "analyse",
    "assign_ranks",
    "kind_of",
    "load_chrome_traces",
    "load_nsys",
    "step_figures",
]


# Imported on first use: ``graphpipe profile --help`` (and ``render``, which reads ``ranges``)
# need none of the readers.
__getattr__, __dir__ = lazy_attributes(
    __name__,
    {
        **dict.fromkeys(("Analysis", "StepFigures", "analyse", "step_figures"), ".analysis"),
        "load_chrome_traces": ".chrome",
        **dict.fromkeys(("assign_ranks", "load_nsys"), ".nsys"),
        **dict.fromkeys(("STEP", "WAIT_PREFIX", "Kind", "Range", "kind_of"), ".ranges"),
    },
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``graphpipe profile`` (see ``command``)."""
    from .command import add_parser as add

    return add(sub)
