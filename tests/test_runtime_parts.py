"""The runtime's parts on their own, in one process and without torch.distributed: the batch
agreement (``batch.py``), the compiled program (``program.py``), the step loop (``step.py``),
the loss (``loss.py``), tied weights and clipping on one rank (``tied.py``, ``clipping.py``).
Collaborators are small fakes that record what they are asked; the values asserted are the
known ones. The same parts on several ranks are tested through the facade
(tests/test_runtime_dist.py, tests/test_differential.py)."""

from __future__ import annotations

import functools
import math
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from graphpipe import models
from graphpipe.errors import PipelineError
from graphpipe.meta import DTYPE_CODE
from graphpipe.roles import mark_tied, unique_parameters
from graphpipe.runtime.core.batch import (
    BatchAgreement,
    BatchSignature,
    describe_keywords,
    keywords_signature,
)
from graphpipe.runtime.core.context import RankContext
from graphpipe.runtime.core.loss import LossReducer
from graphpipe.runtime.core.program import Instr, Program, StepHooks, Trailing, compile_program
from graphpipe.runtime.core.stage import StageRunner
from graphpipe.runtime.core.step import StepLoop
from graphpipe.runtime.parts.accumulation import GradSync
from graphpipe.runtime.parts.clipping import GradClipper, check_clip_args
from graphpipe.runtime.parts.tied import TiedWeights
from graphpipe.schedule.generators import dualpipev, one_f_one_b
from graphpipe.schedule.ir import Action, Placement
from graphpipe.schedule.lower import Step, lower, transfers

F32, F64, I64 = DTYPE_CODE[torch.float32], DTYPE_CODE[torch.float64], DTYPE_CODE[torch.int64]


def _ctx(modules=(), num_ranks=1, rank=0, m=2, loss_rank=0) -> RankContext:
    return RankContext(
        group=None,
        rank=rank,
        num_ranks=num_ranks,
        global_ranks=tuple(range(num_ranks)),
        device=torch.device("cpu"),
        modules=tuple(modules),
        stage_ids=tuple(range(len(modules))) or (0,),
        num_microbatches=m,
        input_rank=0,
        loss_rank=loss_rank,
    )


def _holder(**params: torch.Tensor) -> nn.Module:
    mod = nn.Module()
    for name, t in params.items():
        mod.register_parameter(name, t if isinstance(t, nn.Parameter) else nn.Parameter(t))
    return mod


# --------------------------------------------------------------------------------------------
# batch.py


def _agreement(m=2, rank=0, num_ranks=1, groups=None, input_dtype=None) -> BatchAgreement:
    return BatchAgreement(groups, rank, num_ranks, 0, 0, m, input_dtype)


def test_the_signature_of_a_training_and_a_forward_call():
    ag = _agreement()
    x, y = torch.zeros(8, 3), torch.zeros(8, dtype=torch.float64)
    sig, loss_dtype = ag.agree(x, y, {}, True, torch.float64, call=1)
    assert sig == BatchSignature(True, ((F32, 8, 3),), ((F64, 8),), ())
    assert loss_dtype is torch.float64
    sig, _ = ag.agree((x, x[:, :1]), None, {}, False, torch.float32, call=2)
    assert sig == BatchSignature(False, ((F32, 8, 3), (F32, 8, 1)), (), ())
    assert sig.described() == [("inputs[0]", [8, 3], "float32"), ("inputs[1]", [8, 1], "float32")]


def test_a_signature_from_the_agreements_words_and_what_differs_from_a_captured_one():
    # words per part: count, then (dtype code, ndim, *shape) per tensor
    sig = BatchSignature.from_words(True, [1, F32, 2, 8, 3], [1, F64, 1, 8], (("m", ((I64, 8),)),))
    assert sig == BatchSignature(True, ((F32, 8, 3),), ((F64, 8),), (("m", ((I64, 8),)),))
    assert sig.keyword_names() == ("m",)
    assert BatchSignature.from_words(False, [], [], ()) == BatchSignature(False, (), (), ())
    other = sig._replace(labels=((F64, 4),))
    assert sig.mismatch(other) == (
        "labels[0] has shape [4] float64, but the step was captured with labels[0] of shape "
        "[8] float64; pass recapture=True to capture a graph per shape"
    )
    fewer = sig._replace(keywords=())
    assert "the batch holds ['inputs[0]', 'labels[0]'], but the step was captured with" in (
        sig.mismatch(fewer)
    )


