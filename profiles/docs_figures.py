"""Re-measure the wall times the docs quote for their commands, and report each one's drift.

    python profiles/docs_figures.py                   # every figure but the long ones
    python profiles/docs_figures.py --only readme_example,model_default_run --repeats 3
    python profiles/docs_figures.py --long            # also install, exit_soak (minutes each)
    python profiles/docs_figures.py --list            # the figures, their pages and commands

Each figure below names its page, the text there that states it (a regular expression whose
``doc`` group is the figure: ``8 s``, ``1 min 26 s``, ``5.6-6.7 s``, ``3.0 - 3.2``), the
command the page gives for it, and how this script runs that command (in a scratch copy of
the repository where it writes files, so the checkout is left as it is). The command runs
``--repeats`` times; the report shows the documented figure, the measured ones (min, median,
max), their ratio (median over the documented figure, or over the nearer end of a documented
range) and ``drift`` where the ratio is outside ``1 / --tolerance .. --tolerance``. It starts
with the machine (CPU model, cores, memory), the date and the load average, which decide
these figures as much as the code does: read a drift on a loaded machine as noise. Exit status
0, or 1 with ``--strict`` when a figure drifted; ``--json FILE`` writes the report.

Not here: the figures that are a measurement script's output rather than a command's wall time
(docs/benchmarks.md, the compile table of docs/bring-your-model.md, docs/profiling.md's
example, the checksum cost of docs/checkpoints.md): each sits beside the command that prints
it, which is the way to re-measure it. The test suite's times (README.md's Quickstart table,
docs/development.md) and the GPU check's (docs/gpu-check.md) are updated with the suite's and
the GPU run's results. ``tests/test_docs_figures.py`` checks that every figure here is still on
its page with its command and a date next to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's graphpipe and torchrun


@dataclass(frozen=True)
class Measured:
    """One run of a command: wall and CPU seconds, peak RSS (bytes), its output."""

    wall_s: float
    cpu_s: float
    rss: int
    output: str


@dataclass(frozen=True)
class Figure:
    """A timing figure of the docs and how to re-measure it.

    name: what ``--only`` takes. page: relative to the repository root. pattern: a regular
    expression over the page's text with its whitespace runs made single spaces; group
    ``doc`` is the figure. command: the command as the page writes it (found in the figure's
    paragraph by the test). shell: what runs, in ``scratch`` (a copy of the repository),
    after ``setup``. value: the measured seconds from a run (default its wall time).
    """

    name: str
    page: str
    pattern: str
    command: str
    shell: str
    value: Callable[[Measured], float] = lambda m: m.wall_s
    setup: Callable[[Path], None] | None = None
    long: bool = False
    timeout: float = 900.0
    unit: str = "s"
    notes: list[str] = field(default_factory=list)


def normalized(text: str) -> str:
    """``text`` with every whitespace run one space (figures wrap across lines)."""
    return " ".join(text.split())


def parse_duration(text: str, unit: str = "s") -> tuple[float, float]:
    """``8 s`` -> (8, 8); ``1 min 26 s`` -> (86, 86); ``5.6-6.7 s`` / ``3.0 - 3.2`` -> the
    range (the unit ``unit`` when none is written)."""
    text = text.strip()
    m = re.fullmatch(r"(?:(\d+) min)?\s*(?:([\d.]+)\s*s)?", text)
    if m and (m[1] or m[2]):
        seconds = 60 * int(m[1] or 0) + float(m[2] or 0)
        return seconds, seconds
    m = re.fullmatch(r"([\d.]+)\s*-\s*([\d.]+)\s*(s|min|ms)?", text)
    if m:
        scale = {"s": 1.0, "min": 60.0, "ms": 1e-3}[m[3] or unit]
        return float(m[1]) * scale, float(m[2]) * scale
    m = re.fullmatch(r"([\d.]+)\s*(s|min|ms)?", text)
    if m:
        scale = {"s": 1.0, "min": 60.0, "ms": 1e-3}[m[2] or unit]
        return float(m[1]) * scale, float(m[1]) * scale
    raise ValueError(f"not a duration: {text!r}")


def documented(figure: Figure) -> tuple[float, float] | None:
    """The figure as its page states it now (seconds), or None when the page no longer
    matches the figure's pattern."""
    found = re.search(figure.pattern, normalized((ROOT / figure.page).read_text()))
    return parse_duration(found["doc"], figure.unit) if found else None


