"""The batch: the ranks' agreement on it before every call.

Inputs live on the rank that runs stage 0 (the *input rank*), labels on the rank that runs
the last stage (the *loss rank*); both are rank 0 for V schedules (DualPipeV, ZB-V). Keyword
tensors (``pipe.step(x, y, attention_mask=...)``) are given on every rank. Before every call
those ranks check their part, and all ranks agree, in one all-reduce over the gloo control
group, on the batch *signature* (every tensor's shape and dtype), on the dtype of the loss, on
whether any rank rejected the batch, on which call (``step`` or ``forward``, and its number)
every rank is in, on a digest of the keyword tensors' names, shapes and dtypes, and on which
keywords some stage (or ``loss_fn``) takes, on whether the step is inside ``no_sync``; and
every keyword tensor (and the labels) must have the inputs' rows, since all are split into
the same micro-batches. A bad batch so raises on every rank, and no rank
waits for a peer that gave up or called something else; only when the keyword digests differ
do the ranks exchange their descriptions (through the store) to name the rank and keyword.
With data parallelism over several replicas, every training step's agreement then goes on to
the replicas' (``DataParallel.agree``, one all-reduce over them), whatever the pipeline's
found: a replica inside ``no_sync`` while another is not, or a replica that refused the
step, raises ``PipelineError`` on every rank of every replica, before any reduction.
May touch: the control group, the store on that error, the replicas' agreement through the
callable it is given; nothing else.

``BatchSignature`` is what was agreed: per tensor of the inputs, the labels (training only)
and the keyword tensors its ``(dtype code, *shape)``. In the agreement buffer the inputs and
the labels are words (``[count, (dtype code, ndim, *shape) per tensor]``, written by
``_part``, read back by ``BatchSignature.from_words``) and the keyword tensors a digest of
``keywords_signature``. It keys the captures, and says which tensor differs from a captured
one (``mismatch``).
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from graphpipe.errors import PipelineError
from graphpipe.meta import DTYPE_CODE, DTYPES

from ..coordination.faults import CommFailure
from ..coordination.store import first_line
from .structured import PerMicrobatch, check_count, structure_digest
from .tensors import as_tuple

if TYPE_CHECKING:
    from ..coordination.groups import PipelineGroups

__all__ = [
    "BatchAgreement",
    "BatchSignature",
    "KwSig",
    "describe_keywords",
    "keywords_signature",
]

KwSig = tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]
"""A keywords signature (``keywords_signature``)."""

_PART = 64  # int64 words per part of the agreement buffer


class BatchSignature(NamedTuple):
    """A call's agreed batch: ``(dtype code, *shape)`` per tensor of the inputs, of the
    labels (empty unless ``train``) and, by name, of the keyword tensors."""

    train: bool
    inputs: tuple[tuple[int, ...], ...]
    labels: tuple[tuple[int, ...], ...]
    keywords: KwSig

    @classmethod
    def from_words(
        cls, train: bool, inputs: Sequence[int], labels: Sequence[int], keywords: KwSig
    ) -> BatchSignature:
        """The signature of the agreement's words of the inputs and the labels (each
        ``[count, (dtype code, ndim, *shape) per tensor]``, as ``_part`` writes them; empty:
        none) and the keywords signature."""
        return cls(bool(train), _tensors_of(inputs), _tensors_of(labels), keywords)

    def keyword_names(self) -> tuple[str, ...]:
        """The keyword tensors' names, sorted."""
        return tuple(name for name, _ in self.keywords)

    def described(self) -> list[tuple[str, list[int], str]]:
        """``(name, shape, dtype)`` of every tensor: ``inputs[0]``, ``labels[0]``,
        ``keyword tensor 'mask'``, ..."""
        out = []
        parts = [("inputs", self.inputs), ("labels", self.labels)]
        for name, descr in parts:
            for k, (code, *shape) in enumerate(descr):
                out.append((f"{name}[{k}]", shape, _dtype_name(code)))
        for name, descr in self.keywords:
            for k, (code, *shape) in enumerate(descr):
                index = f"[{k}]" if len(descr) > 1 else ""
                out.append((f"keyword tensor {name!r}{index}", shape, _dtype_name(code)))
        return out

    def mismatch(self, got: BatchSignature) -> str:
        """Why ``got`` does not fit this (a captured step's) signature."""
        old, new = self.described(), got.described()
        for (name, shape, dt), (name2, shape2, dt2) in zip(old, new, strict=False):
            if (name, shape, dt) != (name2, shape2, dt2):
                return (
                    f"{name2} has shape {shape2} {dt2}, but the step was captured with {name} "
                    f"of shape {shape} {dt}; pass recapture=True to capture a graph per shape"
                )
        return (
            f"the batch holds {[n for n, _, _ in new]}, but the step was captured with "
            f"{[n for n, _, _ in old]}; pass recapture=True to capture a graph per signature"
        )


