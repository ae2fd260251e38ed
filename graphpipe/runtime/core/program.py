"""The compiled per-rank program: the lowered schedule bound to handlers and transfers.

``compile_program`` turns this rank's lowered ``Step``s into a flat list of instructions
(``Instr``: posts, waits, handler, args, range name):

* posts: the transfers this step's batch posts (sends first, then receives, each rank pair's
  transfers in their order on it), as bound ``post`` methods;
* waits: the receive transfers the compute reads that no earlier compute has waited for
  (the first reader of a transfer waits for all of it), as bound ``wait`` methods;
* the handler of the compute (``None`` for the final flush of sends) and its arguments.

Everything is resolved once, so that running a step is a loop over tuples: the per-action
host work is a handful of calls.

The parts that run inside a step (gradient accumulation, FSDP2, data parallelism, tied
weights, clipping) declare what they run and where as ``StepHooks``; the pipeline installs
them all at one place, in one stated order (``Program.install``), so no part patches the
program and the order of their instructions is read off that one call. May touch: nothing at
run time; it only builds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from graphpipe.schedule.ir import Action, Op, Placement
from graphpipe.schedule.lower import Step, Transfer, comms_needed

from .comm import CommEngine, RecvTransfer, SendTransfer
from .stage import StageRunner

__all__ = ["Instr", "Program", "StepHooks", "Trailing", "compile_program"]


class Instr(NamedTuple):
    """One instruction of a compiled program: run ``posts``, then ``waits``, then
    ``handler(*args)`` (when not None) in a range called ``name``."""

    posts: tuple[Callable[[], None], ...]
    waits: tuple[Callable[[], None], ...]
    handler: Callable[..., None] | None
    args: tuple
    name: str


class Trailing(NamedTuple):
    """An instruction added after the lowered steps: ``waits``, then ``handler()`` (when not
    None) in a range called ``name``."""

    waits: tuple[Callable[[], None], ...] = ()
    handler: Callable[[], None] | None = None
    name: str = ""


@dataclass(frozen=True)
class StepHooks:
    """What one part runs inside every run of a program, and where (``Program.install``).

    first: at the start of the step, before the first instruction's posts.
    after_grads: ``(stage, fn)``: ``fn()`` right after the stage's last ``B``, ``I`` or ``W``
        of the step (``Program.last_grad_steps``; the last lowered step for a stage without),
        as the first posts of the next instruction: the stage's gradients are final there.
    after_weights: ``(stage, fn)``: ``fn()`` right after each of the stage's ``W`` actions
        (before any ``after_grads`` hook at the same point).
    trailing: instructions after the lowered steps (and after every ``after_grads`` hook
        that falls past the last step).
    """

    first: tuple[Callable[[], None], ...] = ()
    after_grads: tuple[tuple[int, Callable[[], None]], ...] = ()
    after_weights: tuple[tuple[int, Callable[[], None]], ...] = ()
    trailing: tuple[Trailing, ...] = ()


@dataclass
class Program:
    """One rank's compiled program.

    instrs: per lowered step, ``(posts, waits, handler or None, args, name)``.
    steps: the lowered steps it was compiled from.
    sends / recvs: this rank's transfers, in program order.
    posted_at: the step index each transfer is posted at.
    """

    instrs: list[Instr]
    steps: list[Step]
    sends: list[SendTransfer] = field(default_factory=list)
    recvs: list[RecvTransfer] = field(default_factory=list)
    posted_at: dict[int, int] = field(default_factory=dict)  # id(transfer) -> step

    # -- the parts that run inside the step -------------------------------------------------
    # Instructions past ``len(steps)`` are trailing ones added here (no lowered step).

    def install(self, *hooks: StepHooks) -> None:
        """Install the parts' hooks; where two run at one point, they run in the order given
        here: the ``first`` hooks, then at each stage's last gradient the ``after_grads``
        hooks, then the ``trailing`` instructions."""
        firsts = [fn for h in hooks for fn in h.first]
        if firsts:
            self.instrs[0] = _prefixed(self.instrs[0], *firsts)
        final = self.grads_final(sorted({s for h in hooks for s, _ in h.after_grads}))
        after: dict[int, list[Callable[[], None]]] = {}
        weights = self.weight_steps()
        for h in hooks:
            for stage, fn in h.after_weights:
                for k in weights.get(stage, ()):
                    after.setdefault(k, []).append(fn)
        for h in hooks:
            for stage, fn in h.after_grads:
                after.setdefault(final[stage], []).append(fn)
        for k in sorted(after):
            self.call_after(k, *after[k])
        for h in hooks:
            for t in h.trailing:
                self.append(t.waits, t.handler, (), t.name)

    def grads_final(self, stages: Sequence[int]) -> dict[int, int]:
        """``{stage: instruction index}`` after which each of ``stages``' gradients are final:
        its last ``B``, ``I`` or ``W``, or the last lowered step for a stage without."""
        last, end = self.last_grad_steps(), len(self.steps) - 1
        return {s: last.get(s, end) for s in stages}

    def weight_steps(self) -> dict[int, list[int]]:
        """``{stage: [instruction index, ...]}`` of each stage's ``W`` actions."""
        out: dict[int, list[int]] = {}
        for k, step in enumerate(self.steps):
            for part in step.compute.parts() if step.compute is not None else ():
                if part.op is Op.W:
                    out.setdefault(part.stage, []).append(k)
        return out

    def last_grad_steps(self) -> dict[int, int]:
        """``{stage: instruction index}`` of each stage's last ``B``, ``I`` or ``W``: after it
        the stage's gradients of the step are final."""
        last: dict[int, int] = {}
        for k, step in enumerate(self.steps):
            for part in step.compute.parts() if step.compute is not None else ():
                if part.op in (Op.B, Op.I, Op.W):
                    last[part.stage] = k
        return last

    def call_after(self, k: int, *fns: Callable[[], None]) -> None:
        """Run ``fns`` right after instruction ``k``'s compute, in order, as the first posts
        of the next instruction (a trailing one when ``k`` is the last)."""
        if k + 1 == len(self.instrs):
            self.append()
        self.instrs[k + 1] = _prefixed(self.instrs[k + 1], *fns)

    def append(
        self,
        waits: tuple[Callable[[], None], ...] = (),
        handler: Callable[..., None] | None = None,
        args: tuple = (),
        name: str = "",
    ) -> None:
        """Add a trailing instruction: ``waits``, then ``handler(*args)`` in range ``name``."""
        self.instrs.append(Instr((), tuple(waits), handler, args, name))


