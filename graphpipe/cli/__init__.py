"""The ``graphpipe`` command line: one function per subcommand, registered in ``_SUBCOMMANDS``.

``graphpipe schedule --ranks N --microbatches M [--schedule dualpipev|1f1b|zbv]
[--format grid|csv|json] [--costs F=1,B=2,W=1,...] [--out PICTURE] [--full]
[--memory-limit SIZE]`` prints a schedule and what the simulator finds about it
(``simulate.figures``, linear in the number of actions). Bad input, and a size whose
estimated memory (``graphpipe.schedule.footprint``) is above the limit, exit with code 2 and a
one-line message before anything is built.

``--help``, ``--version`` and argument errors import no torch (nor numpy, nor triton): the
parsers are built from modules that import them only when a command runs, so the command
line answers in a fraction of a second (``tests/test_cli_imports.py`` holds it to that).

To add a subcommand ``NAME``: write ``_add_NAME_parser(sub)`` (creates the parser and sets
``func=_cmd_NAME``) and ``_cmd_NAME(args) -> int``, and list it in ``_SUBCOMMANDS``; a
subcommand in its own module registers its parser from a module (and package ``__init__``)
that imports nothing heavy at module level. An option that several commands have (``--device``,
the built-in model's ``--hidden``, ``--layers``, ...) comes from ``graphpipe.cmdline.options``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from graphpipe.cmdline.options import costs_arg, positive_int
from graphpipe.cmdline.outputs import check_output_file
from graphpipe.schedule.costs import Costs
from graphpipe.schedule.footprint import add_memory_limit_argument
from graphpipe.schedule.ir import SCHEDULE_KINDS

if TYPE_CHECKING:  # the schedule half imports numpy: only when a command runs
    from graphpipe.schedule.generators import ScheduleKind
    from graphpipe.schedule.packed import Cells
    from graphpipe.schedule.simulate import Figures

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``graphpipe schedule: error: ...``, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# --------------------------------------------------------------------------------------------
# graphpipe schedule

_FULL_LIMIT = 100_000
"""Cells above which the grid is not printed and the picture not drawn without ``--full``:
the grid of 128 ranks and 256 micro-batches (131 000 cells) is 128 columns of up to 24
characters, the picture 128 rows; neither can be read. They cost about what the simulation
does (256 ranks, 512 micro-batches: a 15 MB grid; docs/benchmarks.md has the time)."""


def _add_schedule_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "schedule",
        help="print a pipeline schedule and its simulated bubble and memory",
        description="Generate a schedule, check it, simulate it as the runtime runs it "
        "(asynchronous P2P: receives posted early, a compute waits only for the messages it "
        "reads), and print it as a grid with statistics, as torch's compute-only CSV, or as "
        "JSON.",
    )
    p.add_argument("--ranks", type=positive_int, required=True, metavar="N", help="pipeline ranks")
    p.add_argument(
        "--microbatches",
        type=positive_int,
        required=True,
        metavar="M",
        help="micro-batches per step",
    )
    p.add_argument(
        "--schedule",
        choices=sorted(SCHEDULE_KINDS),
        default="dualpipev",
        help="; ".join(f"{name}: {summary}" for name, summary in SCHEDULE_KINDS.items()),
    )
    p.add_argument("--format", choices=sorted(_FORMATS), default="grid", help="output format")
    p.add_argument(
        "--costs",
        type=costs_arg,
        default=Costs(),
        metavar="F=1,B=2,...",
        help="action costs for the simulation: F, B, I, W, FB (an overlapped F&B pair, "
        "default F+B), p2p (latency of each message); unnamed ones keep their defaults "
        f"({Costs()})",
    )
    p.add_argument(
        "--out",
        metavar="PICTURE",
        help="also draw the timeline (.svg, or .png with matplotlib); its directory must exist",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help=f"print the grid and draw --out even for a schedule of more than {_FULL_LIMIT} "
        "cells (otherwise the grid format prints a one-line note in the grid's place and --out "
        "is refused): both are then slow and large",
    )
    add_memory_limit_argument(p)
    p.set_defaults(func=_cmd_schedule, parser=p)
    return p


def _schedule_memory(args: argparse.Namespace) -> str | None:
    """The refusal of a size whose estimated memory is above the limit (``graphpipe
    .footprint``): the simulation's arrays, plus the objects of ``--out``'s picture and the
    strings of a ``--full`` grid."""
    from graphpipe.schedule import footprint

    n, m = args.ranks, args.microbatches
    need = footprint.figures_bytes(args.schedule, n, m)
    if args.out:
        need += footprint.runtime_bytes(args.schedule, n, m)
    if args.full and args.format == "grid":
        need += (
            footprint.GRID_BYTES_PER_ACTION * footprint.schedule_size(args.schedule, n, m).actions
        )
    what = f"--schedule {args.schedule} --ranks {n} --microbatches {m}"
    return footprint.check_memory(what, need, footprint.memory_limit(args.memory_limit))


def _cmd_schedule(args: argparse.Namespace) -> int:
    problem = (check_output_file("--out", args.out) if args.out else None) or _schedule_memory(args)
    if problem is not None:  # before anything is imported or built
        args.parser.error(problem)
    from graphpipe.schedule.generators import SCHEDULES
    from graphpipe.schedule.lower import lower
    from graphpipe.schedule.packed import decode_schedule
    from graphpipe.schedule.simulate import figures, simulate
    from graphpipe.schedule.validate import ScheduleError

    kind: ScheduleKind = SCHEDULES[args.schedule]
    costs: Costs = args.costs
    try:
        cells = kind.cells(args.ranks, args.microbatches)
    except ValueError as e:
        args.parser.error(str(e))
    placement = kind.placement(args.ranks)
    if args.out and len(cells) > _FULL_LIMIT and not args.full:
        args.parser.error(
            f"--out: the schedule has {len(cells)} cells, more than {_FULL_LIMIT}: its picture "
            "cannot be read (--full draws it anyway)"
        )
    try:
        found = figures(cells, placement, args.microbatches, costs)
    except ScheduleError as e:
        print(e, file=sys.stderr)
        return 1
    if args.out:  # first, so that a picture that cannot be written leaves stdout empty
        # Here, not above: render's xml.sax pulls in urllib.request, a sizeable share of the
        # command's start-up (docs/benchmarks.md), which --help and the grid do not need.
        from graphpipe.schedule.render import write_picture

        schedule = decode_schedule(cells)
        lowered = lower(schedule, placement, durations=costs.of, latency=costs.p2p)
        result = simulate(lowered, placement, costs)
        title = f"{kind.name}: {args.ranks} ranks, {args.microbatches} micro-batches ({costs})"
        try:
            path = write_picture(args.out, result, costs=costs, title=title, num_ranks=args.ranks)
        except (RuntimeError, ValueError, OSError) as e:
            args.parser.error(str(e))
        print(f"wrote {path}", file=sys.stderr)
    stats = _statistics(kind, args.ranks, args.microbatches, costs, found)
    stats["dataflow_makespan"] = found.dataflow_makespan
    _FORMATS[args.format](cells, stats, args.full)
    return 0


def _dualpipe_reference(n: int, costs: Costs) -> dict[str, Any]:
    """DualPipe's README figures for DualPipeV with PP = 2N stages on N devices."""
    pp = 2 * n
    return {
        "source": "DualPipe README, PP = 2N stages",
        "bubble_formula": "(PP/2-1)(F&B+B-3W)",
        "bubble": (pp / 2 - 1) * (costs.overlap + costs.B - 3 * costs.W),
        "activations_formula": "PP+1",
        "activations": pp + 1,
    }


