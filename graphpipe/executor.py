"""One rank's interpreter of the lowered DualPipeV program: ``DualPipeV``.

The executor runs the lowered Steps of this rank from ``graphpipe.lower``: before each
compute action, one batch of P2P ops (sends of earlier outputs, and receives that this or a
later action needs; received tensors are kept by (stage, micro-batch) until used), then the
action through a dispatch table ``{Op: handler}``. Every index lives in the Action; the
program is compiled once into a flat list of ``(comm specs, handler, args, range name)`` so
that the per-action host work is a handful of attribute reads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import (
    HEADER_LEN,
    HEADER_TAG_OFFSET,
    Channel,
    check_message,
    decode_header,
    encode_header,
    issue,
    wait_all,
)
from .ir import Action, Op
from .lower import Step, channel, forward_only, lower, matching
from .meta import DTYPE_CODE, DTYPES, StepRecord, TensorMeta
from .nvtx import Ranges
from .plan import StaticPlan, build_plan
from .schedules import Placement, dualpipev
from .weightgrad import WeightGradStore, make_deferrable

__all__ = ["DualPipeV"]

Tensors = tuple[torch.Tensor, ...]
_OVERLAP_HOOK = "overlapped_forward_backward"
_SIG_LEN = 64  # int64 words of the per-step batch signature broadcast from rank 0


def _as_tuple(x: Any) -> Tensors:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise TypeError(f"expected a tensor or a tuple of tensors, got {type(x).__name__}")


def _leaves(ts: Tensors) -> Tensors:
    """Stage inputs as fresh autograd leaves (no copy) so that backward yields their grads."""
    return tuple(
        t.detach().requires_grad_() if t.is_floating_point() or t.is_complex() else t for t in ts
    )


class _CommSpec:
    """One P2P op of a batch, resolved once: direction, channel, peer, local stage, mb."""

    __slots__ = ("channel", "is_send", "kind", "li", "mb", "packet", "peer", "static", "tag")

    def __init__(self, action: Action, li: int, peer: int, channel: Channel, tag: int) -> None:
        self.is_send = action.op in (Op.SEND_F, Op.SEND_B)
        self.kind = "F" if action.op in (Op.SEND_F, Op.RECV_F) else "B"
        self.li, self.mb, self.peer, self.channel, self.tag = (
            li,
            action.microbatch,
            peer,
            channel,
            tag,
        )
        self.static: Tensors | None = None  # plan buffers of the active capture
        self.packet: _Packet | None = None  # set when this message travels in a packet


_PACKET_TAG = 3 << 16  # packets travel on their own tag, apart from channels and headers


class _Packet:
    """Messages of one batch to (or from) one peer that travel as ONE flat buffer.

    Formed only when the peer sends (or receives) exactly these messages in one of its own
    batches, which every rank can tell from every rank's lowered program, so both ends agree
    without talking. ``specs`` are in the sender's order. gloo posts each P2P op separately
    and every op risks a transport stall (2 CPU ranks, profiles/gloo_exchange.py: 1 op each
    way 3-9% of exchanges over 1 ms, 2 ops 10-13%), so fewer ops per batch, fewer stalls:
    the overhead-bound bench step drops 20-25%. NCCL already fuses a batch into one group:
    packets are formed for gloo only.
    """

    __slots__ = ("group", "peer", "specs", "static")

    def __init__(self, specs: list[_CommSpec], peer: int, group: Any) -> None:
        self.specs, self.peer, self.group = specs, peer, group
        self.static: torch.Tensor | None = None  # the flat plan buffer of the active capture


_RECV_KIND = {"F": "recv_activation", "B": "recv_grad"}


class _Capture:
    """One captured signature: its plan, recorded metadata, buffer bindings and graphs."""

    __slots__ = (
        "bindings",
        "graphs",
        "mb_inputs",
        "mb_labels",
        "metas",
        "plan",
        "record",
        "signature",
    )

    def __init__(self, signature, plan, record, metas, bindings, mb_inputs, mb_labels) -> None:
        self.signature, self.plan, self.record, self.metas = signature, plan, record, metas
        self.bindings, self.mb_inputs, self.mb_labels = bindings, mb_inputs, mb_labels
        self.graphs: Any = None


def _decode_signature(sig: Sequence[int]) -> list[tuple[str, list[int], str]]:
    out, i = [], 1
    for name in ("inputs", "labels") if sig and sig[0] else ("inputs",):
        count = sig[i]
        i += 1
        for k in range(count):
            code, ndim = sig[i], sig[i + 1]
            dtype = str(DTYPES[code]).removeprefix("torch.")
            out.append((f"{name}[{k}]", list(sig[i + 2 : i + 2 + ndim]), dtype))
            i += 2 + ndim
    return out


def _mismatch(captured: Sequence[int], got: Sequence[int]) -> str:
    old, new = _decode_signature(captured), _decode_signature(got)
    for (name, shape, dt), (name2, shape2, dt2) in zip(old, new):
        if (name, shape, dt) != (name2, shape2, dt2):
            return (
                f"{name2} has shape {shape2} {dt2}, but the step was captured with {name} of "
                f"shape {shape} {dt}; pass recapture=True to capture a graph per shape"
            )
    return (
        f"the batch holds {[n for n, _, _ in new]}, but the step was captured with "
        f"{[n for n, _, _ in old]}; pass recapture=True to capture a graph per signature"
    )


class DualPipeV:
    """DualPipeV pipeline-parallel training over ``torch.distributed``.

    Args:
        stages: this rank's two modules, ``(stage r, stage 2N-1-r)``.
        num_microbatches: ``M >= 2N``; each batch is split on dim 0 into M equal parts.
        loss_fn: ``loss_fn(output, labels) -> 0-dim tensor``, run on rank 0 after the last stage.
        group: the pipeline process group (default: the world; none needed for one rank).
        use_nvtx: emit NVTX ranges (default: when CUDA is available). Ranges also go to the
            torch profiler whenever one records.
        per_channel_groups: use one process group per directed stage edge (what NCCL capture
            wants); all ranks must pass the same value.
        capture: capture the training step. ``True`` or ``"step"``: on CUDA one graph per
            rank per step; ``"action"``: one CUDA graph per schedule action, each replayed in
            its NVTX range. On CPU both run the static step (plan buffers only) eagerly.
            Step 1 runs eagerly and records metadata, step 2 captures, later steps replay.
        recapture: with capture, a batch of another shape or dtype captures a new graph for
            that signature instead of raising ``ValueError``.
        capture_optimizer: with capture, an optimizer over this rank's parameters whose step
            runs inside the step (in the graph on CUDA; it must be ``capturable=True`` there).
            Each step then zeroes the gradients in place first and steps the optimizer last:
            do not call ``zero_grad`` or ``step`` on it yourself.

    ``step(inputs, labels)`` runs one training step and returns on every rank the mean over
    micro-batches of ``loss_fn`` (0-dim), accumulating into ``.grad`` the gradients of that mean.
    The weight-gradient GEMMs of every plain ``nn.Linear`` in the stages are deferred to the
    schedule's ``W`` actions; other parameters get their gradients during ``I``.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        *,
        num_microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        group: dist.ProcessGroup | None = None,
        use_nvtx: bool | None = None,
        per_channel_groups: bool = False,
        capture: bool | str = False,
        recapture: bool = False,
        capture_optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if len(stages) != 2 or not all(isinstance(m, nn.Module) for m in stages):
            raise ValueError(
                f"stages must be this rank's two nn.Modules (stage r, stage 2N-1-r), got "
                f"{[type(m).__name__ for m in stages]}"
            )
        distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not distributed else dist.group.WORLD
        self.rank = dist.get_rank(self.group) if distributed else 0
        self.num_ranks = dist.get_world_size(self.group) if distributed else 1
        if not distributed and group is not None:
            raise ValueError("group was given but torch.distributed is not initialized")
        n = self.num_ranks
        self.num_microbatches = num_microbatches
        self.schedule = dualpipev(n, num_microbatches)  # validates N and M
        self.placement = Placement.from_style(n, "v", stages_per_rank=2)
        self.stage_ids = (self.rank, 2 * n - 1 - self.rank)
        self.last_stage = 2 * n - 1
        self.modules = tuple(stages)
        self.loss_fn = loss_fn
        self.stores = (WeightGradStore(), WeightGradStore())
        self.num_deferrable = tuple(
            make_deferrable(m, s) for m, s in zip(self.modules, self.stores)
        )
        self.ranges = Ranges(use_nvtx)
        self.device = self._infer_device()
        self._global = [dist.get_global_rank(self.group, r) if distributed else r for r in range(n)]
        self._channel_groups: dict[Channel, Any] = {}
        self._channel_tags: dict[Channel, int] = {}
        self._setup_channels(per_channel_groups)
        self._control = self._control_group() if n > 1 else None
        # Handshakes travel over the gloo control group where the pipeline's backend is not
        # gloo (NCCL), then the NCCL paths are warmed up: see _handshake_batch.
        self._stage_handshake = n > 1 and dist.get_backend(self.group) != "gloo"
        lowered = lower(self.schedule, self.placement)
        self._train_program = self._compile(lowered[self.rank])
        self._form_packets(lowered, self._train_program)
        fwd = forward_only(self.schedule)
        self._infer_program = self._compile(lower(fwd, self.placement)[self.rank])
        self._metas: dict[Channel, tuple[TensorMeta, ...]] = {}
        self._signature: tuple[int, ...] | None = None
        self._infer_signature: tuple[int, ...] | None = None
        self._infer_metas: dict[Channel, tuple[TensorMeta, ...]] = {}
        self._infer = False
        m = num_microbatches
        # Per local stage, per micro-batch state; None when not live.
        self._in: list[list[Any]] = [[None] * m, [None] * m]  # stage inputs (leaves)
        self._out: list[list[Any]] = [[None] * m, [None] * m]  # stage outputs (with graph)
        self._gout: list[list[Any]] = [[None] * m, [None] * m]  # grads of the outputs
        self._gin: list[list[Any]] = [[None] * m, [None] * m]  # grads of the inputs, to send
        self._mb_inputs: list[Tensors] = []
        self._mb_labels: list[Any] = []
        self._losses: torch.Tensor | None = None
        self._outputs: list[Any] = [None] * m
        self._seed: torch.Tensor | None = None
        self._handlers = {
            Op.F: self._forward,
            Op.B: self._backward_full,
            Op.I: self._backward_input,
            Op.W: self._weight,
            Op.OVERLAP_F_B: self._overlap,
        }
        self._bind()
        # Which (local stage, mb) run an I (split backward): only their forwards need the
        # deferrable Linear path.
        self._split_backward = [[False] * m, [False] * m]
        for a in self.schedule[self.rank]:
            for part in a.parts():
                if part.op is Op.I:
                    self._split_backward[self._local(part.stage)][part.microbatch] = True
        if capture not in (False, True, "step", "action"):
            raise ValueError(f"capture must be False, True, 'step' or 'action', got {capture!r}")
        if capture_optimizer is not None:
            if capture is False:
                raise ValueError("capture_optimizer needs capture=True, 'step' or 'action'")
            if self.device.type == "cuda" and capture_optimizer.defaults.get("capturable") is False:
                raise ValueError(
                    f"capture_optimizer {type(capture_optimizer).__name__} must be created with "
                    "capturable=True to run inside a CUDA graph"
                )
        self.optimizer = capture_optimizer
        self.capture: str | None = (
            None if capture is False else ("step" if capture is True else capture)
        )
        self.recapture = recapture
        self._captures: dict[tuple[int, ...], Any] = {}
        self._active: Any = None
        self._recorder: StepRecord | None = None

    # ------------------------------------------------------------------ setup
    def _infer_device(self) -> torch.device:
        for m in self.modules:
            for p in m.parameters():
                return p.device
        if self.group is not None and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _setup_channels(self, per_channel_groups: bool) -> None:
        s_last = self.last_stage
        channels: list[Channel] = []
        for s in range(s_last):
            channels += [(s, s + 1), (s + 1, s)]
        # Every rank walks all channels in the same order: new_group is collective.
        for tag, ch in enumerate(channels):
            a, b = (self.placement.stage_to_rank[s] for s in ch)
            if a == b:
                continue
            self._channel_tags[ch] = tag
            if per_channel_groups:
                ranks = sorted({self._global[a], self._global[b]})
                self._channel_groups[ch] = dist.new_group(ranks)
            else:
                self._channel_groups[ch] = self.group

    def _control_group(self) -> Any:
        if dist.get_backend(self.group) == "gloo":
            return self.group
        return dist.new_group([self._global[r] for r in range(self.num_ranks)], backend="gloo")

    def _local(self, stage: int) -> int:
        return 0 if stage == self.stage_ids[0] else 1

    def _compile(self, steps: list[Step]) -> list[tuple]:
        program = []
        for step in steps:
            specs = []
            for a in step.comms:
                ch = channel(a)
                other = ch[1] if ch[0] == a.stage else ch[0]
                peer = self._global[self.placement.rank_of(other)]
                specs.append(_CommSpec(a, self._local(a.stage), peer, ch, self._channel_tags[ch]))
            program.append((tuple(specs), step.compute))
        return program

    def _form_packets(self, lowered: dict[int, list[Step]], program: list[tuple]) -> None:
        """Group the messages of each batch by peer into ``_Packet``s where both ends allow.

        A group of two or more sends to rank P in batch k becomes a packet when P receives
        exactly those messages (and nothing else from this rank) in one of its batches; the
        same rule, seen from the other end, groups the receives. Messages on different
        process groups (``per_channel_groups``) are never packed together.
        """
        if self.group is None or dist.get_backend(self.group) != "gloo":
            return
        where: dict[Action, tuple[int, int, int]] = {}  # comm -> (rank, batch, position)
        for r, steps in lowered.items():
            for k, step in enumerate(steps):
                for pos, c in enumerate(step.comms):
                    where[c] = (r, k, pos)
        me = self.rank
        sends = (Op.SEND_F, Op.SEND_B)
        for k, (step, (specs, _)) in enumerate(zip(lowered[me], program)):
            groups: dict[tuple[bool, int, int], list[tuple[Action, _CommSpec]]] = {}
            for c, sp in zip(step.comms, specs):
                peer_rank, peer_batch, _ = where[matching(c)]
                groups.setdefault((sp.is_send, peer_rank, peer_batch), []).append((c, sp))
            for (is_send, pr, pk), members in groups.items():
                theirs = [
                    c
                    for c in lowered[pr][pk].comms
                    if (c.op in sends) != is_send and where[matching(c)][:2] == (me, k)
                ]
                grps = {id(self._channel_groups[sp.channel]) for _, sp in members}
                if len(members) < 2 or len(theirs) != len(members) or len(grps) != 1:
                    continue
                if not is_send:  # the sender's order
                    members.sort(key=lambda m: where[matching(m[0])][2])
                specs_in = [sp for _, sp in members]
                group = self._channel_groups[specs_in[0].channel]
                packet = _Packet(specs_in, specs_in[0].peer, group)
                for sp in specs_in:
                    sp.packet = packet

    def _bind(self) -> None:
        """Resolve each compute Action to (handler, args, range name) once."""

        def resolve(a: Action | None) -> tuple:
            if a is None:
                return (None, (), "")
            if a.op is Op.OVERLAP_F_B:
                f, b = a.sub
                args = (self._local(f.stage), f.microbatch, self._local(b.stage), b.microbatch)
                return (self._overlap, args, str(a))
            return (self._handlers[a.op], (self._local(a.stage), a.microbatch), str(a))

        self._train_bound = [(specs, *resolve(a)) for specs, a in self._train_program]
        self._infer_bound = [(specs, *resolve(a)) for specs, a in self._infer_program]

    # --------------------------------------------------------------- the step
    def step(self, inputs: Any, labels: Any, *, scaler: Any = None) -> torch.Tensor:
        """Run one training step; returns the mean loss (0-dim) on every rank.

        ``inputs``/``labels``: the whole batch on rank 0 (a tensor or tuple of tensors, split on
        dim 0), ``None`` elsewhere. ``scaler``: an optional ``torch.amp.GradScaler``; the
        backward seed is scaled by it (call ``unscale_`` before ``scaler.step``).

        With ``capture``, the returned loss of a replayed step is the static loss tensor: it
        aliases graph memory and is overwritten by the next step (clone it to keep it).
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("DualPipeV.step needs grad mode; use forward() for inference")
        sig = self._agree(inputs, labels, train=True)
        if self.capture:
            if scaler is not None:
                raise ValueError("a GradScaler cannot be used with capture; pass scaler=None")
            return self._captured_step(sig, inputs, labels)
        return self._eager_step(sig, inputs, labels, scaler).clone()

    def _eager_step(self, sig: tuple[int, ...], inputs: Any, labels: Any, scaler: Any) -> Any:
        handshake = sig != self._signature
        self._signature = sig
        self._infer = False
        self._activate(None)
        if self.rank == 0:
            self._batch_inputs, self._batch_labels = inputs, labels
            self._mb_inputs = self._split(inputs)
            self._mb_labels = self._split(labels, unwrap=isinstance(labels, torch.Tensor))
        self._prepare_seed(scaler)
        self._run(self._train_bound, handshake)
        self._check_drained()
        loss = self._reduce_loss()
        if handshake and self._stage_handshake:
            self._warm_channels()
        return loss

    def _prepare_seed(self, scaler: Any) -> None:
        if self._losses is None:
            self._alloc_loss()
        if self.rank == 0:
            self._seed.fill_(1.0 / self.num_microbatches)
            self._backward_seed = scaler.scale(self._seed) if scaler is not None else self._seed
        elif scaler is not None:
            scaler.scale(torch.zeros((), device=self.device))  # initializes its scale here too

    def _check_drained(self) -> None:
        for li, store in enumerate(self.stores):
            if store.pending():
                keys = store.pending()
                store.clear()
                raise RuntimeError(
                    f"stage {self.stage_ids[li]} ended the step with deferred weight-gradient "
                    f"work for {keys}; the schedule is missing W actions"
                )

    @torch.no_grad()
    def forward(self, inputs: Any) -> Any:
        """Forward only (no autograd state kept): the concatenated outputs on rank 0, else None.

        Always eager, also on a captured pipeline.
        """
        sig = self._agree(inputs, None, train=False)
        handshake = sig != self._infer_signature
        self._infer_signature = sig
        saved = self._metas, self._mb_inputs  # a captured step's static views stay put
        if self.rank == 0:
            self._mb_inputs = self._split(inputs)
        self._metas = self._infer_metas
        self._infer = True
        try:
            self._run(self._infer_bound, handshake)
        finally:
            self._infer = False
            self._metas, self._mb_inputs = saved
        if self.rank != 0:
            return None
        outs = [_as_tuple(o) for o in self._outputs]
        self._outputs = [None] * self.num_microbatches
        cat = tuple(torch.cat(parts) for parts in zip(*outs))
        return cat[0] if len(cat) == 1 else cat

    def unscale_(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        """``scaler.unscale_(optimizer)`` plus agreement on inf/NaN across the pipeline ranks.

        Every rank must skip (or take) the optimizer step together; call this, then
        ``scaler.step(optimizer)`` and ``scaler.update()`` on every rank.
        """
        scaler.unscale_(optimizer)
        if self.num_ranks > 1:
            state = scaler._per_optimizer_states[id(optimizer)]
            for t in state["found_inf_per_device"].values():
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def _alloc_loss(self) -> None:
        dt = torch.float32
        for m in self.modules:
            for p in m.parameters():
                if p.is_floating_point():
                    dt = torch.promote_types(p.dtype, torch.float32)
                break
        self._losses = torch.zeros(self.num_microbatches, dtype=dt, device=self.device)
        self._seed = torch.zeros((), dtype=dt, device=self.device)
        self._loss_out = torch.zeros((), dtype=dt, device=self.device)

    def _reduce_loss(self) -> torch.Tensor:
        """The mean loss into the static ``_loss_out``, broadcast from rank 0."""
        if self.rank == 0:
            torch.mean(self._losses, dim=0, out=self._loss_out)
        if self.num_ranks > 1:
            dist.broadcast(self._loss_out, src=self._global[0], group=self.group)
        return self._loss_out

    # ------------------------------------------------------ batch agreement
    def _signature_of(self, inputs: Any, labels: Any, train: bool) -> list[int]:
        sig = [int(train)]
        m = self.num_microbatches
        for name, part in (
            (("inputs", inputs), ("labels", labels)) if train else (("inputs", inputs),)
        ):
            if part is None:
                raise ValueError(f"rank 0 needs the batch: {name} must not be None")
            ts = _as_tuple(part)
            sig.append(len(ts))
            for i, t in enumerate(ts):
                if t.dim() == 0 or t.shape[0] % m:
                    raise ValueError(
                        f"{name}[{i}] of shape {list(t.shape)} does not split on dim 0 into "
                        f"num_microbatches={m} equal micro-batches"
                    )
                if t.dtype not in DTYPE_CODE:
                    raise ValueError(f"{name}[{i}] has unsupported dtype {t.dtype}")
                sig += [DTYPE_CODE[t.dtype], t.dim(), *t.shape]
        if len(sig) >= _SIG_LEN:
            raise ValueError(f"the batch has too many tensors or dims ({len(sig)} ints)")
        return sig

    def _split(self, part: Any, unwrap: bool = False) -> list[Any]:
        m = self.num_microbatches
        chunks = [t.to(self.device, non_blocking=True).chunk(m) for t in _as_tuple(part)]
        mbs = [tuple(c[i] for c in chunks) for i in range(m)]
        return [mb[0] for mb in mbs] if unwrap else mbs

    def _agree(self, inputs: Any, labels: Any, train: bool) -> tuple[int, ...]:
        """Rank 0 checks the batch and tells every rank its signature (shapes and dtypes).

        A bad batch raises on every rank, so that no rank is left waiting for a peer.
        """
        sig: list[int] = []
        err: Exception | None = None
        if self.rank == 0:
            try:
                sig = self._signature_of(inputs, labels, train)
            except (ValueError, TypeError) as e:
                sig, err = [], e
        if self._control is not None:
            buf = torch.zeros(_SIG_LEN, dtype=torch.int64)
            if self.rank == 0:
                buf[0] = len(sig)
                buf[1 : len(sig) + 1] = torch.tensor(sig, dtype=torch.int64)
            dist.broadcast(buf, src=self._global[0], group=self._control)
            if self.rank != 0:
                vals = buf.tolist()
                sig = vals[1 : vals[0] + 1]
                if not sig:
                    raise RuntimeError(
                        "rank 0 rejected this batch (see rank 0's error); no rank ran the step"
                    )
        if err is not None:
            raise err
        return tuple(sig)

    # -------------------------------------------------------------- capture
    def _captured_step(self, sig: tuple[int, ...], inputs: Any, labels: Any) -> torch.Tensor:
        cap = self._captures.get(sig)
        if cap is None:
            if self._captures and not self.recapture:
                raise ValueError(_mismatch(next(iter(self._captures)), sig))
            # Warmup: an eager step (on fresh buffers) that records the metadata of everything
            # it touches.
            self._recorder = StepRecord()
            try:
                self._zero_grads()
                loss = self._eager_step(sig, inputs, labels, None).clone()
                if self.optimizer is not None:
                    self.optimizer.step()
                record = self._recorder
            finally:
                self._recorder = None
            self._captures[sig] = self._make_capture(sig, record)
            return loss
        self._activate(cap)
        if self.rank == 0:
            for dst, src in zip(cap.plan.inputs, _as_tuple(inputs)):
                dst.copy_(src, non_blocking=True)
            for dst, src in zip(cap.plan.labels, _as_tuple(labels)):
                dst.copy_(src, non_blocking=True)
        if self.device.type != "cuda":
            # CPU: no graph API; the static step itself is the replay.
            self._static_step()
            return self._loss_out
        if cap.graphs is None:
            cap.graphs = self._capture_graphs()
        self._check_static_grads(cap)
        cap.graphs.replay(self.ranges)
        return self._loss_out

    def _zero_grads(self) -> None:
        """With ``capture_optimizer``: gradients are zeroed in place at the start of a step."""
        if self.optimizer is not None:
            for p in self._params():
                if p.grad is not None:
                    p.grad.zero_()

    def _optimizer_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def _static_step(self) -> None:
        """The step on plan buffers only: what CUDA captures and what CPU runs as replay."""
        self._zero_grads()
        self._prepare_seed(None)
        self._run(self._train_bound, False)
        self._check_drained()
        self._reduce_loss()
        self._optimizer_step()

    def _make_capture(self, sig: tuple[int, ...], record: StepRecord) -> _Capture:
        program: list[tuple[list[tuple[str, int, int]], Action | None]] = []
        metas: dict[tuple[str, int, int], tuple[TensorMeta, ...]] = {}
        readers: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        owners: list[tuple[Any, tuple[str, int, int]]] = []  # (spec or packet, its key)
        for specs, compute in self._train_program:
            keys = []
            for sp in specs:
                packet = sp.packet
                if packet is not None and self._packable(packet):
                    if sp is not packet.specs[0]:
                        continue  # one buffer for the whole packet
                    kind = "send_packet" if sp.is_send else "recv_packet"
                    key = (kind, self.stage_ids[sp.li], sp.mb)
                    ms = [m for p in packet.specs for m in self._metas[p.channel]]
                    numel = sum(math.prod(m.shape) for m in ms)
                    metas[key] = (TensorMeta((numel,), ms[0].dtype, self.device),)
                    readers[key] = (
                        [] if sp.is_send else [(self.stage_ids[p.li], p.mb) for p in packet.specs]
                    )
                    owners.append((packet, key))
                elif sp.is_send:
                    continue
                else:
                    key = (_RECV_KIND[sp.kind], self.stage_ids[sp.li], sp.mb)
                    metas[key] = self._metas[sp.channel]
                    owners.append((sp, key))
                keys.append(key)
            program.append((keys, compute))
        inputs = labels = ()
        if self.rank == 0:
            dev = self.device
            inputs = tuple(TensorMeta.of(t).on(dev) for t in _as_tuple(self._batch_inputs))
            labels = tuple(TensorMeta.of(t).on(dev) for t in _as_tuple(self._batch_labels))
        plan = build_plan(program, metas, inputs, labels, readers)
        bindings = [
            (owner, plan.buffers[key][0] if isinstance(owner, _Packet) else plan.buffers[key])
            for owner, key in owners
        ]
        mb_inputs = self._split(plan.inputs) if self.rank == 0 else []
        unwrap = self.rank == 0 and isinstance(self._batch_labels, torch.Tensor)
        mb_labels = self._split(plan.labels, unwrap=unwrap) if self.rank == 0 else []
        return _Capture(sig, plan, record, dict(self._metas), bindings, mb_inputs, mb_labels)

    def _activate(self, cap: _Capture | None) -> None:
        """Point the program at ``cap``'s plan buffers (None: eager allocation)."""
        if cap is self._active:
            return
        if self._active is not None:
            for sp, _ in self._active.bindings:
                sp.static = None
        if cap is not None:
            for sp, bufs in cap.bindings:
                sp.static = bufs
            self._metas = dict(cap.metas)
            self._signature = cap.signature
            self._mb_inputs = cap.mb_inputs
            self._mb_labels = cap.mb_labels
        self._active = cap

    @property
    def plan(self) -> StaticPlan | None:
        """The static plan of the active capture (None before the warmup step)."""
        return (
            self._active.plan
            if self._active is not None
            else (next(iter(self._captures.values())).plan if self._captures else None)
        )

    @property
    def record(self) -> StepRecord | None:
        """The metadata the warmup step recorded (None before it)."""
        cap = self._active or next(iter(self._captures.values()), None)
        return cap.record if cap is not None else None

    def memory_report(self) -> str:
        """Bytes per kind of the static plan (inputs, labels, P2P receive buffers and packets,
        against one buffer per micro-batch) and of what the warmup step recorded for the
        stored stage activations and gradients (held by autograd, or by the CUDA graph pool
        when captured)."""
        plan, record = self.plan, self.record
        if plan is None or record is None:
            raise RuntimeError("no plan yet: the memory report needs capture and one step")
        stored = record.nbytes()
        return (
            plan.report()
            + f"\nstored stage activations (recorded): {stored['activations']:,} bytes"
            + f"\nstage input gradients (recorded): {stored['grads']:,} bytes"
        )

    def _params(self) -> list[torch.nn.Parameter]:
        seen: dict[int, torch.nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def _capture_graphs(self) -> Any:
        from .graphs import CapturedGraphs

        params = self._params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._static_grads = [(p, p.grad) for p in params]
        self._prepare_seed(None)
        torch.cuda.synchronize()
        if self.num_ranks > 1:
            dist.barrier(group=self.group)  # every rank enters capture together
        if self.capture == "step":
            entries = [("step", self._static_step)]
        else:
            entries = [
                (name or "p2p", functools.partial(self._run_entry, specs, fn, args))
                for specs, fn, args, name in self._train_bound
            ]
            entries.append(("loss", self._reduce_loss))
            if self.optimizer is not None:
                entries.insert(0, ("zero_grad", self._zero_grads))
                entries.append(("optimizer", self._optimizer_step))
        graphs = CapturedGraphs.capture(entries)
        torch.cuda.synchronize()
        if self.num_ranks > 1:
            dist.barrier(group=self.group)
        return graphs

    def _check_static_grads(self, cap: _Capture) -> None:
        for p, g in self._static_grads:
            if p.grad is not g:
                raise RuntimeError(
                    "a parameter's .grad is no longer the tensor the CUDA graph writes: "
                    "with capture, zero gradients with optimizer.zero_grad(set_to_none=False) "
                    "(the graph accumulates into the static .grad tensors; it does not zero them)"
                )

    def close(self) -> None:
        """Destroy captured graphs and plans; call before destroying the process group."""
        self._activate(None)
        for cap in self._captures.values():
            if cap.graphs is not None:
                cap.graphs.reset()
        self._captures.clear()

    def _run_entry(self, specs: tuple, fn: Any, args: tuple) -> None:
        if specs:
            self._communicate(specs, False)
        if fn is not None:
            fn(*args)

    # ------------------------------------------------------------ the loop
    def _run(self, program: list[tuple], handshake: bool) -> None:
        ranges = self.ranges
        depth = ranges.depth
        ranges.push("step")
        try:
            for specs, fn, args, name in program:
                if specs:
                    self._communicate(specs, handshake)
                if fn is not None:
                    ranges.push(name)
                    fn(*args)
                    ranges.pop()
        except BaseException:
            self._drop_step_state()
            raise
        finally:
            ranges.unwind(depth)

    def _drop_step_state(self) -> None:
        """After a failed step: forget its micro-batches and deferred work."""
        for table in (self._in, self._out, self._gout, self._gin):
            for row in table:
                row[:] = [None] * len(row)
        for store in self.stores:
            store.clear()

    def _take_message(self, sp: _CommSpec) -> Tensors:
        """What ``sp`` sends; a sent gradient (or, in inference, a sent output) is dropped."""
        if sp.kind == "F":
            msg = tuple(t.detach().contiguous() for t in self._out[sp.li][sp.mb])
            if self._infer:
                self._out[sp.li][sp.mb] = None
            return msg
        msg = self._gin[sp.li][sp.mb]
        self._gin[sp.li][sp.mb] = None
        return msg

    def _communicate(self, specs: tuple[_CommSpec, ...], handshake: bool) -> None:
        """One batch: post every send and receive, then wait for all of them."""
        if handshake:
            self._handshake_batch(specs)
            return
        ops: list[dist.P2POp] = []
        metas = self._metas
        isend, P2POp = dist.isend, dist.P2POp
        pack = not self._infer
        for sp in specs:
            packet = sp.packet
            if pack and packet is not None and self._packable(packet):
                if sp is packet.specs[0]:
                    ops.append(self._packet_op(packet))
                continue
            if not sp.is_send:
                ops += self._post_recv(sp, metas[sp.channel])
                continue
            msg = self._take_message(sp)
            check_message(
                "activation" if sp.kind == "F" else "gradient", sp.channel, msg, metas[sp.channel]
            )
            group = self._channel_groups[sp.channel]
            for t in msg:
                ops.append(P2POp(isend, t, sp.peer, group, sp.tag))
        wait_all(issue(ops))

    def _handshake_batch(self, specs: tuple[_CommSpec, ...]) -> None:
        """A batch of a handshake step: each message is preceded by a header with its metadata.

        Sends (headers and payloads) are posted at once; receivers wait for their headers
        only, then post the payload receives, so the batch has the dependencies of any other
        batch. gloo posts each op on its own, which makes this safe. NCCL runs the groups of a
        communicator one after another on its stream, and a batch's sends and receives must
        share one group, which needs the metadata first: there the handshake travels over the
        gloo control group through host memory (once per batch signature), and afterwards
        ``_warm_channels`` initializes the NCCL paths.
        """
        staged = self._stage_handshake
        ops: list[dist.P2POp] = []
        header_ops: list[dist.P2POp] = []
        headers: list[tuple[_CommSpec, torch.Tensor]] = []
        isend, irecv, P2POp = dist.isend, dist.irecv, dist.P2POp
        for sp in specs:
            group = self._control if staged else self._channel_groups[sp.channel]
            h = torch.empty(HEADER_LEN, dtype=torch.int64)
            if sp.is_send:
                msg = self._take_message(sp)
                self._metas[sp.channel] = tuple(TensorMeta.of(t) for t in msg)
                if staged:
                    msg = tuple(t.cpu() for t in msg)
                ops.append(
                    P2POp(isend, encode_header(msg, h), sp.peer, group, sp.tag + HEADER_TAG_OFFSET)
                )
                ops += [P2POp(isend, t, sp.peer, group, sp.tag) for t in msg]
            else:
                headers.append((sp, h))
                header_ops.append(P2POp(irecv, h, sp.peer, group, sp.tag + HEADER_TAG_OFFSET))
        header_works = issue(header_ops)
        works = issue(ops)
        wait_all(header_works)
        staging = []
        ops = []
        for sp, h in headers:
            metas = self._metas[sp.channel] = decode_header(h, self.device)
            if staged:
                bufs = tuple(m.on(torch.device("cpu")).empty() for m in metas)
                staging.append((sp, bufs))
                ops += [P2POp(irecv, t, sp.peer, self._control, sp.tag) for t in bufs]
            else:
                ops += self._post_recv(sp, metas)
        works += issue(ops)
        wait_all(works)
        for sp, bufs in staging:
            self._store_received(sp, tuple(t.to(self.device) for t in bufs))

    def _warm_channels(self) -> None:
        """One exchange on every channel of this rank, with the recorded metadata, in one batch.

        After a handshake over the control group (NCCL): initializes the communicators on the
        paths the steps use, before any capture. Every rank walks the channels in the same
        order, so messages between two ranks pair up in order.
        """
        ops = []
        for ch, group in self._channel_groups.items():
            src, dst = (self._global[self.placement.rank_of(s)] for s in ch)
            me = self._global[self.rank]
            if me not in (src, dst) or ch not in self._metas:
                continue
            op, peer = (dist.isend, dst) if me == src else (dist.irecv, src)
            for m in self._metas[ch]:
                t = torch.zeros(m.shape, dtype=m.dtype, device=self.device)
                ops.append(dist.P2POp(op, t, peer, group, self._channel_tags[ch]))
        wait_all(issue(ops))

    def _packable(self, packet: _Packet) -> bool:
        """One dtype across the packet (both ends know the same metadata)."""
        dtypes = {m.dtype for sp in packet.specs for m in self._metas[sp.channel]}
        return len(dtypes) == 1

    def _packet_op(self, packet: _Packet) -> dist.P2POp:
        """The one P2P op of a packet: sends concatenate the messages; receives get one flat
        buffer whose slices are the messages."""
        if packet.specs[0].is_send:
            parts = []
            for sp in packet.specs:
                msg = self._take_message(sp)
                what = "activation" if sp.kind == "F" else "gradient"
                check_message(what, sp.channel, msg, self._metas[sp.channel])
                parts += [t.reshape(-1) for t in msg]
            flat = packet.static
            flat = torch.cat(parts) if flat is None else torch.cat(parts, out=flat)
            return dist.P2POp(dist.isend, flat, packet.peer, packet.group, _PACKET_TAG)
        metas = [self._metas[sp.channel] for sp in packet.specs]
        numels = [math.prod(m.shape) for ms in metas for m in ms]
        flat = packet.static
        if flat is None:
            flat = torch.empty(sum(numels), dtype=metas[0][0].dtype, device=self.device)
        views = iter(flat.split(numels))
        for sp, ms in zip(packet.specs, metas):
            # The messages are views of the flat buffer: no copy out after the wait.
            self._store_received(sp, tuple(next(views).view(m.shape) for m in ms))
        return dist.P2POp(dist.irecv, flat, packet.peer, packet.group, _PACKET_TAG)

    def _store_received(self, sp: _CommSpec, bufs: Tensors) -> None:
        if sp.kind == "F":
            self._in[sp.li][sp.mb] = bufs
        else:
            self._gout[sp.li][sp.mb] = bufs

    def _post_recv(self, sp: _CommSpec, metas: tuple[TensorMeta, ...]) -> list[dist.P2POp]:
        bufs = sp.static if sp.static is not None else tuple(m.empty() for m in metas)
        self._store_received(sp, bufs)
        group = self._channel_groups[sp.channel]
        return [dist.P2POp(dist.irecv, t, sp.peer, group, sp.tag) for t in bufs]

    # ------------------------------------------------------------- handlers
    def _forward_inputs(self, li: int, mb: int) -> Tensors:
        s = self.stage_ids[li]
        if s == 0:
            x = self._mb_inputs[mb]
        elif li == 1 and s - 1 == self.stage_ids[0]:  # the V-turn: stage N-1 feeds N locally
            x = self._out[0][mb]
            if self._infer:
                self._out[0][mb] = None
                x = tuple(t.detach() for t in x)
            else:
                x = _leaves(x)
        else:
            x = self._in[li][mb]
            if not self._infer:
                x = _leaves(x)
        self._in[li][mb] = x
        return x

    def _finish_forward(self, li: int, mb: int, y: Any) -> None:
        y = _as_tuple(y)
        if self._recorder is not None:
            self._recorder.forward(self.stage_ids[li], mb, self._in[li][mb], y)
        if self.stage_ids[li] == self.last_stage:
            if self._infer:
                self._in[li][mb] = None
                self._outputs[mb] = y[0] if len(y) == 1 else y
                return
            loss = self.loss_fn(y[0] if len(y) == 1 else y, self._mb_labels[mb])
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a 0-dim tensor, got {list(loss.shape)}")
            self._losses[mb] = loss.detach()
            y = (loss,)
        elif self._infer:
            self._in[li][mb] = None
        self._out[li][mb] = y

    def _forward(self, li: int, mb: int) -> None:
        x = self._forward_inputs(li, mb)
        self.stores[li].split = self._split_backward[li][mb]
        self._finish_forward(li, mb, self.modules[li](*x))

    def _backward_operands(self, li: int, mb: int) -> tuple[list, list]:
        outs = self._out[li][mb]
        if self.stage_ids[li] == self.last_stage:
            return list(outs), [self._backward_seed]
        tensors, grads = [], []
        for t, g in zip(outs, self._gout[li][mb]):
            if t.requires_grad:
                tensors.append(t)
                grads.append(g)
        return tensors, grads

    def _finish_backward(self, li: int, mb: int) -> None:
        """Drop the micro-batch's state and route its input gradients (send or V-turn)."""
        s = self.stage_ids[li]
        x = self._in[li][mb]
        self._in[li][mb] = self._out[li][mb] = self._gout[li][mb] = None
        if s == 0:
            return
        gin = tuple(
            (t.grad if t.grad is not None else torch.zeros_like(t)) for t in x if t.requires_grad
        )
        if self._recorder is not None:
            self._recorder.backward(s, mb, gin)
        if li == 1 and s - 1 == self.stage_ids[0]:  # V-turn: the grads go to stage N-1 locally
            self._gout[0][mb] = gin
        else:
            self._gin[li][mb] = gin

    def _backward_full(self, li: int, mb: int) -> None:
        tensors, grads = self._backward_operands(li, mb)
        if tensors:
            torch.autograd.backward(tensors, grads)
        self._finish_backward(li, mb)

    def _backward_input(self, li: int, mb: int) -> None:
        tensors, grads = self._backward_operands(li, mb)
        with self.stores[li].deferring((self.stage_ids[li], mb)):
            if tensors:
                torch.autograd.backward(tensors, grads)
        self._finish_backward(li, mb)

    def _weight(self, li: int, mb: int) -> None:
        self.stores[li].run((self.stage_ids[li], mb))

    def _overlap(self, fli: int, fmb: int, bli: int, bmb: int) -> None:
        """An F&B pair: the stage's overlap hook if it has one, else F then B.

        The hook is ``type(module).overlapped_forward_backward(forward_module, forward_inputs,
        backward_module, backward_outputs, backward_grads)``; it must run the backward of
        ``backward_outputs`` with ``backward_grads`` (``torch.autograd.backward``) and return
        the forward outputs, overlapping the two as it sees fit (DualPipe's hook).
        """
        fmod, bmod = self.modules[fli], self.modules[bli]
        hook = getattr(type(fmod), _OVERLAP_HOOK, None)
        if hook is None or type(fmod) is not type(bmod):
            self._forward(fli, fmb)
            self._backward_full(bli, bmb)
            return
        x = self._forward_inputs(fli, fmb)
        self.stores[fli].split = self._split_backward[fli][fmb]
        tensors, grads = self._backward_operands(bli, bmb)
        y = hook(fmod, x, bmod, tuple(tensors), tuple(grads))
        self._finish_forward(fli, fmb, y)
        self._finish_backward(bli, bmb)
