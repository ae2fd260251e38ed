"""Dataflow timing: when each compute cell of a schedule would run with nothing but its data
to wait for.

Each rank runs its cells in order; a cell starts when its rank is free and its inputs are
done: the forward input from stage ``s-1`` (``+ latency`` when that stage is on another
rank), the output gradient from stage ``s+1`` likewise. ``W`` waits for nothing but its rank.
This is the ideal the asynchronous runtime aims at: ``lower`` posts receives early enough
that, timed with the same costs, ``simulate`` reproduces these times exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from graphpipe.ir import BACKWARD_OPS, Action, Op, Placement

__all__ = ["DataflowTimes", "Durations", "dataflow_times", "producer"]

Durations = Callable[[Action], float]
"""The time one compute cell takes (``simulate.Costs.of`` is one)."""

Produced = tuple[Op, int, int]
"""``(Op.F, stage, mb)``: a forward's output; ``(Op.B, stage, mb)``: a backward's input
gradient (from B or I)."""


def producer(part: Action, last_stage: int) -> Produced | None:
    """What a plain action reads from a neighbour stage, or None (the batch, the loss, W)."""
    if part.op is Op.F and part.stage > 0:
        return (Op.F, part.stage - 1, part.microbatch)
    if part.op in BACKWARD_OPS and part.stage < last_stage:
        return (Op.B, part.stage + 1, part.microbatch)
    return None


@dataclass(frozen=True)
class DataflowTimes:
    """The dataflow timing of per-rank cell sequences.

    starts / ends: per rank, the start and end of each cell that could be timed (a rank
        stuck on a dependency cycle stops short).
    done: when each forward output / input gradient was computed (the end of its cell).
    """

    starts: dict[int, list[float]]
    ends: dict[int, list[float]]
    done: dict[Produced, float]

    @property
    def makespan(self) -> float:
        return max((e[-1] for e in self.ends.values() if e), default=0.0)

    def complete(self, cells: Mapping[int, Sequence[object]]) -> bool:
        """Whether every rank's every cell was timed."""
        return all(len(self.starts[r]) == len(cells[r]) for r in cells)


def dataflow_times(
    cells: Mapping[int, Sequence[Action | None]],
    placement: Placement,
    durations: Durations,
    latency: float = 0.0,
) -> DataflowTimes:
    """Time ``cells`` (per rank, compute cells in order; ``None`` takes no time) by data
    dependencies alone, ``latency`` added to every input that crosses ranks."""
    last = placement.last_stage
    done: dict[Produced, float] = {}
    starts: dict[int, list[float]] = {r: [] for r in cells}
    ends: dict[int, list[float]] = {r: [] for r in cells}
    free = dict.fromkeys(cells, 0.0)
    progress = True
    while progress:
        progress = False
        for rank, seq in cells.items():
            while len(starts[rank]) < len(seq):
                cell = seq[len(starts[rank])]
                parts = cell.parts() if cell is not None else ()
                ready = free[rank]
                blocked = False
                for p in parts:
                    need = producer(p, last)
                    if need is None:
                        continue
                    t = done.get(need)
                    if t is None:
                        blocked = True
                        break
                    if placement.rank_of(need[1]) != rank:
                        t += latency
                    ready = max(ready, t)
                if blocked:
                    break
                end = ready + (durations(cell) if cell is not None else 0.0)
                starts[rank].append(ready)
                ends[rank].append(end)
                free[rank] = end
                for p in parts:
                    if p.op is not Op.W:
                        done[(Op.F if p.op is Op.F else Op.B, p.stage, p.microbatch)] = end
                progress = True
    return DataflowTimes(starts, ends, done)
