"""torch.distributed.pipelining's schedule generators as test oracles.

Used by the tests only; graphpipe/ never imports torch's schedules. The generators are called
on bare objects (no process group, no stages): each needs only a few attributes.
"""

from __future__ import annotations

import pytest

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
TorchAction = torch_schedules._Action


def dualpipev_rows(num_ranks: int, num_microbatches: int) -> dict[int, list]:
    """torch's ScheduleDualPipeV order: ``{rank: [_Action, ...]}``."""
    cls = torch_schedules.ScheduleDualPipeV
    obj = cls.__new__(cls)
    obj.pp_group_size = num_ranks
    obj._n_microbatches = num_microbatches
    return {r: obj._calculate_single_rank_operations(r) for r in range(num_ranks)}


def zbv_rows(num_ranks: int, num_microbatches: int) -> dict[int, list]:
    """torch's ScheduleZBVZeroBubble order, idle steps as None: ``{rank: [_Action|None]}``."""
    cls = torch_schedules.ScheduleZBVZeroBubble
    obj = cls.__new__(cls)
    obj.pp_group_size = num_ranks
    obj._n_microbatches = num_microbatches
    obj.num_stages = 2 * num_ranks
    return {r: obj._calculate_single_rank_operations(r) for r in range(num_ranks)}


def as_strings(rows: dict[int, list]) -> dict[int, list[str]]:
    """The oracle's rows as action strings, idle steps dropped."""
    return {r: [str(a) for a in actions if a is not None] for r, actions in rows.items()}
