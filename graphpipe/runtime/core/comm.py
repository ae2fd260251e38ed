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

A *transfer* (``graphpipe.schedule.lower.Transfer``) is a run of messages on one directed rank pair
that both ends post in one batch, so both ends group them the same way: on NCCL one group of
P2P ops on the rank pair's own communicator (one process group per directed rank pair, so
that no two rank pairs' transfers queue behind each other on one NCCL stream, and every
communicator carries its transfers in the same order at both ends); on gloo one packet (the
messages concatenated into one flat buffer, when they share a dtype) or one op per tensor,
in order. Messages on a rank pair are FIFO: the i-th one sent is the i-th one received.

A failed wait raises ``faults.CommFailure`` naming the peer; ``abandon()`` lets go of every
posted operation (their connections can then close, see ``faults``).

May touch: the process groups of ``PipelineGroups`` (looked up at each post, so a rebuild
takes effect at once), buffers it allocates, the runner's message tables through
``take_*`` / ``store_*``. Must not: run stage code.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from graphpipe.meta import TensorMeta
from graphpipe.nvtx import Ranges
from graphpipe.schedule.ir import Action, Op
from graphpipe.schedule.lower import Transfer, channel

from ..coordination.faults import CommFailure
from ..coordination.groups import PipelineGroups
from .messages import (
    DATA_TAG,
    HEADER_LEN,
    HEADER_TAG,
    Channel,
    check_message,
    decode_header,
    encode_header,
)
from .stage import StageRunner

__all__ = ["CommEngine", "RecvTransfer", "SendTransfer"]

Tensors = tuple[torch.Tensor, ...]


# --------------------------------------------------------------------------------------------
# Transfers


class _Msg:
    """One message of a transfer: local stage, micro-batch, direction, channel."""

    __slots__ = ("action", "channel", "forward", "li", "mb")

    def __init__(self, action: Action, li: int) -> None:
        self.action, self.li, self.mb = action, li, action.microbatch
        self.forward = action.op in (Op.SEND_F, Op.RECV_F)
        self.channel = channel(action)


def _wait_all(works: list, peer: int | None, what: str) -> None:
    """Wait for ``works``; a failure becomes ``CommFailure``, holding no work (a posted work
    keeps its connection open, and the peers blocked on it waiting)."""
    try:
        for w in works:
            w.wait()
    except RuntimeError as e:
        works.clear()
        w = None  # the frame stays in the traceback: it must not hold the work
        raise CommFailure(peer, what, e.with_traceback(None)) from None
    works.clear()


def _posting_failed(t: _Transfer, e: BaseException) -> CommFailure:
    return CommFailure(t.peer_rank, f"post {t.name}", e.with_traceback(None))


class _Transfer:
    __slots__ = ("_cache", "edge", "engine", "index", "msgs", "name", "peer_global", "peer_rank")
    static: Any

    def __init__(self, engine: CommEngine, spec: Transfer, actions: Sequence[Action]) -> None:
        self.engine = engine
        self.index = spec.index
        self.edge = (spec.src, spec.dst)
        self.msgs = tuple(_Msg(a, engine.runner.local[a.stage]) for a in actions)
        self.peer_rank = spec.dst if spec.src == engine.rank else spec.src
        self.peer_global = engine.groups.global_ranks[self.peer_rank]
        self.name = " ".join(map(str, actions))
        self._cache: tuple[int, list, bool] = (-1, [], False)
        engine.transfers.append(self)

    def _derived(self) -> tuple[int, list, bool]:
        """``(metadata epoch, metas, packable)``, recomputed when the metadata changed."""
        engine = self.engine
        if self._cache[0] != engine.epoch:
            metas = [engine.metas[m.channel] for m in self.msgs]
            flat = [m for ms in metas for m in ms]
            packed = not engine.groups.nccl and len(flat) > 1 and len({m.dtype for m in flat}) == 1
            self._cache = (engine.epoch, metas, packed)
        return self._cache

    def metas(self) -> list[tuple[TensorMeta, ...]]:
        return self._derived()[1]

    def packable(self) -> bool:
        """Whether the messages travel as one flat packet (gloo, two or more tensors of one
        dtype); both ends tell the same from the channel metadata they both know."""
        return self._derived()[2]

    def bind(self, static: Any) -> None:
        """Use the active plan's buffers ``static`` from now on (None: allocate per step)."""
        self.static = static


