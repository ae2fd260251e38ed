"""The step loop: runs a compiled program, the same for the eager step and the captured one.

``StepLoop.run(program, handshake)`` is the only place the instructions of a step are
executed: per instruction its posts, its waits and its compute, each compute in a range named
after its action; then the sends in flight are waited for. Around it:

* ``train(...)``: the eager training step (split the batch, seed the backward, run, reduce
  the loss); the capture driver's warmup is this step too;
* ``static()``: the training step on the active plan's buffers, with no argument: what the
  capture records into the device's graphs (CUDA graphs, or CPU graphs);
* ``infer(...)``: a forward-only run of the inference program.

It keeps the batch signatures the programs last ran with (a new one means a handshake step:
the first step of a signature exchanges headers). On failure it records what this rank was
doing for ``Faults``.

Owns: the signatures. May touch: the stage runner's batch and mode (``begin``), the engine
(through its public calls), the loss buffers, the optimizer (``capture_optimizer``: zeroed
gradients and its step inside the static step).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .batch import BatchSignature
from .context import RankContext
from .program import Program
from .structured import PerMicrobatch
from .tensors import split_microbatches

if TYPE_CHECKING:
    from graphpipe.nvtx import Ranges

    from ..coordination.faults import Faults
    from .comm import CommEngine
    from .loss import LossReducer
    from .stage import StageRunner

__all__ = ["StepLoop"]


class StepLoop:
    """Runs one rank's programs (see the module doc).

    ctx: the rank. runner / engine / loss / faults / ranges: the parts a step drives.
    nccl: P2P goes over NCCL (the step ends with an agreement on the control group, and the
        first step of a signature warms the rank pairs up). optimizer: ``capture_optimizer``.
    """

    def __init__(
        self,
        ctx: RankContext,
        runner: StageRunner,
        engine: CommEngine,
        loss: LossReducer,
        faults: Faults,
        ranges: Ranges,
        nccl: bool,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.ctx, self.runner, self.engine = ctx, runner, engine
        self.loss, self.faults, self.ranges = loss, faults, ranges
        self.nccl = nccl
        self.optimizer = optimizer
        self.signature: BatchSignature | None = None  # of the training program's last step
        self.infer_signature: BatchSignature | None = None
        self.infer_metas: dict = {}  # the inference program's channel metadata

    def forget(self) -> None:
        """After a failed call: the next step of either program is a handshake step."""
        self.signature = self.infer_signature = None

    def set_signature(self, sig: BatchSignature | None) -> None:
        """The training program last ran with ``sig`` (a captured plan's, made active)."""
        self.signature = sig

    def set_ranges(self, ranges: Ranges) -> None:
        """Emit the step's ranges through ``ranges`` from now on."""
        self.ranges = ranges

    # ---------------------------------------------------------------- training
    def zero_grads(self) -> None:
        """With ``capture_optimizer``: the gradients are zeroed in place at a step's start."""
        if self.optimizer is not None:
            for p in self.ctx.parameters():
                if p.grad is not None:
                    p.grad.zero_()

    def batch(
        self,
        sig: BatchSignature,
        inputs: Any,
        labels: Any,
        kwargs: Mapping[str, Any],
        unwrap: bool | None = None,
        infer: bool = False,
    ) -> None:
        """Hand the runner this rank's micro-batches of ``inputs`` and ``labels`` (none where
        it holds none) and of the keyword tensors it uses (``sig``'s names); ``unwrap``: each
        micro-batch's labels as one tensor, not a 1-tuple (default: when ``labels`` is a
        tensor, as ``loss_fn`` then gets them); ``infer``: for a forward-only run."""
        ctx, runner = self.ctx, self.runner
        m, dev = ctx.num_microbatches, ctx.device
        mb_in = split_microbatches(inputs, m, dev) if ctx.is_input_rank else []
        if unwrap is None:
            unwrap = isinstance(labels, torch.Tensor)
        mb_lab = (
            split_microbatches(labels, m, dev, unwrap)
            if ctx.is_loss_rank and labels is not None
            else []
        )
        routes = runner.keyword_routes(sig.keyword_names())
        mb_kw: list[dict[str, Any]] = []
        if routes.used:
            mb_kw = [{} for _ in range(m)]
            for name in routes.used:
                value = kwargs[name]
                if isinstance(value, PerMicrobatch):  # one value per micro-batch, as given
                    parts = value.microbatches(m, dev)
                else:
                    parts = split_microbatches(
                        value, m, dev, unwrap=isinstance(value, torch.Tensor)
                    )
                for i, part in enumerate(parts):
                    mb_kw[i][name] = part
        runner.begin(mb_in, mb_lab, mb_kw, routes, infer=infer)

    def train(
        self,
        program: Program,
        sig: BatchSignature,
        inputs: Any,
        labels: Any,
        kwargs: Mapping[str, Any],
        scaler: Any,
    ) -> torch.Tensor:
        """One eager training step of batch signature ``sig``; the loss buffer (static)."""
        handshake = sig != self.signature
        self.signature = sig
        self.batch(sig, inputs, labels, kwargs)
        self.loss.prepare_seed(scaler)
        self.run(program, handshake)
        loss = self.loss.reduce()
        if self.nccl and self.ctx.num_ranks > 1:  # the loss went on the device: agree here
            self.faults.control("end of step", lambda g: g.allreduce([torch.zeros(1)]))
        if handshake and self.engine.staged:
            self.engine.warm()
        return loss

    def static(self, program: Program) -> None:
        """The training step on the active plan's buffers only (see the module doc)."""
        self.zero_grads()
        self.loss.prepare_seed(None)
        self.run(program, False)
        self.loss.reduce()
        if self.optimizer is not None:
            self.optimizer.step()

    # --------------------------------------------------------------- inference
    def infer(
        self, program: Program, sig: BatchSignature, inputs: Any, kwargs: Mapping[str, Any]
    ) -> Any:
        """A forward-only run; the concatenated outputs on the loss rank, else None."""
        handshake = sig != self.infer_signature
        self.infer_signature = sig
        engine, runner, ctx = self.engine, self.runner, self.ctx
        saved = engine.metas, runner.mb_inputs, runner.mb_labels, runner.mb_kwargs, runner.routes
        self.batch(sig, inputs, None, kwargs, infer=True)
        engine.use_metas(self.infer_metas)
        try:
            self.run(program, handshake)
        finally:
            engine.use_metas(saved[0])
            runner.begin(*saved[1:])
        if not ctx.is_loss_rank:
            return None
        outs = [o if isinstance(o, tuple) else (o,) for o in runner.take_infer_outputs()]
        cat = tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
        return cat[0] if len(cat) == 1 else cat

    # --------------------------------------------------------------- the loop
    def run(self, program: Program, handshake: bool) -> None:
        """Every instruction of ``program``, then the wait for the sends in flight."""
        ranges, engine = self.ranges, self.engine
        depth = ranges.depth
        ranges.push("step")
        engine.begin(handshake)
        name, comm = "", None
        try:
            for posts, waits, fn, args, name in program.instrs:
                for comm in posts:
                    comm()
                for comm in waits:
                    comm()
                comm = None
                if fn is not None:
                    ranges.push(name)
                    fn(*args)
                    ranges.pop()
            name = "wait sends"
            engine.finish()
            self._check_drained()
        except BaseException:
            # What this rank was doing: an action, or posting / waiting for a transfer.
            if comm is not None:
                name = _describe(comm)
            self.faults.doing(name or "the end of the step")
            raise
        finally:
            ranges.unwind(depth)

    def _check_drained(self) -> None:
        left = self.runner.pending_weight_work()
        if left:
            for store in self.runner.stores:
                store.clear()
            raise RuntimeError(
                f"the step ended with deferred weight-gradient work for {left}; the schedule "
                "is missing W actions"
            )


def _describe(call: Any) -> str:
    """What a post or wait of the program is: ``post 0SEND_F3``, ``start dp grads``."""
    fn = call.func if isinstance(call, functools.partial) else call
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", type(fn).__name__)
    return f"{name} {owner.name}" if isinstance(getattr(owner, "name", None), str) else name