def _tensors_of(words: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """``(dtype code, *shape)`` per tensor of one part's words (``_part``)."""
    if not words:
        return ()
    out, i = [], 1
    for _ in range(words[0]):
        code, ndim = words[i], words[i + 1]
        out.append((code, *words[i + 2 : i + 2 + ndim]))
        i += 2 + ndim
    return tuple(out)


def _dtype_name(code: int) -> str:
    return str(DTYPES[code]).removeprefix("torch.")


def _check_rows(what: str, t: torch.Tensor, m: int) -> None:
    """``t`` must split on dim 0 into ``m`` micro-batches and have a dtype that can travel."""
    if t.dim() == 0:
        raise ValueError(f"{what} is 0-dim: the batch is split on dim 0")
    if t.shape[0] == 0:
        raise ValueError(f"{what} of shape {list(t.shape)} holds no rows")
    if t.shape[0] % m:
        raise ValueError(
            f"{what} of shape {list(t.shape)} does not split on dim 0 into "
            f"num_microbatches={m} equal micro-batches"
        )
    if t.dtype not in DTYPE_CODE:
        raise ValueError(f"{what} has unsupported dtype {t.dtype}")


def _part(name: str, value: Any, m: int) -> list[int]:
    """``[count, (dtype code, ndim, *shape) ...]`` of one part; raises naming the problem."""
    if value is None:
        raise ValueError(f"{name} must not be None on this rank: it holds the batch's {name}")
    ts = as_tuple(value, name)
    out = [len(ts)]
    for i, t in enumerate(ts):
        _check_rows(f"{name}[{i}]", t, m)
        out += [DTYPE_CODE[t.dtype], t.dim(), *t.shape]
    if len(out) >= _PART:
        raise ValueError(f"{name} has too many tensors or dims ({len(out)} ints)")
    return out


def keywords_signature(kwargs: Mapping[str, Any], m: int) -> KwSig:
    """``((name, ((dtype code, *shape) per tensor)), ...)`` of the keyword tensors, by name;
    raises naming a keyword that is not a tensor or tuple of tensors, or does not split."""
    out = []
    for name in sorted(kwargs):
        ts = as_tuple(kwargs[name], f"keyword tensor {name!r}")
        check_count(name, kwargs[name], m)  # a PerMicrobatch: one value per micro-batch
        descr = []
        for i, t in enumerate(ts):
            what = f"keyword tensor {name!r}" + (f"[{i}]" if len(ts) > 1 else "")
            _check_rows(what, t, m)
            descr.append((DTYPE_CODE[t.dtype], *t.shape))
        out.append((name, tuple(descr)))
    return tuple(out)


def describe_keywords(sig: KwSig) -> str:
    """``{'mask': [8, 16] int64, ...}`` of a keywords signature."""

    def one(d: tuple[int, ...]) -> str:
        return f"{list(d[1:])} {str(DTYPES[d[0]]).removeprefix('torch.')}"

    parts = [f"{name!r}: " + ", ".join(one(d) for d in descr) for name, descr in sig]
    return "{" + ", ".join(parts) + "}"


def _digest(sig: KwSig, structures: str = "") -> int:
    """A 56-bit digest of a keywords signature (and of the structures of its
    ``PerMicrobatch`` values), the same in every process (no salted hash)."""
    text = repr(sig) + structures
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


class BatchAgreement:
    """Agrees on each call's batch across the pipeline ranks (see the module doc).

    groups: the pipeline's groups (the control group is looked up at each call).
    rank / num_ranks: this rank and the pipeline size.
    input_rank / loss_rank: who holds the inputs and the labels.
    input_dtype: the floating dtype stage 0 computes in (its first floating parameter's), or
        None; floating inputs of another dtype are refused unless autocast is on.
    replicas: with data parallelism over several replicas, their agreement
        (``DataParallel.agree``): ``replicas(unsynced, refused)`` gives every replica's
        ``no_sync`` and refusal flags; called in every training step after the pipeline's.
    refuse: a check of the pipeline's own that may refuse a training step on this rank
        (``ValueError``, as a rejected batch: ``GradSync.check_captured``).
    """

    def __init__(
        self,
        groups: PipelineGroups,
        rank: int,
        num_ranks: int,
        input_rank: int,
        loss_rank: int,
        num_microbatches: int,
        input_dtype: torch.dtype | None,
        replicas: Callable[[bool, bool], tuple[list[bool], list[bool]]] | None = None,
        refuse: Callable[[], None] | None = None,
    ) -> None:
        self.groups, self.rank, self.num_ranks = groups, rank, num_ranks
        self.input_rank, self.loss_rank = input_rank, loss_rank
        self.m = num_microbatches
        self.input_dtype = input_dtype
        self.replicas = replicas
        self.refuse = refuse
        self._flags = 2 * _PART + 1

    def _check_dtype(self, inputs: Any, device_type: str) -> None:
        if self.input_dtype is None or torch.is_autocast_enabled(device_type):
            return
        for i, t in enumerate(as_tuple(inputs, "inputs")):
            if t.is_floating_point() and t.dtype != self.input_dtype:
                raise ValueError(
                    f"inputs[{i}] has dtype {t.dtype}, but stage 0's parameters are "
                    f"{self.input_dtype}: cast the batch (or run under torch.autocast)"
                )

    def agree(
        self,
        inputs: Any,
        labels: Any,
        kwargs: Mapping[str, Any],
        train: bool,
        loss_dtype: torch.dtype,
        call: int,
        device_type: str = "cpu",
        accepts: Callable[[tuple[str, ...]], int] | None = None,
        sync: bool = True,
        check_labels: Callable[[Any, tuple[str, ...]], None] | None = None,
        rejected: Exception | None = None,
    ) -> tuple[BatchSignature, torch.dtype]:
        """The agreed signature and loss dtype of call number ``call`` (``step`` when
        ``train``, else ``forward``); raises on every rank if a rank rejects the batch, the
        ranks are not in the same call, their keyword tensors differ, or a keyword tensor is
        taken by no stage (nor ``loss_fn``) of any rank.

        kwargs: this rank's keyword tensors (every rank passes the same names and shapes).
        accepts: ``accepts(names)``, the bit mask of the sorted ``names`` that this rank's
            stages (or its ``loss_fn``) take.
        sync: the step reduces its gradients (False inside ``no_sync``): every rank must
            agree.
        check_labels: on the loss rank, ``check_labels(labels, keyword names)`` raises
            ``ValueError`` for labels the loss function cannot take (``loss_fn.check_labels``,
            as ``graphpipe.models.causal_lm_loss`` has: a micro-batch without a valid token
            under ``"mean"``).

        rejected: what this rank refused before looking at the batch (``step()``'s own
            argument checks): raised here as this rank's rejection, so that every rank raises.

        A rank that rejects the batch publishes its error's first line in the store, so that
        every rank's error names it.
        """
        n, f = self.num_ranks, self._flags
        # Filled as a Python list (a torch op per word would cost more than the step's
        # bookkeeping); a tensor only for the all-reduce.
        vals = [0] * (f + 6 * n)
        err: Exception | None = None
        kw: KwSig = ()
        try:
            if rejected is not None:
                raise rejected
            if train and self.refuse is not None:
                self.refuse()
            if self.rank == self.input_rank:
                sig = _part("inputs", inputs, self.m)
                self._check_dtype(inputs, device_type)
                vals[0] = len(sig)
                vals[1 : 1 + len(sig)] = sig
            if train and self.rank == self.loss_rank:
                sig = _part("labels", labels, self.m)
                vals[_PART] = len(sig)
                vals[_PART + 1 : _PART + 1 + len(sig)] = sig
                vals[2 * _PART] = DTYPE_CODE[loss_dtype] + 1
                if check_labels is not None:
                    check_labels(labels, tuple(sorted(kwargs)))
            if kwargs:
                kw = keywords_signature(kwargs, self.m)
                if len(kw) > 62:
                    raise ValueError(f"{len(kw)} keyword tensors: at most 62 per call")
                vals[f + 3 * n + self.rank] = _digest(kw, structure_digest(kwargs))
                if accepts is not None:
                    vals[f + 4 * n + self.rank] = accepts(tuple(name for name, _ in kw))
        except Exception as e:
            if e is not rejected and not isinstance(e, (ValueError, TypeError)):
                raise
            err = e
            vals[f + self.rank] = 1
            self._publish_rejection(call, e)
        vals[f + n + self.rank] = 1 if train else 2
        vals[f + 2 * n + self.rank] = call
        vals[f + 5 * n + self.rank] = int(train and not sync)
        if n > 1:
            control = self.groups.control
            buf = torch.tensor(vals, dtype=torch.int64)
            try:
                if control is None:
                    raise RuntimeError("the pipeline's process groups were dropped")
                control.allreduce([buf]).wait()
            except RuntimeError as e:
                raise CommFailure(None, "batch agreement", e.with_traceback(None)) from None
            vals = buf.tolist()
        # With data parallelism every replica's ranks go on to the replicas' agreement
        # whatever this pipeline's found (a replica that stayed away would leave the others
        # waiting there): this pipeline's refusal is raised after it.
        refusal: Exception | None = None
        try:
            agreed = self._verdict(vals, err, kw, kwargs, train, loss_dtype, call)
        except Exception as e:
            refusal = e
        stepping = any(k == 1 for k in vals[f + n : f + 2 * n])  # some rank is in step()
        if stepping and self.replicas is not None:
            unsynced, refused = self.replicas(train and not sync, refusal is not None)
            if refusal is None:
                _check_replicas(unsynced, refused)
        if refusal is not None:
            try:
                raise refusal
            finally:  # this frame is in refusal's traceback: holding it would be a cycle
                del refusal
        return agreed

    def _verdict(
        self,
        vals: list[int],
        err: Exception | None,
        kw: KwSig,
        kwargs: Mapping[str, Any],
        train: bool,
        loss_dtype: torch.dtype,
        call: int,
    ) -> tuple[BatchSignature, torch.dtype]:
        """What the pipeline ranks' agreed words say (every rank reads the same): the
        signature and loss dtype, or the error every rank raises (``err``: this rank's own
        rejection)."""
        n, f = self.num_ranks, self._flags
        kinds, calls = vals[f + n : f + 2 * n], vals[f + 2 * n : f + 3 * n]
        if len(set(kinds)) > 1 or len(set(calls)) > 1:
            what = {1: "step()", 2: "forward()"}
            who = ", ".join(
                f"rank {r}: {what[k]} #{c}"
                for r, (k, c) in enumerate(zip(kinds, calls, strict=True))
            )
            raise PipelineError(
                f"the pipeline ranks are not in the same call ({who}): every rank must call "
                "step() and forward() together"
            )
        if err is not None:
            raise err
        rejected = [r for r in range(n) if vals[f + r]]
        if rejected:
            raise PipelineError(
                f"rank {rejected[0]} rejected this batch ({self._rejection(call, rejected[0])}); "
                "no rank ran the step"
            )
        unsynced = vals[f + 5 * n : f + 6 * n]
        if len(set(unsynced)) > 1:
            inside = [r for r in range(n) if unsynced[r]]
            outside = [r for r in range(n) if not unsynced[r]]
            raise ValueError(
                f"rank(s) {inside} called step() inside no_sync() and rank(s) {outside} "
                "outside it: every rank must skip (or run) the gradient reductions together"
            )
        digests = vals[f + 3 * n : f + 4 * n]
        if len(set(digests)) > 1:
            raise ValueError(self._keywords_mismatch(kw, call, digests))
        rows = vals[4]  # the inputs' part: [count, dtype code, ndim, rows, ...]
        if train and vals[_PART] and vals[_PART + 4] != rows:
            raise ValueError(
                f"labels[0] has {vals[_PART + 4]} rows but the inputs have {rows}: both are "
                "split on dim 0 into the same micro-batches, so they need the same rows"
            )
        for name, descr in kw:
            if isinstance(kwargs[name], PerMicrobatch):
                continue  # one value per micro-batch (check_count), not one row per input row
            for i, d in enumerate(descr):
                if d[1] != rows:
                    what = f"keyword tensor {name!r}" + (f"[{i}]" if len(descr) > 1 else "")
                    raise ValueError(
                        f"{what} has {d[1]} rows but the inputs have {rows}: a keyword "
                        "tensor is split on dim 0 into the micro-batches like the inputs, "
                        "so it needs one row per input row"
                    )
        if kw:
            taken = 0
            for mask in vals[f + 4 * n : f + 5 * n]:
                taken |= mask
            unused = [name for i, (name, _) in enumerate(kw) if not taken >> i & 1]
            if unused:
                raise ValueError(
                    f"keyword tensor {unused[0]!r} is taken by no stage's forward (nor by "
                    "loss_fn) on any rank: rename it to a parameter of a stage's forward, or "
                    "do not pass it"
                )
        inputs_words = vals[1 : 1 + vals[0]]
        labels_words = vals[_PART + 1 : _PART + 1 + vals[_PART]] if train else []
        if train:
            loss_dtype = DTYPES[vals[2 * _PART] - 1]
        return BatchSignature.from_words(train, inputs_words, labels_words, kw), loss_dtype

    def _publish_rejection(self, call: int, e: BaseException) -> None:
        """This rank's reason for rejecting call ``call``, for the other ranks' errors."""
        store = self.groups.store if self.num_ranks > 1 else None
        if store is not None:
            store.set(
                f"{self.groups.key}/reject/{call}/{self.rank}",
                f"{type(e).__name__}: {first_line(e)}",
            )

    def _rejection(self, call: int, rank: int) -> str:
        """What ``rank`` published when it rejected call ``call`` (it did before the
        agreement's all-reduce, so it is there when the others read it)."""
        store = self.groups.store
        text = store.peek(f"{self.groups.key}/reject/{call}/{rank}") if store is not None else None
        return text if text else f"see the error on rank {rank}"

    def _keywords_mismatch(self, kw: KwSig, call: int, digests: list[int]) -> str:
        """Why the ranks' keyword tensors differ: each rank's description goes through the
        store (only on this error), so that every rank names the same rank and keyword."""
        mine = describe_keywords(kw)
        alone = f"the pipeline ranks passed different keyword tensors (rank {self.rank}: {mine})"
        store = self.groups.store
        if store is None:  # pragma: no cover - a pipeline of several ranks has a store
            return alone
        prefix = f"{self.groups.key}/kwargs/{call}"
        store.set(f"{prefix}/{self.rank}", repr(kw))
        keys = [f"{prefix}/{r}" for r in range(self.num_ranks)]
        # Every rank saw the same digests and writes its key now: the wait is short.
        if not store.wait(keys, self.groups.timeout.total_seconds()):
            return alone
        sigs = [_eval_signature(text) for text in store.multi_get(keys)]
        first = next(r for r in range(self.num_ranks) if digests[r] != digests[0])
        ref, other = dict(sigs[0]), dict(sigs[first])
        name = next((k for k in sorted(set(ref) | set(other)) if ref.get(k) != other.get(k)), None)
        if name is None:  # the same tensors: the structures of PerMicrobatch values differ
            return (
                f"the pipeline ranks passed PerMicrobatch keyword values of different "
                f"structures (types or constants): rank {first} differs from rank 0 "
                "(every rank passes the same keyword values)"
            )

        def of(sig: dict) -> str:
            return describe_keywords(((name, sig[name]),)) if name in sig else f"no {name!r}"

        return (
            f"the pipeline ranks passed different keyword tensors: rank {first} has "
            f"{of(other)}, rank 0 has {of(ref)} (every rank passes the same keyword tensors)"
        )


def _check_replicas(unsynced: Sequence[bool], refused: Sequence[bool]) -> None:
    """``PipelineError`` on every rank when the data-parallel replicas (their flags, by
    replica) disagree on ``no_sync`` or one of them refused the step."""
    if any(refused):
        which = [d for d, r in enumerate(refused) if r]
        raise PipelineError(
            f"data-parallel replica(s) {which} refused this step (their ranks raise why); "
            "no rank ran the step"
        )
    if len(set(unsynced)) > 1:
        inside = [d for d, u in enumerate(unsynced) if u]
        outside = [d for d, u in enumerate(unsynced) if not u]
        raise PipelineError(
            f"the data-parallel replicas disagree on no_sync(): replica(s) {inside} called "
            f"step() inside no_sync() and replica(s) {outside} outside it; every replica must "
            "skip (or run) the gradient reductions together (no rank ran the step)"
        )


def _eval_signature(text: str) -> KwSig:
    """A keywords signature back from its ``repr`` (names and ints only)."""
    return ast.literal_eval(text)
