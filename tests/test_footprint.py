"""``graphpipe.schedule.footprint``: the memory a schedule size needs, estimated before anything is
built, held above what is really built; the limit it is checked against; and the commands
that refuse a size above it (one line naming the estimate and the limit, status 2).

The estimates are checked against ``tracemalloc``'s peak (numpy's arrays are traced too)
while the arrays and objects of each schedule kind are built, for small and medium sizes of
every kind: an estimate below the real peak would let a size through that does not fit.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from graphpipe.cli import main
from graphpipe.schedule import footprint
from graphpipe.schedule.costs import Costs
from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.lower import forward_only, lower, transfers
from graphpipe.schedule.simulate import figures
from graphpipe.schedule.validate import resolve_schedule

SIZES = [(2, 4), (4, 16), (16, 64), (16, 128), (4, 256)]
CASES = [(k, n, m) for k in sorted(SCHEDULES) for n, m in SIZES]
CASES += [("zbv", 100, 1), ("1f1b", 1000, 1)]
"""Every kind at sizes from a few dozen actions to some 12 000; ZB-V's key space at M = 1
(it generates 2N - 1 micro-batches: 200 x 199 keys for 600 actions); many ranks."""


def _peak(build) -> int:
    tracemalloc.start()
    try:
        build()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_the_kinds_table_matches_the_generators(kind: str) -> None:
    sk = SCHEDULES[kind]
    for n, m in [(1, 2), (3, 6), (5, 1), (4, 40)]:
        try:
            cells = sk.cells(n, m)
        except ValueError:  # a size the kind refuses (DualPipeV: M < 2N)
            continue
        size = footprint.schedule_size(kind, n, m)
        assert size.keys == sk.num_stages(n) * cells.mb_bound
        actions = int((cells.first >= 0).sum() + (cells.second >= 0).sum())
        assert actions <= size.actions
        assert size.ranks == n


@pytest.mark.parametrize(("kind", "n", "m"), CASES, ids=[f"{k}-{n}x{m}" for k, n, m in CASES])
def test_the_estimates_are_above_the_peaks_of_what_is_built(kind: str, n: int, m: int) -> None:
    sk = SCHEDULES[kind]

    def arrays() -> None:  # what graphpipe schedule runs
        figures(sk.cells(n, m), sk.placement(n), m, Costs())

    def objects() -> None:  # what one Pipeline builds in each rank's process
        schedule, placement, _ = resolve_schedule(kind, n, m)
        train = lower(schedule, placement)
        infer = lower(forward_only(schedule), placement)
        transfers(train, placement), transfers(infer, placement)

    assert _peak(arrays) <= footprint.figures_bytes(kind, n, m)
    assert _peak(objects) <= footprint.runtime_bytes(kind, n, m)


def test_a_medium_size_is_not_overestimated_tenfold() -> None:
    # 64 ranks x 128 micro-batches, some 39 000 actions: an estimate far above the peak would
    # refuse sizes that fit (measured at 2x: 21.6 MB for a 10.7 MB peak).
    sk = SCHEDULES["dualpipev"]
    peak = _peak(lambda: figures(sk.cells(64, 128), sk.placement(64), 128, Costs()))
    assert footprint.figures_bytes("dualpipev", 64, 128) <= 4 * peak


@pytest.mark.parametrize(
    ("text", "value"),
    [("1000", 1000), ("512M", 512 << 20), ("8G", 8 << 30), ("1.5GiB", 3 << 29), ("2tb", 2 << 40)],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert footprint.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "x", "0", "-1G", "8Q"])
def test_parse_bytes_names_a_bad_size(text: str) -> None:
    with pytest.raises(ValueError, match=f"got {text!r}"):
        footprint.parse_bytes(text)


def test_the_limit_is_the_least_of_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemAvailable:    2000000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    got = footprint.memory_limit(meminfo=meminfo, cgroup=cgroup)
    assert got == footprint.Limit(2000000 * 1024, "available (MemAvailable)")
    (cgroup / "memory.max").write_text("max\n")  # v2 without a limit
    (cgroup / "memory.current").write_text("5000\n")
    assert footprint.memory_limit(meminfo=meminfo, cgroup=cgroup) == got
    (cgroup / "memory.max").write_text("1000000\n")
    assert footprint.memory_limit(meminfo=meminfo, cgroup=cgroup) == footprint.Limit(
        995000, "left in this process's cgroup"
    )
    assert footprint.memory_limit(123, meminfo=meminfo, cgroup=cgroup) == footprint.Limit(
        123, "--memory-limit"
    )
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # none
    (v1 / "memory" / "memory.usage_in_bytes").write_text("5000\n")
    assert footprint.memory_limit(meminfo=tmp_path / "none", cgroup=v1) is None


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert out == ""
    return code, err


@pytest.mark.parametrize(
    "argv",
    [
        ["schedule", "--ranks", "2", "--microbatches", "1000000000"],
        ["schedule", "--ranks", "100000", "--microbatches", "200000", "--schedule", "zbv"],
        ["bench", "--ranks", "2", "--microbatches", "1000000000"],
        ["profile", "--microbatches", "1000000000", "--batch-size", "2000000000"],
    ],
    ids=lambda argv: " ".join(argv[:5]),
)
def test_a_size_above_the_limit_is_refused_naming_the_estimate_and_the_limit(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if argv[0] == "profile":
        argv = [*argv, "--out", str(tmp_path / "p")]
    code, err = _error([*argv, "--memory-limit", "64G"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"graphpipe {argv[0]}: error: "), err
    assert (
        "needs an estimated " in err and " TiB of memory, more than --memory-limit 64.00 GiB" in err
    )
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_a_size_within_the_limit_runs(capsys: pytest.CaptureFixture[str]) -> None:
    need = footprint.figures_bytes("dualpipev", 2, 4)
    argv = ["schedule", "--ranks", "2", "--microbatches", "4", "--format", "json"]
    assert main([*argv, "--memory-limit", str(need)]) == 0
    assert '"ranks": 2' in capsys.readouterr().out
    code, err = _error([*argv, "--memory-limit", str(need - 1)], capsys)
    assert code == 2 and f"needs an estimated {footprint.format_bytes(need)}" in err
