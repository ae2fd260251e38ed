"""Deferral under FSDP2 (``fully_shard``) on one gloo rank: the W writes the gradient FSDP
reduce-scatters (the unsharded parameter's ``.grad``) before FSDP's post-backward runs."""

from __future__ import annotations

import pytest

from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed


def _fsdp_case(rank: int, world: int, reshard: bool) -> dict:
    import warnings

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from graphpipe.runtime.parts.fsdp import param_groups
    from graphpipe.weightgrad import DeferrableLinear, WeightGradStore, make_deferrable

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    ref, model = build(), build()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)  # its class becomes FSDPLinear
    fully_shard(model, mesh=mesh)  # the root holds model[2] (a plain nn.Linear, DTensor params)
    store = WeightGradStore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left alone
        count = make_deferrable(model, store)
    # The parameters the forwards read: FSDP registers the unsharded ones between its hooks.
    used = {}
    for i in (0, 2):
        model[i].register_forward_pre_hook(lambda m, args, i=i: used.update({i: m.weight}))
    # As a pipeline runs a backward: FSDP's hooks only keep unsharded gradients. With
    # ``reshard`` they also free the unsharded parameters and register the sharded ones
    # (DTensors) on the modules before the W runs.
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(reshard)
    model.set_is_last_backward(False)
    x = torch.randn(5, 4, dtype=torch.float64)
    g = torch.randn(5, 3, dtype=torch.float64)
    with store.deferring("W0"):
        model(x).backward(g)
    state = fully_shard.state(model)
    fsdp_params = [p for st in state._state_ctx.all_states for pg in param_groups(st)
                   for p in pg.fsdp_params]  # fmt: skip
    unsharded = {id(p.unsharded_param) for p in fsdp_params}
    grads_after_I = [p.unsharded_param.grad is not None for p in fsdp_params]
    registered = type(model[0].weight).__name__
    ran = store.run("W0")
    grads_after_W = [p.unsharded_param.grad is not None for p in fsdp_params]
    # After the last W: FSDP's post-backward reduce-scatters the unsharded gradients
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    model.set_is_last_backward(True)
    for st in state._state_ctx.all_states:
        for pg in param_groups(st):
            pg.post_backward()
    state._root_post_backward_final_callback()
    ref(x).backward(g)
    diffs = {
        name: float((p.grad.full_tensor() - q.grad).abs().max())
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True)
    }
    return {
        "count": count,
        "classes": [[c.__name__ for c in type(model[i]).__mro__[:3]] for i in (0, 2)],
        "is_fsdp": isinstance(model[0], FSDPModule),
        "deferrable": [isinstance(model[i], DeferrableLinear) for i in (0, 2)],
        "used_unsharded": [id(used[i]) in unsharded for i in (0, 2)],
        "grads_after_I": grads_after_I,
        "grads_after_W": grads_after_W,
        "ran": ran,
        "registered": registered,
        "diffs": diffs,
    }


@pytest.mark.parametrize("reshard", [False, True])
def test_fsdp2_linears_defer_into_the_unsharded_grads_that_fsdp_reduces(reshard):
    (res,) = run_ranks(_fsdp_case, 1, reshard)
    # what the module holds when the W runs: the W does not read it
    assert res["registered"] == ("DTensor" if reshard else "Parameter")
    assert res["count"] == 2
    assert res["is_fsdp"] and res["deferrable"] == [True, True]
    assert res["classes"] == [
        ["DeferrableFSDPLinear", "DeferrableLinear", "FSDPLinear"],
        ["DeferrableLinear", "Linear", "Module"],
    ]
    assert res["used_unsharded"] == [True, True]
    # I left the Linear gradients to W; W wrote them where FSDP reads them
    assert res["grads_after_I"] == [False] * 4, res
    assert res["grads_after_W"] == [True] * 4, res
    assert res["ran"] == 2
    # one rank: the reduce-scatter is a copy of the same GEMMs' result
    assert all(d <= 1e-15 for d in res["diffs"].values()), res["diffs"]