def _readme_example(scratch: Path) -> None:
    """The README's example, saved as the file its first line names."""
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(# train_mlp\.py.*?)```", readme, re.S)
    if code is None:
        raise RuntimeError("README.md has no ```python block starting with # train_mlp.py")
    (scratch / "train_mlp.py").write_text(code[1])


def _steps_seconds(m: Measured) -> float:
    """The steps' time ``graphpipe train`` reports: ``steps 1-100 in 4.1 s``."""
    found = re.search(r"steps \d+-\d+ in ([\d.]+) s", m.output)
    if found is None:
        raise RuntimeError(f"no 'steps A-B in X s' line in:\n{m.output[-2000:]}")
    return float(found[1])


def _cost_row(n: int, what: str = "wall") -> Figure:
    """A row of docs/schedules.md's "What it costs" table."""
    column = {"wall": 2, "cpu": 3}[what]  # the cells before the figure's, after N
    cells = r"\|[^|]*" * column
    return Figure(
        name=f"schedule_n{n}_{what}",
        page="docs/schedules.md",
        pattern=rf"\| {n} {cells}\| (?P<doc>[\d.]+ - [\d.]+) \|",
        command="graphpipe schedule --ranks N --microbatches 2N",
        shell=f"graphpipe schedule --ranks {n} --microbatches {2 * n} > /dev/null",
        value=(lambda m: m.wall_s) if what == "wall" else (lambda m: m.cpu_s),
        long=n >= 1024,
    )


FIGURES: list[Figure] = [
    Figure(
        name="readme_example",
        page="README.md",
        pattern=r"0\.14 at step 50 \((?P<doc>[\d.]+-[\d.]+ s) end to end",
        command="torchrun --nproc-per-node 2 train_mlp.py",
        shell="torchrun --nproc-per-node 2 train_mlp.py",
        setup=_readme_example,
    ),
    Figure(
        name="readme_train",
        page="README.md",
        pattern=r"`graphpipe train`: (?P<doc>[\d.]+-[\d.]+ s) end to end",
        command="graphpipe train",
        shell="graphpipe train",
    ),
    Figure(
        name="model_default_run",
        page="docs/model.md",
        pattern=r"The default run \(2 ranks, 100 steps, `graphpipe train`\) took "
        r"(?P<doc>[\d.]+-[\d.]+ s) end to end",
        command="graphpipe train",
        shell="graphpipe train",
    ),
    Figure(
        name="model_default_steps",
        page="docs/model.md",
        pattern=r"end to end, (?P<doc>[\d.]+-[\d.]+ s) of it the 100 steps",
        command="graphpipe train",
        shell="graphpipe train",
        value=_steps_seconds,
    ),
    *(_cost_row(n, what) for n in (64, 128, 256, 512, 1024) for what in ("wall", "cpu")),
    Figure(
        name="schedule_zbv1024_cpu",
        page="docs/schedules.md",
        pattern=r"--schedule zbv`\): (?P<doc>[\d.]+ s) of CPU",
        command="graphpipe schedule --ranks 1024 --microbatches 2048 --schedule zbv",
        shell="graphpipe schedule --ranks 1024 --microbatches 2048 --schedule zbv > /dev/null",
        value=lambda m: m.cpu_s,
        long=True,
    ),
    Figure(
        name="schedule_start_cpu",
        page="docs/schedules.md",
        pattern=r"--microbatches 4` takes (?P<doc>[\d.]+ s) of CPU",
        command="graphpipe schedule --ranks 2 --microbatches 4",
        shell="graphpipe schedule --ranks 2 --microbatches 4 > /dev/null",
        value=lambda m: m.cpu_s,
    ),
    Figure(
        name="torchtitan_cpu",
        page="docs/torchtitan.md",
        pattern=r"The default run took (?P<doc>[\d.]+-[\d.]+ s) \(",
        command="python profiles/torchtitan_cpu.py",
        shell="python profiles/torchtitan_cpu.py --out ./titan",
    ),
    Figure(
        name="install",
        page="README.md",
        pattern=r"machine's load: (?P<doc>[\d.]+-[\d.]+ s) from local wheels",
        command="pip install torch==2.13.0 -e '.[test,torchtitan]'",
        shell="python3 -m venv .venv && . .venv/bin/activate && "
        "pip install -q torch==2.13.0 -e '.[test,torchtitan]'",
        long=True,
        timeout=1800,
    ),
    Figure(
        name="exit_soak",
        page="docs/failures.md",
        pattern=r"torch 2\.13, (?P<doc>\d+ s)\): no run aborted",
        command="python profiles/exit_soak.py --runs 300 --parallel 2",
        shell="python profiles/exit_soak.py --runs 300 --parallel 2",
        long=True,
        timeout=3600,
    ),
    Figure(
        name="exit_soak_destroy",
        page="docs/failures.md",
        pattern=r"--parallel 2`, (?P<doc>\d+ s)\): 0 of 100 runs failed",
        command="--destroy half",
        shell="python profiles/exit_soak.py --runs 100 --parallel 2 --destroy half",
        long=True,
        timeout=3600,
    ),
]


_NOT_COPIED = (".git", ".venv*", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache")


def fresh_copy(dest: Path) -> Path:
    """The repository's files as a fresh clone has them, plus what is not committed yet
    (tracked and untracked files that git does not ignore): no venv, no outputs. Outside a
    git checkout (a copy made this way), every file but ``_NOT_COPIED``."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
    )
    if listing.returncode != 0:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*_NOT_COPIED), dirs_exist_ok=True)
        return dest
    for raw in listing.stdout.split(b"\0"):
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the working tree, not yet from the index
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    return dest


def run_timed(shell: str, cwd: Path, timeout: float) -> Measured:
    """``shell`` (bash) in ``cwd`` under ``/usr/bin/time``: wall, user + sys, peak RSS (of the
    largest process), and stdout + stderr."""
    stats = cwd / ".time"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        ["/usr/bin/time", "-o", str(stats), "-f", "%e %U %S %M", "bash", "-c", shell],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{shell!r} exited with {done.returncode}:\n{output[-3000:]}")
    wall, user, sys_, rss = stats.read_text().split()[-4:]
    return Measured(float(wall), float(user) + float(sys_), int(rss) * 1024, output)


def machine() -> dict[str, object]:
    """CPU model, cores, memory, load average, date, versions: the conditions of a figure."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(
            int(x.split()[1]) * 1024
            for x in Path("/proc/meminfo").read_text().splitlines()
            if x.startswith("MemTotal")
        )
    except (OSError, StopIteration):
        mem = 0
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }


def measure(
    figure: Figure, repeats: int, scratch: Path, runs: dict[str, list[Measured]]
) -> dict[str, object]:
    """``figure``'s command run ``repeats`` times in ``scratch`` (the runs of an earlier
    figure with the same command are used again: ``runs`` maps commands to runs); its
    report row."""
    if figure.setup is not None:
        figure.setup(scratch)
    done = runs.setdefault(figure.shell, [])
    while len(done) < repeats:
        if figure.name == "install":
            shutil.rmtree(scratch / ".venv", ignore_errors=True)
        done.append(run_timed(figure.shell, scratch, figure.timeout))
    values = [figure.value(m) for m in done[:repeats]]
    return {
        "measured_s": values,
        "median_s": statistics.median(values),
        "peak_rss_mib": [round(m.rss / 2**20, 1) for m in done[:repeats]],
    }


def ratio(median: float, doc: tuple[float, float]) -> float:
    """The measured median over the documented figure (the nearer end of a range; 1 within
    it)."""
    lo, hi = doc
    if lo <= median <= hi:
        return 1.0
    return median / (lo if median < lo else hi) if (lo if median < lo else hi) > 0 else 0.0


def report(rows: list[dict], conditions: dict, tolerance: float) -> str:
    lines = [
        f"docs figures re-measured {conditions['date_utc']} UTC on {conditions['cores']} cores "
        f"({conditions['cpu']}, {conditions['memory_gib']} GiB), load average "
        f"{conditions['load_average']} -> {conditions.get('load_average_after')}, Python "
        f"{conditions['python']}",
        f"{'figure':<24} {'page':<20} {'documented':>13} {'measured min/med/max':>24} {'ratio':>6}",
    ]
    for r in rows:
        lo, hi = r["documented_s"] or (float("nan"), float("nan"))
        doc = f"{lo:.1f}" if lo == hi else f"{lo:.1f}-{hi:.1f}"
        if "error" in r:
            lines.append(f"{r['name']:<24} {r['page']:<20} {doc:>13}  failed: {r['error']}")
            continue
        got = r["measured_s"]
        meas = f"{min(got):.1f} / {r['median_s']:.1f} / {max(got):.1f}"
        flag = "  drift" if r["drift"] else ""
        lines.append(
            f"{r['name']:<24} {r['page']:<20} {doc:>13} {meas:>24} {r['ratio']:>6.2f}{flag}"
        )
    lines.append(f"drift: ratio outside 1/{tolerance:g} .. {tolerance:g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="comma-separated figure names (see --list)")
    p.add_argument("--long", action="store_true", help="also the long figures (minutes each)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (default 3)")
    p.add_argument("--tolerance", type=float, default=1.5, help="drift beyond this ratio")
    p.add_argument("--strict", action="store_true", help="exit status 1 when a figure drifted")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p.add_argument("--list", action="store_true", help="list the figures and stop")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.tolerance < 1:
        p.error(f"--tolerance must be >= 1, got {args.tolerance}")
    names = [f.name for f in FIGURES]
    chosen = [f for f in FIGURES if args.long or not f.long]
    if args.only is not None:
        wanted = [x for x in args.only.split(",") if x]
        unknown = [x for x in wanted if x not in names]
        if unknown:
            p.error(f"--only: no figure {unknown[0]!r}; the figures: {', '.join(names)}")
        chosen = [f for f in FIGURES if f.name in wanted]
    if args.list:
        for f in FIGURES:
            print(f"{f.name:<24} {f.page:<20} {'(long) ' if f.long else ''}{f.command}")
        return 0
    conditions = machine()
    rows = []
    runs: dict[str, list[Measured]] = {}
    with tempfile.TemporaryDirectory(prefix="docs-figures-") as tmp:
        scratch = fresh_copy(Path(tmp))
        for f in chosen:
            row: dict[str, object] = {"name": f.name, "page": f.page, "command": f.command}
            row["documented_s"] = documented(f)
            print(f"docs_figures: {f.name}: {f.shell}", file=sys.stderr, flush=True)
            try:
                row.update(measure(f, args.repeats, scratch, runs))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                row["error"] = str(e).splitlines()[0]
                rows.append(row)
                continue
            doc = row["documented_s"]
            row["ratio"] = ratio(row["median_s"], doc) if doc else float("nan")
            r = row["ratio"]
            row["drift"] = doc is None or not (1 / args.tolerance <= r <= args.tolerance)
            rows.append(row)
    conditions["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(report(rows, conditions, args.tolerance))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": conditions, "figures": rows}, indent=2))
    drifted = any(r.get("drift") or "error" in r for r in rows)
    return 1 if args.strict and drifted else 0


if __name__ == "__main__":
    sys.exit(main())