@pytest.mark.parametrize(
    ("inputs", "labels", "match"),
    [
        (torch.zeros(7, 3), torch.zeros(7), r"inputs\[0\] of shape \[7, 3\] does not split"),
        (torch.zeros(()), torch.zeros(8), r"inputs\[0\] is 0-dim"),
        (torch.zeros(0, 3), torch.zeros(8), r"inputs\[0\] of shape \[0, 3\] holds no rows"),
        (None, torch.zeros(8), "inputs must not be None on this rank"),
        (torch.zeros(8, 3), None, "labels must not be None on this rank"),
        (torch.zeros(8, dtype=torch.uint16), torch.zeros(8), "unsupported dtype torch.uint16"),
        ([torch.zeros(8), 3], torch.zeros(8), r"must be a tensor or a tuple of tensors"),
        (torch.zeros(8, 3), torch.zeros(6), "labels.0. has 6 rows but the inputs have 8"),
    ],
)
def test_a_rejected_batch_raises_naming_the_tensor(inputs, labels, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _agreement().agree(inputs, labels, {}, True, torch.float32, call=1)


def test_inputs_of_another_floating_dtype_than_stage_0_are_refused_outside_autocast():
    ag = _agreement(input_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"inputs\[0\] has dtype torch.float32, but stage 0"):
        ag.agree(torch.zeros(4, 2), torch.zeros(4), {}, True, torch.float32, call=1)
    ag.agree(torch.zeros(4, dtype=torch.int64), torch.zeros(4), {}, True, torch.float32, call=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sig, _ = ag.agree(torch.zeros(4, 2), torch.zeros(4), {}, True, torch.float32, call=3)
    assert sig.train and sig.inputs == ((F32, 4, 2),)


def test_check_labels_gets_the_labels_and_the_keyword_names():
    seen = []

    def check(labels, names):
        seen.append((labels.shape[0], names))
        raise ValueError("no valid token")

    kw = {"mask": torch.ones(4), "bias": torch.ones(4)}
    with pytest.raises(ValueError, match="no valid token"):
        _agreement().agree(
            torch.zeros(4), torch.zeros(4), kw, True, torch.float32, 1, check_labels=check
        )
    assert seen == [(4, ("bias", "mask"))]


def test_keyword_rows_and_takers():
    ag = _agreement()
    x, y = torch.zeros(8, 3), torch.zeros(8)
    kw = {"mask": torch.ones(8, 5, dtype=torch.int64), "pos": torch.arange(8)}
    sig, _ = ag.agree(x, y, kw, True, torch.float32, 1, accepts=lambda names: 0b11)
    assert sig.keywords == (("mask", ((I64, 8, 5),)), ("pos", ((I64, 8),)))
    with pytest.raises(ValueError, match="keyword tensor 'pos' is taken by no stage's forward"):
        ag.agree(x, y, kw, True, torch.float32, 2, accepts=lambda names: 0b01)
    with pytest.raises(ValueError, match="keyword tensor 'mask' has 4 rows but the inputs have 8"):
        ag.agree(x, y, {"mask": torch.ones(4)}, True, torch.float32, 3, accepts=lambda n: 1)
    with pytest.raises(ValueError, match=r"keyword tensor 'mask'\[1\] has 6 rows"):
        ag.agree(x, y, {"mask": (torch.ones(8), torch.ones(6))}, True, torch.float32, 4)
    many = {f"k{i:02d}": torch.ones(8) for i in range(63)}
    with pytest.raises(ValueError, match="63 keyword tensors: at most 62 per call"):
        ag.agree(x, y, many, True, torch.float32, 5)


def test_keywords_signature_and_its_description():
    kw = {"b": torch.zeros(8, 2), "a": (torch.zeros(8, dtype=torch.int64), torch.zeros(8, 3))}
    sig = keywords_signature(kw, 4)
    assert sig == (("a", ((I64, 8), (F32, 8, 3))), ("b", ((F32, 8, 2),)))
    assert describe_keywords(sig) == "{'a': [8] int64, [8, 3] float32, 'b': [8, 2] float32}"
    assert describe_keywords(()) == "{}"
    with pytest.raises(TypeError, match="keyword tensor 'a' must be a tensor or a tuple"):
        keywords_signature({"a": 3}, 2)
    with pytest.raises(ValueError, match=r"keyword tensor 'b'\[1\] of shape \[3\] does not"):
        keywords_signature({"b": (torch.zeros(4), torch.zeros(3))}, 2)


class _Captured(Exception):
    """Raised by a control group that only records what a rank would send."""


class _Control:
    """A control group of two ranks: ``allreduce`` records this rank's words and adds the
    peer's (``peer``), or, without a peer, records them and stops the call."""

    def __init__(self, peer: torch.Tensor | None = None) -> None:
        self.peer, self.sent = peer, None

    def allreduce(self, bufs):
        self.sent = bufs[0].clone()
        if self.peer is None:
            raise _Captured
        bufs[0] += self.peer
        return SimpleNamespace(wait=lambda: None)


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def set(self, key, value):
        self.data[key] = value

    def peek(self, key):
        return self.data.get(key)

    def wait(self, keys, timeout):
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        return [self.data[k] for k in keys]


def _groups(store, peer=None):
    return SimpleNamespace(
        control=_Control(peer), store=store, key="pipe", timeout=timedelta(seconds=1)
    )


def _two_ranks(
    peer_kwargs, peer_call=1, peer_sync=True, kwargs=None, sync=True, call=1, described=False
):
    """Rank 0's agreement on a two-rank pipeline whose rank 1 (no inputs, no labels) called
    with ``peer_kwargs``, ``peer_call``, ``peer_sync``; ``described``: rank 1 wrote the
    description of its keyword tensors, as it does when the digests differ."""
    store = _Store()
    peer = _agreement(rank=1, num_ranks=2, groups=_groups(store))
    with pytest.raises(_Captured):
        peer.agree(None, None, peer_kwargs, True, torch.float32, peer_call, sync=peer_sync)
    words = peer.groups.control.sent
    if described:
        store.set(f"pipe/kwargs/{peer_call}/1", repr(keywords_signature(peer_kwargs, 2)))
    ag = _agreement(rank=0, num_ranks=2, groups=_groups(store, words))
    x, y = torch.zeros(8, 3), torch.zeros(8)
    return ag.agree(x, y, kwargs or {}, True, torch.float32, call, sync=sync)


def test_two_ranks_that_agree_get_rank_0s_signature():
    sig, loss_dtype = _two_ranks({})
    assert (
        sig == BatchSignature(True, ((F32, 8, 3),), ((F32, 8),), ()) and loss_dtype is torch.float32
    )


def test_a_peer_in_another_call_is_named():
    with pytest.raises(
        PipelineError, match=r"not in the same call \(rank 0: step\(\) #1, rank 1: step\(\) #2\)"
    ):
        _two_ranks({}, peer_call=2)


def test_a_peer_that_rejected_the_batch_is_named_with_its_reason():
    bad = {"mask": torch.ones(7)}
    with pytest.raises(
        PipelineError,
        match=r"rank 1 rejected this batch \(ValueError: keyword tensor 'mask' of shape \[7\] "
        r"does not split.*\); no rank ran the step",
    ):
        _two_ranks(bad, kwargs={"mask": torch.ones(8)})


def test_the_no_sync_flag_must_agree():
    with pytest.raises(
        ValueError, match=r"rank\(s\) \[1\] called step\(\) inside no_sync\(\) and rank\(s\) \[0\]"
    ):
        _two_ranks({}, peer_sync=False)
    sig, _ = _two_ranks({}, peer_sync=False, sync=False)  # both inside: fine
    assert sig.train


def test_keyword_tensors_that_differ_across_ranks_are_named():
    theirs = {"mask": torch.ones(8, dtype=torch.int64)}
    with pytest.raises(
        ValueError,
        match=r"rank 1 has \{'mask': \[8\] int64\}, rank 0 has \{'mask': \[8\] float32\}",
    ):
        _two_ranks(theirs, kwargs={"mask": torch.ones(8)}, described=True)
    with pytest.raises(
        ValueError,
        match=r"^the pipeline ranks passed different keyword tensors \(rank 0: \{'mask': \[8\] "
        r"float32\}\)$",
    ):  # rank 1's description never came: rank 0 names its own
        _two_ranks(theirs, kwargs={"mask": torch.ones(8)})


# --------------------------------------------------------------------------------------------
# program.py


class _Runner:
    """The handlers ``compile_program`` binds, by local stage."""

    def __init__(self, stages) -> None:
        self.local = {s: li for li, s in enumerate(stages)}

    def forward(self, li, mb): ...
    def backward_full(self, li, mb): ...
    def backward_input(self, li, mb): ...
    def weight(self, li, mb): ...
    def overlap(self, fli, fmb, bli, bmb, full): ...


class _Engine:
    """Records which transfer each post and wait is for."""

    def __init__(self, runner, rank, num_ranks=2) -> None:
        self.runner, self.rank = runner, rank
        self.groups = SimpleNamespace(global_ranks=tuple(range(num_ranks)))
        self.transfers: list = []
        self.log: list[tuple[str, str]] = []

    def post_send(self, t):
        self.log.append(("post send", t.name))

    def post_recv(self, t):
        self.log.append(("post recv", t.name))

    def wait_recv(self, t):
        self.log.append(("wait", t.name))


def _compile(schedule, rank, receives):
    placement = Placement.from_schedule(schedule)
    lowered = lower(schedule, placement, receives=receives)
    runner = _Runner(placement.stages_of(rank))
    engine = _Engine(runner, rank)
    program = compile_program(
        lowered[rank], transfers(lowered, placement), placement, rank, runner, engine
    )
    return program, runner, engine


def _calls(engine, fns):
    engine.log.clear()
    for fn in fns:
        fn()
    return list(engine.log)


def test_compile_program_binds_handlers_posts_and_waits():
    # 1F1B, 2 ranks, 2 micro-batches, every receive posted at the start; rank 1:
    # [1RECV_F0 1RECV_F1] 1F0, 1B0, [1SEND_B0] 1F1, 1B1, [1SEND_B1] flush
    program, runner, engine = _compile(one_f_one_b(2, 2), 1, "start")
    assert [i.name for i in program.instrs] == ["1F0", "1B0", "1F1", "1B1", ""]
    assert [i.handler for i in program.instrs] == [
        runner.forward,
        runner.backward_full,
        runner.forward,
        runner.backward_full,
        None,
    ]
    assert [i.args for i in program.instrs] == [(0, 0), (0, 0), (0, 1), (0, 1), ()]
    posts = [_calls(engine, i.posts) for i in program.instrs]
    assert posts == [
        [("post recv", "1RECV_F0"), ("post recv", "1RECV_F1")],
        [],
        [("post send", "1SEND_B0")],
        [],
        [("post send", "1SEND_B1")],
    ]
    waits = [_calls(engine, i.waits) for i in program.instrs]
    assert waits == [[("wait", "1RECV_F0")], [], [("wait", "1RECV_F1")], [], []]
    assert [t.name for t in program.sends] == ["1SEND_B0", "1SEND_B1"]
    assert [t.name for t in program.recvs] == ["1RECV_F0", "1RECV_F1"]
    at = {t.name: program.posted_at[id(t)] for t in program.sends + program.recvs}
    assert at == {"1SEND_B0": 2, "1SEND_B1": 4, "1RECV_F0": 0, "1RECV_F1": 0}
    assert program.steps[2].compute == Action.parse("1F1")
    assert program.last_grad_steps() == {1: 3}


def test_compile_program_on_a_v_schedule_posts_sends_first_and_binds_overlap():
    # DualPipeV, 2 ranks, 4 micro-batches, rank 0 (stages 0 and 3), step 8:
    # [0SEND_F3 3SEND_B1 3RECV_F2 0RECV_B0] (3F2;0B0)OVERLAP_F_B
    program, runner, engine = _compile(dualpipev(2, 4), 0, "timed")
    instr = program.instrs[8]
    assert instr.name == "(3F2;0B0)OVERLAP_F_B"
    assert instr.handler == runner.overlap
    assert instr.args == (1, 2, 0, 0, True)  # F: local stage 1 (stage 3), mb 2; B: 0, mb 0
    assert _calls(engine, instr.posts) == [
        ("post send", "0SEND_F3 3SEND_B1"),
        ("post recv", "3RECV_F2 0RECV_B0"),
    ]
    # a transfer is waited for once, by its first reader
    waited = [name for i in program.instrs for _, name in _calls(engine, i.waits)]
    assert len(waited) == len(set(waited)) == len(program.recvs)
    assert program.last_grad_steps() == {3: 11, 0: 15}  # 3B3, 0W3


def test_last_grad_steps_of_hand_written_steps():
    steps = [
        Step((), Action.parse(a))
        for a in ("0F0", "3F0", "3I0", "0F1", "0B0", "3W0", "3F1", "3B1", "0B1")
    ]
    steps.insert(7, Step((), Action.overlap(Action.parse("0F2"), Action.parse("3B2"))))
    steps.append(Step((), None))
    program = Program([], steps)
    assert program.last_grad_steps() == {3: 8, 0: 9}


def _noop():
    pass


def test_call_after_a_first_hook_and_append():
    a, b = (lambda: None), (lambda: None)
    program = Program([Instr((a,), (), _noop, (1,), "x"), Instr((), (b,), None, (), "")], [])
    first, after0, after1 = (lambda: None), (lambda: None), (lambda: None)
    program.install(StepHooks(first=(first,)))
    program.call_after(0, after0)
    program.call_after(1, after1)  # past the last: a trailing instruction
    assert program.instrs[0] == Instr((first, a), (), _noop, (1,), "x")
    assert program.instrs[1] == Instr((after0,), (b,), None, (), "")
    assert program.instrs[2] == Instr((after1,), (), None, (), "")
    w, h = (lambda: None), (lambda n: None)
    program.append(waits=[w], handler=h, args=(3,), name="tail")
    assert program.instrs[3] == Instr((), (w,), h, (3,), "tail")
    assert len(program.instrs) == 4


def test_install_runs_the_parts_hooks_in_the_order_given_at_each_point():
    made: dict = {}

    def hook(name):  # one callable per name
        return made.setdefault(name, functools.partial(print, name))

    steps = [Step((), Action.parse(a)) for a in ("0F0", "1F0", "1B0", "0B0")]
    program = Program([Instr((), (), _noop, (), str(st.compute)) for st in steps], steps)
    assert program.grads_final([0, 1, 5]) == {0: 3, 1: 2, 5: 3}  # 5: none, the last step
    a, b = (
        StepHooks(
            first=(hook("a first"),),
            after_grads=((1, hook("a 1")), (0, hook("a 0"))),
            trailing=(Trailing(handler=hook("a end"), name="a"),),
        ),
        StepHooks(
            first=(hook("b first"),),
            after_grads=((1, hook("b 1")),),
            trailing=(Trailing(waits=(hook("b wait"),)),),
        ),
    )
    program.install(a, b)
    assert program.instrs[0].posts == (hook("a first"), hook("b first"))
    assert program.instrs[3].posts == (hook("a 1"), hook("b 1"))  # right after 1B0
    # after 0B0, the last step: a trailing instruction, before the declared trailing ones
    assert program.instrs[4] == Instr((hook("a 0"),), (), None, (), "")
    assert program.instrs[5] == Instr((), (), hook("a end"), (), "a")
    assert program.instrs[6] == Instr((), (hook("b wait"),), None, (), "")
    assert len(program.instrs) == 7


def test_after_weights_hooks_run_after_each_w_before_the_after_grads_hooks():
    steps = [Step((), Action.parse(a)) for a in ("0F0", "0I0", "0F1", "0W0", "0B1", "0F2", "0I2")]
    steps.append(Step((), Action.parse("0W2")))
    program = Program([Instr((), (), _noop, (), str(st.compute)) for st in steps], steps)
    assert program.weight_steps() == {0: [3, 7]}
    fold, finish = (lambda: None), (lambda: None)
    program.install(StepHooks(after_grads=((0, finish),), after_weights=((0, fold),)))
    assert program.instrs[4].posts == (fold,)  # after 0W0
    assert program.instrs[8] == Instr((fold, finish), (), None, (), "")  # after 0W2, the last


# --------------------------------------------------------------------------------------------
# step.py


class _Ranges:
    def __init__(self, log) -> None:
        self.log, self.stack = log, []

    def push(self, name):
        self.stack.append(name)
        self.log.append(f"push {name}")

    def pop(self):
        self.log.append(f"pop {self.stack.pop()}")

    @property
    def depth(self):
        return len(self.stack)

    def unwind(self, depth):
        while len(self.stack) > depth:
            self.pop()


class _Transfer:
    def __init__(self, name, log, fail=False) -> None:
        self.name, self.log, self.fail = name, log, fail

    def post(self):
        self.log.append(f"post {self.name}")
        if self.fail:
            raise RuntimeError("peer gone")


class _Doing:
    """What ``Faults`` is told of the step: ``doing(what)``."""

    def __init__(self) -> None:
        self.action = ""

    def doing(self, what: str) -> None:
        self.action = what


def _loop(log, pending=(), finish_fails=False):
    cleared = []

    def finish():
        log.append("finish")
        if finish_fails:
            raise RuntimeError("send failed")

    engine = SimpleNamespace(
        begin=lambda handshake, sends=None: log.append(f"begin {handshake}"), finish=finish
    )
    store = SimpleNamespace(clear=lambda: cleared.append(1))
    runner = SimpleNamespace(pending_weight_work=lambda: list(pending), stores=[store, store])
    faults = _Doing()
    ranges = _Ranges(log)
    loop = StepLoop(_ctx(), runner, engine, None, faults, ranges, nccl=False)
    return loop, faults, ranges, cleared


def _rec(log, what):
    return lambda *args: log.append(f"{what}{args}" if args else what)


def test_run_posts_waits_and_computes_in_order_in_ranges():
    log: list[str] = []
    loop, faults, ranges, _ = _loop(log)
    program = Program(
        [
            Instr(
                (_rec(log, "p0"), _rec(log, "p1")),
                (_rec(log, "w0"),),
                _rec(log, "F"),
                (0, 1),
                "0F1",
            ),
            Instr((), (_rec(log, "w1"),), None, (), ""),
            Instr((_rec(log, "p2"),), (), _rec(log, "B"), (0, 1), "0B1"),
        ],
        [],
    )
    loop.run(program, True)
    assert log == [
        "push step",
        "begin True",
        "p0",
        "p1",
        "w0",
        "push 0F1",
        "F(0, 1)",
        "pop 0F1",
        "w1",
        "p2",
        "push 0B1",
        "B(0, 1)",
        "pop 0B1",
        "finish",
        "pop step",
    ]
    assert faults.action == "" and ranges.depth == 0


def _boom(*args):
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("instrs", "action"),
    [
        ([Instr((), (), _boom, (0, 0), "1F0")], "1F0"),
        ([Instr((), (), _noop, (), "1F0"), Instr((), (), _boom, (), "")], "the end of the step"),
        ([Instr((_noop, _boom), (), _noop, (), "1F0")], "_boom"),
        ([Instr((), (functools.partial(_boom, 1),), _noop, (), "1F0")], "_boom"),
    ],
)
def test_a_failure_names_what_the_rank_was_doing(instrs, action):
    log: list[str] = []
    loop, faults, ranges, _ = _loop(log)
    ranges.push("call")
    with pytest.raises(RuntimeError, match="boom"):
        loop.run(Program(instrs, []), False)
    assert faults.action == action
    assert ranges.stack == ["call"]  # every range the step opened is closed
    assert "finish" not in log


def test_a_failed_post_names_its_transfer():
    log: list[str] = []
    loop, faults, ranges, _ = _loop(log)
    t = _Transfer("1RECV_F0", log, fail=True)
    with pytest.raises(RuntimeError, match="peer gone"):
        loop.run(Program([Instr((t.post,), (), _noop, (), "1F0")], []), False)
    assert faults.action == "post 1RECV_F0"
    assert ranges.depth == 0


def test_the_end_of_the_step_waits_for_sends_and_checks_deferred_work():
    log: list[str] = []
    loop, faults, _, _ = _loop(log, finish_fails=True)
    with pytest.raises(RuntimeError, match="send failed"):
        loop.run(Program([Instr((), (), _noop, (), "1F0")], []), False)
    assert faults.action == "wait sends"
    log.clear()
    loop, faults, ranges, cleared = _loop(log, pending=["stage 1"])
    with pytest.raises(RuntimeError, match="deferred weight-gradient work for"):
        loop.run(Program([Instr((), (), _noop, (), "1I0")], []), False)
    assert faults.action == "wait sends" and cleared == [1, 1] and ranges.depth == 0


def test_train_is_a_handshake_step_on_a_new_signature():
    log: list[str] = []
    loop, _, _, _ = _loop(log)
    begun = []
    loop.runner.keyword_routes = lambda names: SimpleNamespace(used=())
    loop.runner.begin = lambda mb_in, mb_lab, mb_kw, routes, infer: begun.append(
        (mb_in, mb_lab, infer)
    )
    loop.loss = SimpleNamespace(prepare_seed=lambda s: None, reduce=lambda: torch.ones(()))
    loop.engine.staged = False
    program = Program([], [])
    x, y = torch.arange(4.0), torch.arange(4.0) * 10
    a = BatchSignature(True, ((F32, 4),), ((F32, 4),), ())
    b = a._replace(inputs=((F64, 4),))
    for sig in (a, a, b, b):
        loop.train(program, sig, x, y, {}, None)
    loop.forget()
    loop.train(program, b, x, y, {}, None)
    assert [e for e in log if e.startswith("begin")] == [
        "begin True",
        "begin False",
        "begin True",
        "begin False",
        "begin True",
    ]
    mb_in, mb_lab, infer = begun[0]
    assert infer is False  # a training step
    assert [t[0].tolist() for t in mb_in] == [[0.0, 1.0], [2.0, 3.0]]
    assert [t.tolist() for t in mb_lab] == [[0.0, 10.0], [20.0, 30.0]]  # a tensor: unwrapped


# --------------------------------------------------------------------------------------------
# loss.py


class _Scaler:
    def __init__(self) -> None:
        self.scaled = []

    def scale(self, t):
        self.scaled.append(t.clone())
        return t * 1024


class _LossRunner:
    """The stage runner's side of the loss: the seed it is given, the losses it hands over."""

    def __init__(self) -> None:
        self.backward_seed = None
        self.parts: list = []
        self.taken = 0

    def set_backward_seed(self, seed) -> None:
        self.backward_seed = seed

    def take_loss_parts(self) -> list:
        self.taken += 1
        parts, self.parts = self.parts, []
        return parts


def test_loss_buffers_and_seed():
    runner = _LossRunner()
    loss = LossReducer(_ctx(m=4), runner, None)
    loss.ensure(torch.float64)
    assert loss.losses.tolist() == [0.0] * 4 and loss.losses.dtype is torch.float64
    assert loss.seed.shape == () and loss.out.dtype is torch.float64
    kept = loss.losses, loss.seed, loss.out
    loss.ensure(torch.float64, frozen=True)  # the same dtype: the same buffers
    assert (loss.losses, loss.seed, loss.out) == kept
    with pytest.raises(ValueError, match=r"the loss dtype changed to torch\.float32 after capture"):
        loss.ensure(torch.float32, frozen=True)
    loss.prepare_seed(None)
    assert loss.seed.item() == 0.25 and runner.backward_seed is loss.seed
    scaler = _Scaler()
    loss.prepare_seed(scaler)
    assert runner.backward_seed.item() == 256.0 and scaler.scaled[0].item() == 0.25
    summed = LossReducer(_ctx(m=4), _LossRunner(), None, reduction="sum")
    summed.ensure(torch.float32)
    summed.prepare_seed(None)
    assert summed.seed.item() == 1.0 and summed.runner.backward_seed is summed.seed


def test_a_rank_without_the_loss_only_initialises_the_scaler():
    runner = _LossRunner()
    loss = LossReducer(_ctx(num_ranks=2, rank=1), runner, None)
    loss.ensure(torch.float32)
    scaler = _Scaler()
    loss.prepare_seed(scaler)
    assert [t.item() for t in scaler.scaled] == [0.0]
    assert loss.seed.item() == 0.0 and runner.backward_seed is None


@pytest.mark.parametrize(("reduction", "value"), [("mean", 3.0), ("sum", 12.0)])
def test_reduce_of_the_micro_batch_losses(reduction, value):
    runner = _LossRunner()
    loss = LossReducer(_ctx(m=4), runner, None, reduction=reduction)
    loss.ensure(torch.float32)
    runner.parts = [torch.tensor(v) for v in (1.0, 2.0, 3.0, 6.0)]
    out = loss.reduce()
    assert out is loss.out and out.item() == value
    assert loss.losses.tolist() == [1.0, 2.0, 3.0, 6.0] and runner.taken == 1
    replicas = LossReducer(
        _ctx(m=4), runner, None, reduction=reduction, average=lambda t: t.div_(4)
    )  # the data-parallel average over the replicas
    replicas.ensure(torch.float32)
    runner.parts = [torch.tensor(v) for v in (1.0, 2.0, 3.0, 6.0)]
    assert replicas.reduce().item() == value / 4


def test_the_runner_hands_over_its_losses_and_outputs_once():
    runner = StageRunner(
        [nn.Linear(2, 2)], [0], 0, 2, lambda y, t: y.sum(), torch.device("cpu"), [[False] * 2], True
    )
    runner.begin([], [], infer=True)
    assert runner.infer
    runner.infer_outputs[1] = "out"
    assert runner.take_infer_outputs() == [None, "out"]
    assert runner.take_infer_outputs() == [None, None]
    runner.begin([], [])
    assert not runner.infer
    runner.loss_parts[0] = "loss"
    assert runner.take_loss_parts() == ["loss", None]
    assert runner.take_loss_parts() == [None, None]
    seed = torch.ones(())
    runner.set_backward_seed(seed)
    assert runner.backward_seed is seed


def test_reduce_broadcasts_from_the_loss_rank_over_the_control_group():
    calls = []
    group = SimpleNamespace(broadcast=lambda t, root: calls.append((t, root)))
    faults = SimpleNamespace(control=lambda what, fn: (calls.append(what), fn(group)))
    loss = LossReducer(_ctx(num_ranks=2, rank=1, loss_rank=0), SimpleNamespace(), faults)
    loss.ensure(torch.float32)
    out = loss.reduce()
    assert calls == ["loss", (out, 0)]


# --------------------------------------------------------------------------------------------
# tied.py (one rank)


def _one_instr_program() -> Program:
    return Program([Instr((), (), _noop, (), "0F0")], [])


def test_tied_copies_on_one_rank_start_equal_and_sum_their_gradients():
    first = _holder(a=torch.tensor([1.0, 2.0]), c=torch.tensor([5.0]), d=torch.zeros(1))
    second = _holder(b=torch.tensor([9.0, 9.0]))
    a, c, b = first.a, first.c, second.b
    mark_tied(a, "emb")
    mark_tied(b, "emb")
    mark_tied(c, "head")
    program, sync = _one_instr_program(), GradSync()
    tied = TiedWeights(_ctx((first, second)), sync)
    assert b.tolist() == [1.0, 2.0]  # from the first copy
    assert tied.counted_elsewhere == {id(b)}  # a second local copy: counted once
    assert [(s.names, s.size, s.group) for s in tied.sets] == [(["emb", "head"], 1, None)]
    assert sync.hooks == [tied.divide_existing]
    program.install(sync.step_hooks(), tied.step_hooks())
    assert program.instrs[-1] == Instr((), (), tied.reduce, (), "tied grads")
    assert program.instrs[0].posts == (sync.begin,)
    a.grad, b.grad = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    tied.reduce()
    assert a.grad.tolist() == b.grad.tolist() == [11.0, 22.0]
    assert c.grad.tolist() == [0.0]  # no gradient: zeros, summed
    tied.divide_existing()  # one holder rank: the first copy keeps its sum, others restart
    assert a.grad.tolist() == [11.0, 22.0] and b.grad.tolist() == [0.0, 0.0]
    sync.sync = False
    b.grad = torch.tensor([1.0, 1.0])
    tied.reduce()  # inside no_sync: nothing
    assert a.grad.tolist() == [11.0, 22.0] and b.grad.tolist() == [1.0, 1.0]


def test_no_tied_parameter_adds_nothing():
    program, sync = _one_instr_program(), GradSync()
    tied = TiedWeights(_ctx((_holder(w=torch.ones(2)),)), sync)
    assert tied.sets == [] and tied.counted_elsewhere == set()
    assert tied.step_hooks() == StepHooks() and sync.step_hooks() == StepHooks()
    program.install(sync.step_hooks(), tied.step_hooks())
    assert program.instrs == [Instr((), (), _noop, (), "0F0")]


# --------------------------------------------------------------------------------------------
# clipping.py (one rank)


def _grads(*values):
    params = [nn.Parameter(torch.zeros(len(v), dtype=torch.float64)) for v in values]
    for p, v in zip(params, values, strict=True):
        p.grad = torch.tensor(v, dtype=torch.float64)
    return params


@pytest.mark.parametrize(("norm_type", "norm"), [(1.0, 19.0), (2.0, 13.0), (math.inf, 12.0)])
@pytest.mark.parametrize("max_norm", [6.5, 100.0])
def test_clip_matches_torch_clip_grad_norm(norm_type, norm, max_norm):
    values = ([3.0, -4.0], [12.0], [0.0])
    mine, ref = _grads(*values), _grads(*values)
    modules = [_holder(p=p) for p in mine]
    total = GradClipper(_ctx(modules)).clip(max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    assert total.item() == norm == expected.item()
    for p, q in zip(mine, ref, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-15, atol=0.0)
    if max_norm > norm:  # nothing to clip: the gradients stay as they were
        assert [p.grad.tolist() for p in mine] == [list(v) for v in values]


def test_a_copy_counted_elsewhere_is_scaled_but_not_counted():
    p, q = _grads([3.0, 4.0], [100.0])
    modules = (_holder(p=p), _holder(q=q))
    clipper = GradClipper(_ctx(modules), counted_elsewhere={id(q)})
    total = clipper.clip(1.0)
    scale = 1.0 / (5.0 + 1e-6)
    assert total.item() == 5.0
    assert q.grad.item() == pytest.approx(100.0 * scale, rel=1e-15)
    assert p.grad.tolist() == pytest.approx([3.0 * scale, 4.0 * scale], rel=1e-15)


def test_a_parameter_without_gradient_or_frozen_is_left_out():
    p, q = _grads([3.0, 4.0], [1.0])
    q.requires_grad_(False)
    r = nn.Parameter(torch.ones(2, dtype=torch.float64))  # no .grad
    mod = _holder(p=p, q=q, r=r)
    assert GradClipper(_ctx((mod,))).clip(100.0).item() == 5.0
    assert r.grad is None and q.grad.tolist() == [1.0]


def test_in_step_clips_at_the_end_of_a_synced_step_only():
    (p,) = _grads([30.0, 40.0])
    mod = _holder(p=p)
    program, sync = _one_instr_program(), GradSync()
    clipper = GradClipper(_ctx((mod,)))
    program.install(clipper.in_step(5.0, 2.0, sync))
    instr = program.instrs[-1]
    assert instr.name == "clip_grad_norm" and len(program.instrs) == 2
    sync.sync = False
    instr.handler()
    assert clipper.norm is None and p.grad.tolist() == [30.0, 40.0]
    sync.sync = True
    instr.handler()
    assert clipper.norm.item() == 50.0
    assert p.grad.tolist() == pytest.approx([3.0, 4.0], rel=1e-6)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0.0, 2.0), "max_norm must be a positive number, got 0.0"),
        ((True, 2.0), "max_norm must be a positive number, got True"),
        ((1.0, -1.0), "norm_type must be a positive number or inf, got -1.0"),
        ((1.0, "2"), "norm_type must be a positive number or inf, got '2'"),
    ],
)
def test_check_clip_args(args, match):
    with pytest.raises(ValueError, match=match):
        check_clip_args(*args)
    assert check_clip_args(2, math.inf) == (2.0, math.inf)


# --------------------------------------------------------------------------------------------
# unique_parameters (graphpipe.roles): the runtime's and the models' one definition


def test_unique_parameters_and_the_rank_context():
    shared, frozen = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1), requires_grad=False)
    first = _holder(w=torch.ones(2), shared=shared)
    last = _holder(shared=shared, frozen=frozen, v=torch.ones(3))
    assert unique_parameters([first, last]) == [first.w, shared, frozen, last.v]
    assert unique_parameters(last) == [shared, frozen, last.v]
    assert unique_parameters((first, last), trainable=True) == [first.w, shared, last.v]
    assert _ctx((first, last)).parameters() == [first.w, shared, last.v]
    assert models.unique_parameters is unique_parameters
