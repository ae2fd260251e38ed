"""The communication engine: asynchronous point-to-point transfers between pipeline ranks.

Owns the process groups the P2P travels on, the metadata of every channel (what crosses each
stage edge), the first-step handshake, gloo packets, and the sends in flight. Its API is three
calls, driven by the compiled program:

* ``transfer.post()`` at the step the lowering puts it in: sends take their tensors from the
  stage runner and go; receives get buffers (fresh, or the active plan's) that the runner's
  tables point at from then on. Nothing waits.
* ``transfer.wait()`` right before the first compute that reads one of its messages: the
  only place a rank blocks on a peer (inside a ``wait ...`` range).
* ``engine.finish()`` at the end of the step: waits for the sends in flight (``wait sends``).

A *transfer* (``graphpipe.lower.Transfer``) is a run of messages on one directed rank pair
that both ends post in one batch, so both ends group them the same way: on NCCL one group of
P2P ops on the rank pair's own communicator (one process group per directed rank pair, so
that no two rank pairs' transfers queue behind each other on one NCCL stream, and every
communicator carries its transfers in the same order at both ends); on gloo one packet (the
messages concatenated into one flat buffer, when they share a dtype) or one op per tensor,
in order. Messages on a rank pair are FIFO: the i-th one sent is the i-th one received.

May touch: its process groups, buffers it allocates, the runner's message tables through
``take_*`` / ``store_*``. Must not: run stage code.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from graphpipe.ir import Action, Op
from graphpipe.lower import Transfer, channel
from graphpipe.meta import DTYPE_CODE, DTYPES, TensorMeta, describe
from graphpipe.nvtx import Ranges

from .stage import StageRunner

__all__ = [
    "HEADER_LEN",
    "CommEngine",
    "RecvTransfer",
    "SendTransfer",
    "check_message",
    "decode_header",
    "encode_header",
]

Channel = tuple[int, int]
Tensors = tuple[torch.Tensor, ...]
HEADER_LEN = 128
DATA_TAG = 0
HEADER_TAG = 1  # headers travel apart from the data (gloo matches per peer and tag, in order)


# --------------------------------------------------------------------------------------------
# Headers and checks


def encode_header(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Write ``[count, (dtype, requires_grad, ndim, *shape) ...]`` into the int64 ``out``."""
    vals = [len(tensors)]
    for t in tensors:
        if t.dtype not in DTYPE_CODE:
            raise ValueError(f"dtype {t.dtype} cannot cross a pipeline edge")
        vals += [DTYPE_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    if len(vals) > HEADER_LEN:
        raise ValueError(
            f"a stage output of {len(tensors)} tensors with shapes "
            f"{[tuple(t.shape) for t in tensors]} does not fit a {HEADER_LEN}-int header"
        )
    out.zero_()
    out[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
    return out


def decode_header(header: torch.Tensor, device: torch.device) -> tuple[TensorMeta, ...]:
    vals = header.tolist()
    count, i, metas = vals[0], 1, []
    for _ in range(count):
        code, rg, ndim = vals[i : i + 3]
        shape = tuple(vals[i + 3 : i + 3 + ndim])
        metas.append(TensorMeta(shape, DTYPES[code], device, bool(rg)))
        i += 3 + ndim
    return tuple(metas)


def check_message(
    what: str, channel: Channel, tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta]
) -> None:
    """Raise ``ValueError`` naming the edge and tensor when ``tensors`` do not fit ``metas``."""
    if len(tensors) != len(metas):
        raise ValueError(
            f"{what} on edge stage {channel[0]} -> stage {channel[1]}: {len(tensors)} tensors, "
            f"but the first step exchanged {len(metas)} {describe(metas)}"
        )
    for i, (t, m) in enumerate(zip(tensors, metas, strict=True)):
        if t.shape != m.shape or t.dtype != m.dtype:
            raise ValueError(
                f"{what} on edge stage {channel[0]} -> stage {channel[1]}, tensor {i}: "
                f"shape {list(t.shape)} {str(t.dtype).removeprefix('torch.')}, but the first "
                f"step exchanged {m}"
            )


# --------------------------------------------------------------------------------------------
# Transfers


class _Msg:
    """One message of a transfer: local stage, micro-batch, direction, channel."""

    __slots__ = ("action", "channel", "forward", "li", "mb")

    def __init__(self, action: Action, li: int) -> None:
        self.action, self.li, self.mb = action, li, action.microbatch
        self.forward = action.op in (Op.SEND_F, Op.RECV_F)
        self.channel = channel(action)


class _Transfer:
    __slots__ = ("edge", "engine", "group", "index", "msgs", "name", "peer", "peer_global")

    def __init__(self, engine: CommEngine, spec: Transfer, actions: Sequence[Action]) -> None:
        self.engine = engine
        self.index = spec.index
        self.edge = (spec.src, spec.dst)
        self.msgs = tuple(_Msg(a, engine.runner.local[a.stage]) for a in actions)
        other = spec.dst if spec.src == engine.rank else spec.src
        self.peer_global = engine.global_ranks[other]
        self.group = engine.edge_group(self.edge)
        self.peer = dist.get_group_rank(self.group, self.peer_global)
        self.name = " ".join(map(str, actions))

    def metas(self) -> list[tuple[TensorMeta, ...]]:
        return [self.engine.metas[m.channel] for m in self.msgs]

    def packable(self) -> bool:
        """Whether the messages travel as one flat packet (gloo, two or more tensors of one
        dtype); both ends tell the same from the channel metadata they both know."""
        if not self.engine.packets:
            return False
        metas = [m for ms in self.metas() for m in ms]
        return len(metas) > 1 and len({m.dtype for m in metas}) == 1


class SendTransfer(_Transfer):
    """This rank's sending end of a transfer.

    static: the active plan's packet buffer.
    recorded: what it sent while per-action graphs were captured; replays send these (the
        graphs rewrite them in place).
    """

    __slots__ = ("recorded", "static")

    def __init__(self, engine: CommEngine, spec: Transfer) -> None:
        super().__init__(engine, spec, spec.sends)
        self.static: torch.Tensor | None = None
        self.recorded: tuple[torch.Tensor, ...] | None = None

    def post(self) -> None:
        self.engine.post_send(self)


class RecvTransfer(_Transfer):
    """This rank's receiving end of a transfer.

    static: the active plan's buffers (a flat packet buffer, or per message a tuple).
    works: the posted receives; staged / headers: handshake state.
    """

    __slots__ = ("headers", "resolved", "staged", "static", "wait_name", "works")

    def __init__(self, engine: CommEngine, spec: Transfer) -> None:
        super().__init__(engine, spec, spec.recvs)
        self.static: Any = None
        self.works: list = []
        self.headers: list[tuple[_Msg, torch.Tensor, Any]] = []
        self.staged: list[tuple[_Msg, Tensors]] = []
        self.resolved = True
        self.wait_name = "wait " + self.name

    def post(self) -> None:
        self.engine.post_recv(self)

    def wait(self) -> None:
        self.engine.wait_recv(self)


# --------------------------------------------------------------------------------------------
# The engine


class CommEngine:
    """P2P for one pipeline rank; see the module doc.

    runner: the stage runner whose tables the messages come from and go to.
    rank / global_ranks: this rank in the pipeline group, and every pipeline rank's global rank.
    groups: ``{(src, dst): process group}`` per directed rank pair with traffic.
    control: a gloo group over the pipeline ranks (the handshake on NCCL, batch agreement).
    staged: the handshake travels over ``control`` through host memory (NCCL), after which
        every channel is warmed up once.
    """

    def __init__(
        self,
        runner: StageRunner,
        rank: int,
        global_ranks: Sequence[int],
        groups: dict[tuple[int, int], Any],
        control: Any,
        device: torch.device,
        ranges: Ranges,
        staged: bool,
        packets: bool,
    ) -> None:
        self.runner, self.rank, self.global_ranks = runner, rank, list(global_ranks)
        self.groups, self.control, self.device, self.ranges = groups, control, device, ranges
        self.staged, self.packets = staged, packets
        self.nccl = any(dist.get_backend(g) == "nccl" for g in groups.values())
        self.metas: dict[Channel, tuple[TensorMeta, ...]] = {}
        self.handshake = False
        # Per-action CUDA graphs: the capture pass records what each send sends, replays send
        # the recorded tensors (see graphs.py).
        self.record_sends = self.replay_sends = False
        self.in_flight: list[tuple[list, Tensors]] = []  # (works, tensors they read)
        self._unresolved: dict[tuple[int, int], deque[RecvTransfer]] = {}

    def edge_group(self, edge: tuple[int, int]) -> Any:
        return self.groups[edge]

    # ------------------------------------------------------------- steps
    def begin(self, handshake: bool) -> None:
        self.handshake = handshake

    def finish(self) -> None:
        """Wait for every send of the step (and, after a staged handshake, warm up)."""
        if self.in_flight:
            ranges = self.ranges
            ranges.push("wait sends")
            try:
                for works, _ in self.in_flight:
                    for w in works:
                        w.wait()
            finally:
                ranges.pop()
            self.in_flight.clear()

    def abandon(self) -> None:
        """Forget the step's posted work (after a failed step)."""
        self.in_flight.clear()
        self._unresolved.clear()

    # ------------------------------------------------------------- issue
    def _issue(self, group: Any, peer: int, peer_global: int, tensors: Sequence, send: bool):
        """Post ``tensors`` to (or from) ``peer`` as one group of ops; returns the works."""
        if self.nccl and len(tensors) > 1:
            fn = dist.isend if send else dist.irecv
            return dist.batch_isend_irecv(
                [dist.P2POp(fn, t, peer_global, group, DATA_TAG) for t in tensors]
            )
        call = group.send if send else group.recv
        return [call([t], peer, DATA_TAG) for t in tensors]

    def post_send(self, t: SendTransfer) -> None:
        runner = self.runner
        tensors: list[torch.Tensor] = []
        if self.handshake:
            self._handshake_send(t)
            return
        if self.replay_sends:
            sent = t.recorded
            self.in_flight.append((self._issue(t.group, t.peer, t.peer_global, sent, True), sent))
            return
        metas = self.metas
        for m in t.msgs:
            msg = runner.take_activation(m.li, m.mb) if m.forward else runner.take_grad(m.li, m.mb)
            check_message(
                "activation" if m.forward else "gradient", m.channel, msg, metas[m.channel]
            )
            tensors += msg
        if len(tensors) > 1 and t.packable():
            flat = t.static
            parts = [x.reshape(-1) for x in tensors]
            flat = torch.cat(parts) if flat is None else torch.cat(parts, out=flat)
            tensors = [flat]
        if self.record_sends:
            t.recorded = tuple(tensors)
        self.in_flight.append(
            (self._issue(t.group, t.peer, t.peer_global, tensors, True), tuple(tensors))
        )

    def post_recv(self, t: RecvTransfer) -> None:
        runner = self.runner
        if self.handshake:
            self._handshake_recv(t)
            return
        metas = t.metas()
        if t.packable():
            numels = [math.prod(m.shape) for ms in metas for m in ms]
            flat = t.static
            if flat is None:
                flat = torch.empty(sum(numels), dtype=metas[0][0].dtype, device=self.device)
            views = iter(flat.split(numels))
            for m, ms in zip(t.msgs, metas, strict=True):
                # The messages are views of the flat buffer: no copy out after the wait.
                bufs = tuple(next(views).view(x.shape) for x in ms)
                (runner.store_activation if m.forward else runner.store_grad)(m.li, m.mb, bufs)
            t.works = self._issue(t.group, t.peer, t.peer_global, [flat], False)
            return
        tensors: list[torch.Tensor] = []
        static = t.static
        for i, (m, ms) in enumerate(zip(t.msgs, metas, strict=True)):
            bufs = static[i] if static is not None else tuple(x.empty() for x in ms)
            (runner.store_activation if m.forward else runner.store_grad)(m.li, m.mb, bufs)
            tensors += bufs
        t.works = self._issue(t.group, t.peer, t.peer_global, tensors, False)

    def wait_recv(self, t: RecvTransfer) -> None:
        ranges = self.ranges
        ranges.push(t.wait_name)
        try:
            if not t.resolved:
                self._resolve(t)
            for w in t.works:
                w.wait()
            t.works = []
            if t.staged:
                for m, bufs in t.staged:
                    moved = tuple(b.to(self.device) for b in bufs)
                    store = self.runner.store_activation if m.forward else self.runner.store_grad
                    store(m.li, m.mb, moved)
                t.staged = []
        finally:
            ranges.pop()

    # --------------------------------------------------------- handshake
    def _handshake_send(self, t: SendTransfer) -> None:
        """A send of a handshake step: each message preceded by a header with its metadata.

        Headers go on their own tag; the receiver waits for them only when a compute reads
        the transfer (``_resolve``), then posts the payload receives, in send order per rank
        pair. On NCCL everything goes over the gloo control group through host memory: an
        NCCL group needs its sends and receives at once, which needs the metadata first.
        """
        runner = self.runner
        group, peer = (self.control, t.peer_global) if self.staged else (t.group, t.peer)
        if self.staged:
            peer = dist.get_group_rank(group, t.peer_global)
        works, keep = [], []
        for m in t.msgs:
            msg = runner.take_activation(m.li, m.mb) if m.forward else runner.take_grad(m.li, m.mb)
            self.metas[m.channel] = tuple(TensorMeta.of(x) for x in msg)
            if self.staged:
                msg = tuple(x.cpu() for x in msg)
            header = encode_header(msg, torch.empty(HEADER_LEN, dtype=torch.int64))
            works.append(group.send([header], peer, HEADER_TAG))
            works += [group.send([x], peer, DATA_TAG) for x in msg]
            keep += [header, *msg]
        self.in_flight.append((works, tuple(keep)))

    def _handshake_recv(self, t: RecvTransfer) -> None:
        group, peer = (self.control, t.peer_global) if self.staged else (t.group, t.peer)
        if self.staged:
            peer = dist.get_group_rank(group, t.peer_global)
        t.headers = []
        for m in t.msgs:
            h = torch.empty(HEADER_LEN, dtype=torch.int64)
            t.headers.append((m, h, group.recv([h], peer, HEADER_TAG)))
        t.resolved = False
        self._unresolved.setdefault(t.edge, deque()).append(t)

    def _resolve(self, t: RecvTransfer) -> None:
        """Read the headers of ``t`` and of every transfer posted before it on its rank pair,
        and post their payload receives, in order."""
        queue = self._unresolved[t.edge]
        cpu = torch.device("cpu")
        while queue:
            u = queue.popleft()
            group, peer = (self.control, u.peer_global) if self.staged else (u.group, u.peer)
            if self.staged:
                peer = dist.get_group_rank(group, u.peer_global)
            works = []
            for m, h, hw in u.headers:
                hw.wait()
                metas = self.metas[m.channel] = decode_header(h, self.device)
                bufs = tuple(x.on(cpu if self.staged else self.device).empty() for x in metas)
                if self.staged:
                    u.staged.append((m, bufs))
                else:
                    store = self.runner.store_activation if m.forward else self.runner.store_grad
                    store(m.li, m.mb, bufs)
                works += [group.recv([b], peer, DATA_TAG) for b in bufs]
            u.works, u.headers, u.resolved = works, [], True
            if u is t:
                return

    def warm(self) -> None:
        """One exchange on every rank pair with the recorded metadata, all at once: after a
        handshake over the control group (NCCL), initializes each communicator's P2P paths
        before any capture. Every rank walks the pairs in the same order."""
        works = []
        for (src, dst), group in sorted(self.groups.items()):
            if self.rank not in (src, dst):
                continue
            other = dst if self.rank == src else src
            peer = dist.get_group_rank(group, self.global_ranks[other])
            x = torch.zeros(1, device=self.device)
            call = group.send if self.rank == src else group.recv
            works.append(call([x], peer, DATA_TAG))
        for w in works:
            w.wait()
