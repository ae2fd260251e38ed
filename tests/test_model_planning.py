"""``plan_hf_split``, ``plan_llama_split`` and ``measure_stage`` (graphpipe.models.planning):
structure and invariants of plans of tiny models measured here, and the exact bytes of a
single Linear. No assertion on a measured time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphpipe.models import LlamaConfig, measure_stage, plan_hf_split, plan_llama_split
from graphpipe.models.planning import rank_threads
from graphpipe.schedule.planner import MemoryBudgetExceeded, StagePlan
from graphpipe.schedule.splits import check_layers_per_stage

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face tests need transformers (pip install graphpipe[hf])"
)


def _hf_model(layers: int = 6, tied: bool = True) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _ids(rows: int = 8, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (rows, seq), generator=torch.Generator().manual_seed(1))


def _check_plan(plan: StagePlan, layers: int, stages: int) -> None:
    assert check_layers_per_stage(plan.layers_per_stage, layers, stages)
    assert len(plan.stage_costs) == stages == len(plan.even_stage_costs)
    assert plan.predicted_step_s <= plan.even_predicted_step_s
    assert plan.predicted_step_s > 0
    assert len(plan.peak_memory_bytes) == plan.num_ranks
    assert all(p > 0 for p in plan.peak_memory_bytes)


def test_a_single_linear_holds_its_input_until_backward_and_input_and_grad_until_w() -> None:
    lin = nn.Linear(4, 3, bias=False)
    cost = measure_stage(lin, torch.randn(2, 4), reps=1)
    assert cost.activation_bytes == 2 * 4 * 4  # x, float32 (the weight is not counted)
    assert cost.weight_grad_bytes == 2 * 4 * 4 + 2 * 3 * 4  # x and the output's gradient
    assert cost.parameter_bytes == 2 * 12 * 4  # the weight and its gradient
    assert lin.weight.grad is None and type(lin) is nn.Linear  # measured on a copy


def test_plan_hf_split_plans_every_layer_and_leaves_the_model_as_it_was() -> None:
    model = _hf_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_hf_split(model, 4, input_ids=_ids(), num_microbatches=4, reps=1)
    _check_plan(plan, 6, 4)
    assert plan.schedule == "dualpipev" and plan.num_ranks == 2 and plan.num_microbatches == 4
    assert plan.even_layers_per_stage == (1, 2, 2, 1)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear


def test_plan_hf_split_takes_a_mask_labels_and_candidate_microbatch_counts() -> None:
    model = _hf_model(tied=False)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[:, 6:] = 0
    plan = plan_hf_split(
        model,
        4,
        input_ids=ids,
        attention_mask=mask,
        labels=ids.masked_fill(mask == 0, -100),
        num_microbatches=[4, 8],
        schedule="auto",
        reps=1,
    )
    _check_plan(plan, 6, 4)
    assert plan.num_microbatches in (4, 8) and plan.schedule in ("dualpipev", "zbv")


def test_plan_hf_split_refuses_a_budget_nothing_fits_and_bad_shapes() -> None:
    model = _hf_model()
    with pytest.raises(MemoryBudgetExceeded, match=r"no split fits memory_budget=1000 bytes"):
        plan_hf_split(model, 4, input_ids=_ids(), num_microbatches=4, memory_budget=1000, reps=1)
    with pytest.raises(ValueError, match=r"8 rows does not split into num_microbatches=3"):
        plan_hf_split(model, 4, input_ids=_ids(), num_microbatches=3, reps=1)
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids"):
        plan_hf_split(
            model,
            4,
            input_ids=_ids(),
            attention_mask=torch.ones(8, 4),
            num_microbatches=4,
            reps=1,
        )
    with pytest.raises(ValueError, match=r"split_hf_causal_lm: .* does not have the layout"):
        plan_hf_split(nn.Linear(2, 2), 4, input_ids=_ids(), num_microbatches=4)


def test_plan_llama_split_plans_the_built_in_model() -> None:
    cfg = LlamaConfig(n_layers=4, hidden=32, n_heads=2, max_seq_len=16, use_kernels=False)
    tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    plan = plan_llama_split(cfg, 4, tokens=tokens, num_microbatches=4, reps=1)
    _check_plan(plan, 4, 4)
    # the tied embedding and head are one parameter on rank 0 (DualPipeV: stages 0 and 3)
    embed = 2 * 256 * 32 * 4
    assert plan.peak_memory_bytes[0] >= embed
    with pytest.raises(ValueError, match=r"a model with experts \(num_experts=2\)"):
        plan_llama_split(
            LlamaConfig(n_layers=2, num_experts=2, use_kernels=False),
            4,
            tokens=tokens,
            num_microbatches=4,
        )


def test_pieces_are_measured_with_the_threads_each_rank_will_have(monkeypatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert rank_threads(4, "dualpipev") == 8  # 2 ranks
    assert rank_threads(4, "1f1b") == 4  # 4 ranks
    assert rank_threads(16, "auto") == 2  # 8 ranks
    assert rank_threads(64, "1f1b") == 1
    with pytest.raises(ValueError, match=r"unknown schedule 'gpipe'"):
        rank_threads(4, "gpipe")


def test_the_threads_setting_is_restored_after_measuring() -> None:
    before = torch.get_num_threads()
    seen = []
    lin = nn.Linear(4, 4)
    lin.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    from graphpipe.models.planning import _measure, _Piece

    _measure([_Piece(lin, torch.randn(2, 4), None, None, None)], 1, threads=1)
    assert set(seen) == {1}
    assert torch.get_num_threads() == before


def test_the_plan_is_what_split_hf_causal_lm_takes() -> None:
    from graphpipe.models import split_hf_causal_lm

    model = _hf_model()
    plan = plan_hf_split(model, 4, input_ids=_ids(), num_microbatches=4, reps=1)
    stages = split_hf_causal_lm(model, 4, layers_per_stage=list(plan.layers_per_stage))
    assert tuple(len(s.layers) for s in stages) == plan.layers_per_stage


class _GradSeen(torch.autograd.Function):
    """The identity on ``x``, times ``weight``'s column sums; its backward records whether
    ``weight.grad`` was allocated when it ran."""

    @staticmethod
    def forward(ctx, x, weight, module):  # type: ignore[override]
        ctx.module = module
        return x * weight.sum(0)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        _GRAD_SEEN.append(ctx.module.weight.grad is not None)
        return g, torch.ones_like(ctx.module.weight) * g.sum(), None


_GRAD_SEEN: list[bool] = []


class _Recording(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GradSeen.apply(x, self.weight, self)


def test_every_timed_backward_adds_into_allocated_gradients() -> None:
    # issue 38: an embedding-only stage showed I far above B. B was timed with the weight's
    # gradient freed (the backward only stores its own: for a large embedding that skips
    # an add of the whole table), I with it allocated. In a step every micro-batch but the
    # first adds into it: every timed backward (after the warm-up round) must too.
    _GRAD_SEEN.clear()
    from graphpipe import no_defer

    measure_stage(no_defer(_Recording()), torch.randn(2, 4), reps=3)
    # the warm-up round's B, then its I, then three rounds of B and I
    assert len(_GRAD_SEEN) == 8
    assert all(_GRAD_SEEN[1:]), _GRAD_SEEN


class _OwnLinear(nn.Linear):
    """A Linear with its own forward: the pipeline cannot defer its weight gradient (as
    GPT-2's Conv1D could not), and says so."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def _model_with_undeferrable_layers() -> nn.Module:
    model = _hf_model(layers=2)
    for layer in model.model.layers:
        old = layer.mlp.down_proj
        new = _OwnLinear(old.in_features, old.out_features, bias=old.bias is not None)
        new.load_state_dict(old.state_dict())
        layer.mlp.down_proj = new
    return model


def _not_deferred(record: list) -> list[str]:
    return [str(w.message) for w in record if "deferred" in str(w.message)]


def test_undeferred_layers_are_named_once_where_the_schedule_defers_not_under_1f1b() -> None:
    # issue 38: planning GPT-2 printed a warning per Conv1D and piece, also for 1F1B, which
    # has no W to defer to
    import warnings

    model = _model_with_undeferrable_layers()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan_hf_split(model, 4, input_ids=_ids(), num_microbatches=4, schedule="1f1b", reps=1)
    assert _not_deferred(record) == []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan_hf_split(model, 4, input_ids=_ids(), num_microbatches=[4, 8], reps=1)
    (message,) = _not_deferred(record)
    assert message.startswith("graphpipe: LlamaForCausalLM: modules whose weight gradients")
    assert "(2 _OwnLinear, counted over the pieces measured)" in message
    assert "the plan's I includes them" in message


def test_candidates_are_chosen_by_the_stated_rule_and_say_why() -> None:
    model = _hf_model(tied=False)
    plan = plan_hf_split(
        model, 4, input_ids=_ids(), num_microbatches=[4, 8], schedule="auto", reps=1
    )
    pairs = {(c.schedule, c.num_microbatches) for c in plan.candidates}
    assert pairs == {(s, m) for s in ("dualpipev", "zbv") for m in (4, 8)}
    assert plan.tie_margin == 0.05  # TIE_MARGIN
    fastest = min(c.predicted_step_s for c in plan.candidates)
    tied = [c for c in plan.candidates if c.predicted_step_s <= fastest * 1.05 * (1 + 1e-9)]
    least = min(tied, key=lambda c: (c.even_peak_memory_bytes, c.peak_memory_bytes))
    assert (plan.schedule, plan.num_microbatches) == (least.schedule, least.num_microbatches)
    assert plan.choice() and "chosen: " in plan.format()