def _one_f_one_b_reference(n: int, costs: Costs) -> dict[str, Any]:
    """The textbook 1F1B figures with PP = N stages on N devices."""
    return {
        "source": "1F1B, PP = N stages",
        "bubble_formula": "(PP-1)(F+B)",
        "bubble": (n - 1) * (costs.F + costs.B),
        "activations_formula": "PP",
        "activations": n,
    }


_REFERENCES: dict[str, Callable[[int, Costs], dict[str, Any]]] = {
    "dualpipev": _dualpipe_reference,
    "1f1b": _one_f_one_b_reference,
}


def _statistics(
    kind: ScheduleKind, n: int, m: int, costs: Costs, result: Figures
) -> dict[str, Any]:
    stats: dict[str, Any] = {
        "schedule": kind.name,
        "ranks": n,
        "stages": kind.num_stages(n),
        "microbatches": m,
        "costs": asdict(costs),
        **result.as_dict(),
    }
    if kind.name in _REFERENCES:
        ref = _REFERENCES[kind.name](n, costs)
        ref["simulated_max_idle"] = max(r.idle for r in result.ranks)
        ref["simulated_max_peak_activations"] = max(r.peak_activations for r in result.ranks)
        stats["reference"] = ref
    return stats


def _print_grid(cells: Cells, stats: dict[str, Any], full: bool) -> None:
    print(
        f"{stats['schedule']}: {stats['ranks']} ranks, {stats['stages']} stages, "
        f"{stats['microbatches']} micro-batches; costs {Costs(**stats['costs'])}"
    )
    import numpy as np

    from graphpipe.schedule.validate import format_grid

    steps = int(np.diff(cells.offsets).max(initial=0))
    if len(cells) <= _FULL_LIMIT or full:
        print(format_grid(cells.names()))
    else:
        print(
            f"(the grid of {stats['ranks']} ranks x {steps} steps, {len(cells)} cells, is not "
            f"printed: more than {_FULL_LIMIT}; --full prints it, --format csv writes the cells)"
        )
    print(f"makespan {stats['makespan']:g}, mean bubble {stats['bubble_fraction']:.1%}")
    header = ("rank", "busy", "idle", "recv wait", "bubble", "peak activations", "peak pending W")
    print("  ".join(header))
    for r in stats["per_rank"]:
        cells = (
            f"{r['rank']:>4}",
            f"{r['busy']:>4g}",
            f"{r['idle']:>4g}",
            f"{r['recv_wait']:>9g}",
            f"{r['bubble_fraction']:>6.1%}",
            f"{r['peak_activations']:>16}",
            f"{r['peak_pending_w']:>14}",
        )
        print("  ".join(cells))
    gap = stats["makespan"] - stats["dataflow_makespan"]
    print(
        f"pure dataflow makespan {stats['dataflow_makespan']:g}"
        + (f" (P2P latency exposed: {gap:g})" if gap > 1e-9 else " (no P2P latency exposed)")
    )
    if ref := stats.get("reference"):
        print(f"reference figures ({ref['source']}):    formula   simulated")
        print(
            f"  bubble per rank {ref['bubble_formula']:<22} {ref['bubble']:>7g}   "
            f"max idle {ref['simulated_max_idle']:g}"
        )
        print(
            f"  activations per device {ref['activations_formula']:<15} {ref['activations']:>7}   "
            f"max peak {ref['simulated_max_peak_activations']}"
        )