class SendTransfer(_Transfer):
    """This rank's sending end of a transfer.

    static: the active plan's packet buffer.
    recorded: the tensors ``CommEngine.prepare_send`` made ready for the next post (with
        ``capture="action"`` inside a graph, so that each replay rewrites them in place); the
        capture driver keeps them per capture and binds them back with ``bind``.
    """

    __slots__ = ("recorded", "static")

    def __init__(self, engine: CommEngine, spec: Transfer) -> None:
        super().__init__(engine, spec, spec.sends)
        self.static: torch.Tensor | None = None
        self.recorded: tuple[torch.Tensor, ...] | None = None

    def post(self) -> None:
        self.engine.post_send(self)

    def bind(self, static: Any, recorded: tuple[torch.Tensor, ...] | None = None) -> None:
        """Use the active plan's packet buffer ``static`` (None: allocate per step) and the
        prepared tensors ``recorded`` of that capture."""
        self.static, self.recorded = static, recorded


class RecvTransfer(_Transfer):
    """This rank's receiving end of a transfer.

    static: the active plan's buffers (a flat packet buffer, or per message a tuple).
    works: the posted receives; headers / host_bufs: handshake state (``host_bufs``: the
    payload received into host memory over the control group, NCCL, moved to the device
    after the wait).
    """

    __slots__ = ("headers", "host_bufs", "resolved", "static", "wait_name", "works")

    def __init__(self, engine: CommEngine, spec: Transfer) -> None:
        super().__init__(engine, spec, spec.recvs)
        self.static: Any = None
        self.works: list = []
        self.headers: list[tuple[_Msg, torch.Tensor, Any]] = []
        self.host_bufs: list[tuple[_Msg, Tensors]] = []
        self.resolved = True
        self.wait_name = "wait " + self.name

    def post(self) -> None:
        self.engine.post_recv(self)

    def wait(self) -> None:
        self.engine.wait_recv(self)

    def forget(self) -> None:
        self.works, self.headers, self.host_bufs, self.resolved = [], [], [], True


# --------------------------------------------------------------------------------------------
# The engine


