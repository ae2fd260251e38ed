"""The construction-time agreement: every rank joins, with the same configuration, or none
builds the pipeline.

Ranks configured differently do not fail by themselves: rank 0 with ``schedule="dualpipev"``
and rank 1 with ``"zbv"`` (the same placement) exchange the same messages in another order
and train silently wrong; a different ``num_microbatches`` waits for messages that never
come. So when a pipeline is built (``PipelineGroups``, before any process group), its ranks
**join** in the job's store, under the pipeline's key:

1. Each rank sets ``<key>/join/<rank>`` to the digest of its ``PipelineConfig`` (sha256 of
   every field that must match), with ``compare_set``: a key that a peer already marked as
   given up means this rank came too late (``PipelineError`` naming the rank that gave up).
2. It waits for every rank's key, up to the pipeline's ``timeout`` (publishing its status,
   ``status``, once it has waited ``patience``). At the timeout it marks each missing rank's
   key as given up (``compare_set`` again: a rank that arrives at that moment either finds
   the mark, or its digest stops the mark) and raises ``PipelineError``: ``rank 1 did not
   join the pipeline within 5 s``, with what that rank is doing if it is blocked elsewhere.
   Every rank that did join raises it, naming the same ranks.
3. Equal digests: done (one ``compare_set``, one ``wait`` and one ``multi_get`` per rank).
   Otherwise each rank publishes its whole configuration, reads every other's, and raises
   ``ValueError`` naming each rank that differs from rank 0 and both values:
   ``rank 1 has schedule='zbv', rank 0 has schedule='dualpipev'``.

The same join (without a configuration) precedes each rebuild of the process groups after a
failed call, so a rank that does not come back is named there too.

Owns: the ``join`` and ``config`` keys of each pipeline. May touch: the job's store (through
``JobStore``), this process's status.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from graphpipe.errors import PipelineError

from .status import Blocked, ProcessStatus, patience
from .store import JobStore, first_line

__all__ = ["PipelineConfig", "join", "pipeline_config"]

_GAVE_UP = "!"  # a join key that starts with it: a rank gave up waiting for its owner


@dataclass(frozen=True)
class PipelineConfig:
    """What every rank of a pipeline must agree on, as ``name -> value`` texts.

    fields: shown as ``name=value`` in a mismatch (``schedule='zbv'``, ``num_microbatches=4``).
    actions: the compute schedule, every rank's actions as cell texts (compared when the
        fields agree, so that two schedules of one name and M that differ are told too).
    """

    fields: Mapping[str, str]
    actions: Mapping[str, Sequence[str]]

    def to_json(self) -> str:
        return json.dumps({"fields": dict(self.fields), "actions": dict(self.actions)})

    @classmethod
    def from_json(cls, text: str) -> PipelineConfig:
        d = json.loads(text)
        return cls(d["fields"], d["actions"])

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:32]


def _size(group: Any) -> int | None:
    return dist.get_world_size(group) if group is not None else None


def pipeline_config(
    *,
    schedule_name: str,
    schedule: Mapping[int, Sequence[Any]],
    placement: Any,
    num_microbatches: int,
    receives: str,
    per_edge_groups: bool,
    capture: str | None,
    loss_reduction: str = "mean",
    dp_group: Any = None,
    expert_groups: Any = None,
    clip_grad_norm: float | None = None,
    clip_norm_type: float = 2.0,
    costs: Any = None,
) -> PipelineConfig:
    """The ``PipelineConfig`` of a pipeline's arguments (as the constructor resolved them).

    ``capture``: the mode (None, ``"step"``, ``"action"``); ``per_edge_groups``: resolved
    for the backend. ``costs`` matter only with ``receives="timed"`` (they time the receives
    in the lowering, which both ends of a transfer must group alike).
    """
    ranks = placement.num_ranks
    stage_ids = {r: list(placement.stages_of(r)) for r in range(ranks)}
    ep = None
    if expert_groups is not None:
        ep_group, expert_dp = expert_groups
        ep = (_size(ep_group), _size(expert_dp))
    fields = {
        "schedule": repr(schedule_name),
        "num_microbatches": repr(num_microbatches),
        "stage_ids": repr(stage_ids),
        "loss_reduction": repr(loss_reduction),
        "capture": repr(capture if capture is not None else False),
        "receives": repr(receives),
        "per_edge_groups": repr(bool(per_edge_groups)),
        "dp_group size": repr(_size(dp_group)),
        "expert_groups sizes (ep, expert dp)": repr(ep),
        "clip_grad_norm": repr(clip_grad_norm),
        "clip_norm_type": repr(float(clip_norm_type)),
    }
    if receives == "timed":
        fields["costs"] = repr(costs)
    actions = {str(r): [str(a) for a in schedule[r]] for r in sorted(schedule)}
    return PipelineConfig(fields, actions)


def _differences(configs: Sequence[PipelineConfig]) -> list[str]:
    """Each rank's differences from rank 0's configuration, in words."""
    ref = configs[0]
    out = []
    for r, cfg in enumerate(configs[1:], start=1):
        diffs = [
            f"rank {r} has {name}={value}, rank 0 has {name}={ref.fields.get(name)}"
            for name, value in cfg.fields.items()
            if ref.fields.get(name) != value
        ]
        if not diffs and cfg.actions != ref.actions:
            diffs.append(f"rank {r} has {_first_action_difference(cfg.actions, ref.actions, r)}")
        out += diffs
    return out


def _first_action_difference(mine: Mapping, ref: Mapping, r: int) -> str:
    for rank in sorted(set(mine) | set(ref), key=int):
        a, b = list(mine.get(rank, [])), list(ref.get(rank, []))
        for i in range(max(len(a), len(b))):
            x = a[i] if i < len(a) else "nothing"
            y = b[i] if i < len(b) else "nothing"
            if x != y:
                return (
                    f"another compute schedule than rank 0: action {i} of pipeline rank "
                    f"{rank} is {x} on rank {r}, {y} on rank 0"
                )
    return "another compute schedule than rank 0"  # pragma: no cover - digests differ


def _name(rank: int, global_ranks: Sequence[int]) -> str:
    g = global_ranks[rank]
    return f"rank {rank}" if g == rank else f"rank {rank} (global rank {g})"


def join(
    store: JobStore,
    key: str,
    rank: int,
    global_ranks: Sequence[int],
    timeout_s: float,
    config: PipelineConfig | None,
    kind: str = "construction",
) -> None:
    """Join the pipeline ``key`` as pipeline ``rank`` (see the module doc); ``config``: this
    rank's configuration (None: a rebuild, nothing to compare). Raises ``PipelineError`` for a
    rank that did not join within ``timeout_s`` (or when this one came too late),
    ``ValueError`` for a configuration that differs, ``StoreLost``."""
    n = len(global_ranks)
    digest = config.digest() if config is not None else "joined"
    keys = [f"{key}/join/{r}" for r in range(n)]
    mine = store.compare_set(keys[rank], "", digest)
    if mine != digest:
        advice = {
            "construction": "build the pipeline on every rank within the timeout",
            "rejoin": "after a failed call, every rank must call the pipeline again within the "
            "timeout",
        }.get(kind, f"every member must reach the {kind} within the timeout")
        raise PipelineError(
            f"{mine[len(_GAVE_UP) :]}; this rank ({_name(rank, global_ranks)}) came later: {advice}"
        )
    status = ProcessStatus(store, global_ranks[rank])
    start = time.monotonic()
    try:
        ready = store.wait(keys, patience(timeout_s))
        if not ready:
            status.publish(Blocked(key.split("/gen")[0], kind, 0, ""))
            ready = store.wait(keys, timeout_s - (time.monotonic() - start))
        if not ready:
            _give_up(store, key, keys, rank, global_ranks, timeout_s, kind, status)
        values = store.multi_get(keys)
    finally:
        ProcessStatus.clear()
    for v in values:
        if v.startswith(_GAVE_UP):
            raise PipelineError(v[len(_GAVE_UP) :])
    if len(set(values)) == 1:
        return
    assert config is not None  # a rebuild's values are all "joined"
    store.set(f"{key}/config/{rank}", config.to_json())
    details = [f"{key}/config/{r}" for r in range(n)]
    if not store.wait(details, timeout_s):
        late = [r for r in range(n) if not store.check(details[r])]
        raise ValueError(
            "the pipeline ranks are configured differently (their digests differ), and "
            f"ranks {late} did not send their configuration within {timeout_s:g} s"
        )
    configs = [PipelineConfig.from_json(t) for t in store.multi_get(details)]
    raise ValueError(
        "the pipeline ranks are configured differently: " + "; ".join(_differences(configs))
    )


def refuse(
    store: JobStore,
    key: str,
    rank: int,
    global_ranks: Sequence[int],
    exc: BaseException,
    what: str = "build the pipeline",
) -> None:
    """This rank will not join ``key``: it raised ``exc`` first (an argument it refused, a
    configuration its own checks found wrong). Its join key says so, so that every rank
    waiting in ``join`` raises at once, naming this rank and its error, instead of waiting
    for the timeout (a rank that already gave up on this one keeps its mark)."""
    text = f"{type(exc).__name__}: {first_line(exc)}"
    store.compare_set(
        f"{key}/join/{rank}", "", f"{_GAVE_UP}{_name(rank, global_ranks)} could not {what}: {text}"
    )


def _give_up(
    store: JobStore,
    key: str,
    keys: Sequence[str],
    rank: int,
    global_ranks: Sequence[int],
    timeout_s: float,
    kind: str,
    status: ProcessStatus,
) -> None:
    """At the timeout: mark every missing rank as given up and raise naming them (unless
    they all arrived at the last moment)."""
    what = {"construction": "join the pipeline", "rejoin": "rejoin the pipeline"}.get(
        kind, f"join the {kind}"
    )
    missing = []
    for r, k in enumerate(keys):
        if store.check(k):
            continue
        mark = (
            f"{_GAVE_UP}{_name(r, global_ranks)} did not {what} within {timeout_s:g} s "
            f"({_name(rank, global_ranks)} gave up waiting for it)"
        )
        if store.compare_set(k, "", mark).startswith(_GAVE_UP):
            missing.append(r)
    if not missing:
        return
    whats = []
    for r in missing:
        blocked = status.of(global_ranks[r])
        doing = (
            blocked.doing(blocked.pipeline == key.split("/gen")[0])
            if blocked is not None
            else "in no pipeline call: not started yet, idle, or busy outside the pipeline"
        )
        whats.append(
            f"{_name(r, global_ranks)} did not {what} within {timeout_s:g} s: it is {doing}"
        )
    raise PipelineError(
        "; ".join(whats) + f" (this rank, {_name(rank, global_ranks)}, waited for it)"
    )