def _print_csv(cells: Cells, stats: dict[str, Any], full: bool) -> None:
    from graphpipe.schedule.ir import write_csv

    write_csv((names for _, names in cells.rows()), sys.stdout)


def _print_json(cells: Cells, stats: dict[str, Any], full: bool) -> None:
    print(json.dumps(stats, indent=2))


_FORMATS: dict[str, Callable[[Cells, dict[str, Any], bool], None]] = {
    "grid": _print_grid,
    "csv": _print_csv,
    "json": _print_json,
}


# --------------------------------------------------------------------------------------------
# Registry and entry point

_SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = {
    "schedule": _add_schedule_parser,
    "plan": lambda sub: _lazy("cli.plan").add_parser(sub),
    "train": lambda sub: _lazy("train").add_parser(sub),
    "bench": lambda sub: _lazy("bench").add_parser(sub),
    "profile": lambda sub: _lazy("profile").add_parser(sub),
    "export": lambda sub: _lazy("cli.export").add_parser(sub),
}


def _lazy(name: str) -> Any:
    """Subcommands that live in their own module (``graphpipe.train``, ``graphpipe.bench``,
    ``graphpipe.cli.plan``)."""
    import importlib

    return importlib.import_module(f"graphpipe.{name}")


def _torch_version() -> str:
    """torch's version without importing torch (seconds): the ``__version__`` line of its
    generated ``torch/version.py``, else the installed package's metadata."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")  # finds the package, does not run it
    if spec is None or spec.origin is None:
        return "not installed"
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        text = ""
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    if found:
        return found[1]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "unknown"


class _Version(argparse.Action):
    """``--version``: graphpipe's version and torch's (found without importing torch)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        from graphpipe import __version__

        print(f"graphpipe {__version__} (torch {_torch_version()})")
        parser.exit()


def _build_parser() -> _Parser:
    parser = _Parser(prog="graphpipe", description="DualPipeV pipeline-parallel training.")
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``graphpipe COMMAND ...``; returns the exit code.

    Argument errors exit with 2, a failed rank with 1 (its traceback, once; a planned stop
    such as train's non-finite loss: one line), Ctrl-C with 130 (one line; every spawned
    rank is stopped first).
    """
    parser = _build_parser()
    args = parser.parse_args(argv)  # --help, --version and argument errors end here
    if args.command is None:
        parser.error(f"choose a command: {', '.join(_SUBCOMMANDS)}")
    from graphpipe.cmdline.launch import RankFailed, RunStopped

    try:
        return args.func(args)
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":  # once under torchrun
            print(f"graphpipe {args.command}: interrupted", file=sys.stderr)
        return 130
    except RankFailed as e:
        print(f"graphpipe {args.command}: {e}", file=sys.stderr)
        return 1
    except RunStopped as e:  # under torchrun: this rank stopped the run
        if os.environ.get("RANK", "0") == "0":
            print(f"graphpipe {args.command}: {e}", file=sys.stderr)
        return 1