def _prefixed(instr: Instr, *fns: Callable[[], None]) -> Instr:
    """``instr`` with ``fns`` as its first posts."""
    return Instr((*fns, *instr.posts), instr.waits, instr.handler, instr.args, instr.name)


def _handler(runner: StageRunner, action: Action | None) -> tuple[object, tuple, str]:
    if action is None:
        return None, (), ""
    local = runner.local
    if action.op is Op.OVERLAP_F_B:
        f, b = action.sub
        args = (local[f.stage], f.microbatch, local[b.stage], b.microbatch, b.op is Op.B)
        return runner.overlap, args, str(action)
    handlers = {
        Op.F: runner.forward,
        Op.B: runner.backward_full,
        Op.I: runner.backward_input,
        Op.W: runner.weight,
    }
    return handlers[action.op], (local[action.stage], action.microbatch), str(action)


def compile_program(
    steps: Sequence[Step],
    transfers: Sequence[Transfer],
    placement: Placement,
    rank: int,
    runner: StageRunner,
    engine: CommEngine,
) -> Program:
    """Bind this rank's lowered ``steps`` (with the ``transfers`` of the whole pipeline, from
    ``graphpipe.schedule.lower.transfers``) to ``runner``'s handlers and ``engine``'s transfers."""
    program = Program([], list(steps))
    posts: list[list[SendTransfer | RecvTransfer]] = [[] for _ in steps]
    by_recv: dict[Action, RecvTransfer] = {}
    for spec in transfers:  # in order on each rank pair
        if spec.src == rank:
            t: SendTransfer | RecvTransfer = SendTransfer(engine, spec)
            program.sends.append(t)
            step = spec.send_step
        elif spec.dst == rank:
            t = RecvTransfer(engine, spec)
            program.recvs.append(t)
            for c in spec.recvs:
                by_recv[c] = t
            step = spec.recv_step
        else:
            continue
        posts[step].append(t)
        program.posted_at[id(t)] = step
    waited: set[int] = set()
    for k, step in enumerate(steps):
        order = {c: i for i, c in enumerate(step.comms)}
        batch = sorted(
            posts[k],
            key=lambda t: (isinstance(t, RecvTransfer), order[t.msgs[0].action]),
        )
        waits = []
        if step.compute is not None:
            for c in comms_needed(step.compute, placement):
                t = by_recv[c]
                if id(t) not in waited:
                    waited.add(id(t))
                    waits.append(t.wait)
        fn, args, name = _handler(runner, step.compute)
        program.instrs.append(Instr(tuple(t.post for t in batch), tuple(waits), fn, args, name))
    return program