class CommEngine:
    """P2P for one pipeline rank; see the module doc.

    runner: the stage runner whose tables the messages come from and go to.
    rank: this pipeline rank. groups: the pipeline's process groups.
    staged: the handshake travels over the control group through host memory (NCCL), after
        which every rank pair is warmed up once.
    """

    def __init__(
        self,
        runner: StageRunner,
        rank: int,
        groups: PipelineGroups,
        device: torch.device,
        ranges: Ranges,
        staged: bool,
    ) -> None:
        self.runner, self.rank, self.groups = runner, rank, groups
        self.device, self.ranges, self.staged = device, ranges, staged
        self.transfers: list[_Transfer] = []
        self._metas: dict[Channel, tuple[TensorMeta, ...]] = {}
        self.epoch = 0  # bumped whenever the metadata may have changed (see _Transfer._derived)
        self.handshake = False
        # Per-action graphs: each send's tensors are made ready inside a graph
        # (``prepare_send``) and the eager post only issues them; set by ``begin``'s ``sends``.
        self.prepared_sends = False
        self.in_flight: list[tuple[list, Tensors, int]] = []  # (works, tensors, peer rank)
        self._unresolved: dict[tuple[int, int], deque[RecvTransfer]] = {}

    @property
    def metas(self) -> dict[Channel, tuple[TensorMeta, ...]]:
        """What crosses each channel: ``{(src stage, dst stage): metadata per tensor}``."""
        return self._metas

    def set_ranges(self, ranges: Ranges) -> None:
        """Emit the waits' ranges through ``ranges`` from now on."""
        self.ranges = ranges

    def use_metas(self, metas: dict[Channel, tuple[TensorMeta, ...]]) -> None:
        """Take ``metas`` as the channels' metadata (another program's, a plan's)."""
        self._metas = metas
        self.epoch += 1

    # ------------------------------------------------------------- steps
    def begin(self, handshake: bool, sends: str | None = None) -> None:
        """Start a step. ``handshake``: its first step of a batch signature (headers
        travel first). ``sends``: ``"prepared"`` while per-action graphs are captured or
        replayed (a post sends what ``prepare_send`` made ready), None otherwise."""
        if sends not in (None, "prepared"):
            raise ValueError(f"sends must be None or 'prepared', got {sends!r}")
        self.handshake = handshake
        self.prepared_sends = sends == "prepared"
        if handshake:  # it writes new metadata as it goes
            self.epoch += 1

    def finish(self) -> None:
        """Wait for every send of the step (inside ``wait sends``)."""
        if self.handshake:
            self.epoch += 1
        if not self.in_flight:
            return
        ranges = self.ranges
        ranges.push("wait sends")
        try:
            while self.in_flight:
                works, _, peer = self.in_flight.pop()
                _wait_all(works, peer, "wait sends")
        finally:
            ranges.pop()

    def abandon(self) -> None:
        """Let go of every posted operation (after a failed step)."""
        self.in_flight.clear()
        self._unresolved.clear()
        for t in self.transfers:
            if isinstance(t, RecvTransfer):
                t.forget()

    # ------------------------------------------------------------- issue
    def _issue(self, t: _Transfer, tensors: Sequence, send: bool) -> list:
        """Post ``tensors`` to (or from) ``t``'s peer as one group of ops; returns the works.
        On NCCL always as a batch (``batch_isend_irecv``), one tensor too: torch runs a lone
        send and a batch on different communicators of a pair (pytorch#160342), and the
        warm-up (``warm``) warms the batch's."""
        try:
            group, peer = self.groups.p2p[t.edge]
            if self.groups.nccl:
                fn = dist.isend if send else dist.irecv
                return dist.batch_isend_irecv(
                    [dist.P2POp(fn, x, t.peer_global, group, DATA_TAG) for x in tensors]
                )
            call = group.send if send else group.recv
            return [call([x], peer, DATA_TAG) for x in tensors]
        except (RuntimeError, KeyError) as e:  # KeyError: the groups were dropped
            raise _posting_failed(t, e) from None

    def post_send(self, t: SendTransfer) -> None:
        if self.handshake:
            self._handshake_send(t)
            return
        if self.prepared_sends:
            sent = t.recorded
            if sent is None:
                raise RuntimeError(f"post {t.name}: its tensors were never prepared")
        else:
            self.prepare_send(t)
            sent, t.recorded = t.recorded, None  # kept by in_flight until the wait
        self.in_flight.append((self._issue(t, sent, True), sent, t.peer_rank))

    def prepare_send(self, t: SendTransfer) -> None:
        """Take the messages of ``t`` from the runner (checked against the channels'
        metadata) into ``t.recorded``: the tensors to send, one flat packet where they pack
        (into the plan's buffer when one is bound). Device work only: with
        ``capture="action"`` it runs inside a graph."""
        runner, metas = self.runner, self.metas
        tensors: list[torch.Tensor] = []
        for m in t.msgs:
            msg = runner.take_activation(m.li, m.mb) if m.forward else runner.take_grad(m.li, m.mb)
            what = "activation" if m.forward else "gradient"
            check_message(what, m.channel, msg, metas[m.channel])
            tensors += msg
        if len(tensors) > 1 and t.packable():
            flat = t.static
            parts = [x.reshape(-1) for x in tensors]
            flat = torch.cat(parts) if flat is None else torch.cat(parts, out=flat)
            tensors = [flat]
        t.recorded = tuple(tensors)

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
            t.works = self._issue(t, [flat], False)
            return
        tensors: list[torch.Tensor] = []
        static = t.static
        for i, (m, ms) in enumerate(zip(t.msgs, metas, strict=True)):
            bufs = static[i] if static is not None else tuple(x.empty() for x in ms)
            (runner.store_activation if m.forward else runner.store_grad)(m.li, m.mb, bufs)
            tensors += bufs
        t.works = self._issue(t, tensors, False)

    def wait_recv(self, t: RecvTransfer) -> None:
        ranges = self.ranges
        ranges.push(t.wait_name)
        try:
            if not t.resolved:
                self._resolve(t)
            _wait_all(t.works, t.peer_rank, t.wait_name)
            if t.host_bufs:
                for m, bufs in t.host_bufs:
                    moved = tuple(b.to(self.device) for b in bufs)
                    store = self.runner.store_activation if m.forward else self.runner.store_grad
                    store(m.li, m.mb, moved)
                t.host_bufs = []
        finally:
            ranges.pop()

    # --------------------------------------------------------- handshake
    def _handshake_route(self, t: _Transfer) -> tuple[Any, int]:
        """Where a handshake message goes: the pair's group, or (NCCL) the control group."""
        if self.staged:
            route = self.groups.control, t.peer_rank
        else:
            route = self.groups.p2p.get(t.edge, (None, t.peer_rank))
        if route[0] is None:
            raise _posting_failed(t, RuntimeError("the pipeline's process groups were dropped"))
        return route

    def _handshake_send(self, t: SendTransfer) -> None:
        """A send of a handshake step: each message preceded by a header with its metadata.

        Headers go on their own tag; the receiver waits for them only when a compute reads
        the transfer (``_resolve``), then posts the payload receives, in send order per rank
        pair. On NCCL everything goes over the gloo control group through host memory: an
        NCCL group needs its sends and receives at once, which needs the metadata first.
        """
        runner = self.runner
        group, peer = self._handshake_route(t)
        works, keep = [], []
        for m in t.msgs:
            msg = runner.take_activation(m.li, m.mb) if m.forward else runner.take_grad(m.li, m.mb)
            self.metas[m.channel] = tuple(TensorMeta.of(x) for x in msg)
            if self.staged:
                msg = tuple(x.cpu() for x in msg)
            header = encode_header(msg, torch.empty(HEADER_LEN, dtype=torch.int64))
            try:
                works.append(group.send([header], peer, HEADER_TAG))
                works += [group.send([x], peer, DATA_TAG) for x in msg]
            except RuntimeError as e:
                works.clear()
                raise _posting_failed(t, e) from None
            keep += [header, *msg]
        self.in_flight.append((works, tuple(keep), t.peer_rank))

    def _handshake_recv(self, t: RecvTransfer) -> None:
        group, peer = self._handshake_route(t)
        t.headers = []
        for m in t.msgs:
            h = torch.empty(HEADER_LEN, dtype=torch.int64)
            try:
                t.headers.append((m, h, group.recv([h], peer, HEADER_TAG)))
            except RuntimeError as e:
                t.headers.clear()
                raise _posting_failed(t, e) from None
        t.resolved = False
        self._unresolved.setdefault(t.edge, deque()).append(t)

    def _resolve(self, t: RecvTransfer) -> None:
        """Read the headers of ``t`` and of every transfer posted before it on its rank pair,
        and post their payload receives, in order."""
        queue = self._unresolved[t.edge]
        cpu = torch.device("cpu")
        while queue:
            u = queue.popleft()
            group, peer = self._handshake_route(u)
            works = []
            for m, h, hw in u.headers:
                _wait_all([hw], u.peer_rank, u.wait_name + " (its header)")
                metas = self.metas[m.channel] = decode_header(h, self.device)
                bufs = tuple(x.on(cpu if self.staged else self.device).empty() for x in metas)
                if self.staged:
                    u.host_bufs.append((m, bufs))
                else:
                    store = self.runner.store_activation if m.forward else self.runner.store_grad
                    store(m.li, m.mb, bufs)
                try:
                    works += [group.recv([b], peer, DATA_TAG) for b in bufs]
                except RuntimeError as e:
                    works.clear()
                    raise _posting_failed(u, e) from None
            u.works, u.headers, u.resolved = works, [], True
            if u is t:
                return

    def warm(self) -> None:
        """One exchange on every rank pair, all at once: after a handshake over the control
        group (NCCL), initializes each communicator's P2P paths before any capture, through
        the path the step's transfers take (``batch_isend_irecv``). Every rank walks the
        pairs in the same order."""
        works = []
        groups = self.groups
        for (src, dst), (group, peer) in sorted(groups.p2p.items()):
            x = torch.zeros(1, device=self.device)
            send = self.rank == src
            if groups.nccl:
                fn = dist.isend if send else dist.irecv
                peer_global = groups.global_ranks[dst if send else src]
                works += dist.batch_isend_irecv([dist.P2POp(fn, x, peer_global, group, DATA_TAG)])
            else:
                works.append((group.send if send else group.recv)([x], peer, DATA_TAG))
        _wait_all(works, None, "warm-up of the P2P groups")
