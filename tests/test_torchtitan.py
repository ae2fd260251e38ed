"""graphpipe.integrations.torchtitan.pipelining_fn on torchtitan's own parts: the llama3
debugmodel split by torchtitan's pipeline_llm on 2 CPU gloo ranks, stepped exactly as
torchtitan's Trainer steps its schedule (pre-split micro-batches, positions and a
FlexAttention BlockMask per micro-batch, loss_kwargs={"global_valid_tokens": t},
scale_grads=False), against torch's stock ScheduleDualPipeV from torchtitan's own
pipelining_fn on the same weights. Skipped where torchtitan is not installed."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.spawn import run_ranks

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install '.[torchtitan]')"
)

SEQ, M = 128, 4  # FlexAttention's block is 128 tokens; M >= 2N for DualPipeV on 2 ranks
# float32, the same kernels per micro-batch in both runs, but graphpipe's deferred Linear
# adds each micro-batch's weight gradient into .grad in another order than torch's split
# backward: float32 rounding of sums over 4 micro-batches.
RTOL, ATOL = 1e-5, 1e-6  # the losses
GRAD_RTOL = 1e-5  # ||grad - torch's|| / ||torch's||, per parameter


def _cpu_shims() -> None:
    """What torchtitan 0.3.0 needs to run on CPU, applied in each rank (no torchtitan file is
    edited). Each one is named where it is applied."""
    import torch.nn.attention.flex_attention as fa
    from torchtitan.distributed import parallel_dims, utils
    from torchtitan.models.common import attention
    from torchtitan.tools import utils as tools_utils

    # torchtitan picks "cuda" when no accelerator is found; these modules read it at import.
    for mod in (tools_utils, parallel_dims, utils):
        mod.device_type = "cpu"
    # torch refuses FlexAttention's backward on CPU tensors (_validate_device); its eager
    # reference implementation computes it (torchtitan itself uses that path on ROCm).
    fa._validate_device = lambda *args: None
    # torchtitan compiles flex_attention and create_block_mask with inductor: on CPU the
    # eager functions give the same values without minutes of compilation.
    attention.FlexAttention._compiled_flex_attn = fa.flex_attention
    attention._compiled_create_block_mask = fa.create_block_mask


def _torch_step_presplit(schedule, arg_mbs, kwarg_mbs, target_mbs, losses, loss_kwargs):
    """torch 2.13's schedules take no pre-split step(arg_mbs=...) (torch 2.14 does, and
    torchtitan's Trainer calls it so): its step's own body, on pre-split micro-batches."""
    for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
        stage.has_backward = schedule._has_backward
        stage.clear_runtime_states()
    schedule._step_microbatches(
        arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs=False, loss_kwargs=loss_kwargs
    )


def _job(
    rank: int, world: int, impl: str, capture: str | None, steps: int, name: str = "DualPipeV"
) -> dict:
    _cpu_shims()
    import functools

    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from graphpipe.integrations.torchtitan import pipelining_fn

    config = llama3_debugmodel()
    config.parallelism.pipeline_parallel_degree = world
    config.parallelism.pipeline_parallel_schedule = name
    config.parallelism.pipeline_parallel_microbatch_size = 1
    config.training.local_batch_size = M
    config.training.seq_len = SEQ
    config.training.mixed_precision_param = "float32"  # compare float32 with float32
    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    parallel_dims.build_mesh()
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    loss_fn = config.loss.build(compile_config=config.compile)
    fn = pipeline_llm if impl == "torch" else functools.partial(pipelining_fn, capture=capture)
    schedule, parts, first, last = fn(
        model,
        parallel_dims=parallel_dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=None,  # no activation checkpointing (DualPipeV's split backward needs it off)
        dump_folder="/tmp",
        device=torch.device("cpu"),
        model_config=model_config,
        parallelize_fn=config.model_spec.parallelize_fn,
        loss_fn=loss_fn,
    )
    stage_objs = getattr(schedule, "_stages", None) or [schedule._stage]
    index = {id(st.submod): st.stage_index for st in stage_objs}
    for m in parts:
        torch.manual_seed(index[id(m)])  # each stage's weights, whatever the placement
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        m.train()
    if last:  # as the Trainer does after pipelining_fn: the chunked loss runs the lm_head
        loss_fn.set_lm_head(parts[-1].lm_head)
        parts[-1]._skip_lm_head = True
    out: dict = {"losses": [], "grads": [], "first": first, "last": last}
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 2048, (M, 1, SEQ + 1), generator=g)
        doc = SEQ // 2 + step  # two documents per sequence: a document mask
        positions = torch.cat([torch.arange(doc), torch.arange(SEQ - doc)]).view(1, SEQ)
        arg_mbs = [(tokens[i, :, :-1],) for i in range(M)]
        target_mbs = [tokens[i, :, 1:] for i in range(M)]
        kwarg_mbs = [
            {"positions": positions, "attention_masks": parts[0].get_attention_masks(positions)}
            for _ in range(M)
        ]
        loss_kwargs = {"global_valid_tokens": torch.tensor(M * SEQ)}
        for m in parts:
            m.zero_grad()
        losses = [] if last else None
        if impl == "torch":
            _torch_step_presplit(
                schedule,
                arg_mbs if first else None,
                kwarg_mbs,
                target_mbs if last else None,
                losses,
                loss_kwargs,
            )
        else:
            schedule.step(
                arg_mbs=arg_mbs if first else None,
                kwarg_mbs=kwarg_mbs,
                target_mbs=target_mbs if last else None,
                losses=losses,
                loss_kwargs=loss_kwargs,
                return_outputs=False,
            )
        out["losses"].append([float(v.detach()) for v in losses] if last else [])
        out["grads"].append(
            {
                n: p.grad.clone()
                for m in parts
                for n, p in m.named_parameters()
                if p.grad is not None
            }
        )
    if impl != "torch":
        out["deferrable"] = schedule.pipe.num_deferrable
        out["idle_w"] = schedule.pipe.runner.idle_weight_stages()
        schedule.close()
    return out


pytestmark = pytest.mark.distributed
REFERENCE_STEPS = 3  # the most steps a test here compares


@functools.cache
def _interleaved1f1b_run() -> tuple:
    return tuple(
        run_ranks(
            _job, 2, "torch", None, REFERENCE_STEPS, "Interleaved1F1B", timeout=900, pg_timeout=600
        )
    )


def _torch_interleaved1f1b(steps: int) -> list[dict]:
    """torch's Interleaved1F1B, the reference of every test here: its first ``steps`` steps of
    one run shared by the tests (each step's batch depends only on its index)."""
    return [
        {**r, "losses": r["losses"][:steps], "grads": r["grads"][:steps]}
        for r in _interleaved1f1b_run()
    ]


def _losses_equal(want: list, got: list) -> None:
    assert len(got) == len(want)
    for lw, lg in zip(want, got, strict=True):
        assert len(lg) == len(lw)
        torch.testing.assert_close(torch.tensor(lg), torch.tensor(lw), rtol=RTOL, atol=ATOL)


def test_pipelining_fn_steps_like_torchs_schedules_on_torchtitans_llama3() -> None:
    """graphpipe's DualPipeV through pipelining_fn: the losses of torch's stock DualPipeV
    and of torch's Interleaved1F1B (same four stages, same weights), and the gradients of
    the latter. Not every gradient of torch's DualPipeV: its split backward loses the last
    stage's norm.weight gradient of micro-batch 0 (the one whose last-stage backward it splits)
    because torchtitan's ChunkedLossWrapper reshards the FSDP2 group of [norm, lm_head] in the
    forward and torch's BACKWARD_INPUT then finds the sharded norm.weight, which is not in the
    graph (tests/test_torch_dualpipev_reference.py); every other gradient of torch's DualPipeV
    graphpipe matches (checked below)."""
    steps = 2
    dualpipev = run_ranks(_job, 2, "torch", None, steps, "DualPipeV", timeout=900, pg_timeout=600)
    interleaved = _torch_interleaved1f1b(steps)
    got = run_ranks(_job, 2, "graphpipe", None, steps, timeout=900, pg_timeout=600)
    assert (got[0]["first"], got[0]["last"]) == (True, True)  # V: stages 0 and 3 on rank 0
    _losses_equal(dualpipev[0]["losses"], got[0]["losses"])
    # Interleaved1F1B places stage 3 (the loss) on rank 1.
    _losses_equal(interleaved[1]["losses"], got[0]["losses"])
    assert got[0]["losses"][0], "rank 0 (the last stage under DualPipeV) reported no loss"
    for r in got:  # the Linears defer through torchtitan's forward wrappers (switch_linears)
        assert all(r["deferrable"]) and r["idle_w"] == [], (r["deferrable"], r["idle_w"])
    full = [{**interleaved[0]["grads"][s], **interleaved[1]["grads"][s]} for s in range(steps)]
    mine = [{**got[0]["grads"][s], **got[1]["grads"][s]} for s in range(steps)]
    torch_v = [{**dualpipev[0]["grads"][s], **dualpipev[1]["grads"][s]} for s in range(steps)]
    for s in range(steps):
        assert sorted(mine[s]) == sorted(full[s]) and len(full[s]) > 10
        for name, want in full[s].items():
            _grad_close(name, mine[s][name], want)
            if name != "norm.weight":
                _grad_close(name, mine[s][name], torch_v[s][name])


def _grad_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    a, b = got.double(), want.double()
    rel = float((a - b).norm() / b.norm())
    assert rel < GRAD_RTOL, f"{name}: relative difference {rel:.2e} of the norms"


def test_captured_pipelining_fn_equals_eager_and_torchs_interleaved1f1b() -> None:
    """capture="step" (on CPU: warmup, static step, then replays of the static step), three
    steps whose document boundaries move: the BlockMask's tensors and the document ids its
    mask_mod closes over live in static buffers refreshed each step."""
    steps = 3
    interleaved = _torch_interleaved1f1b(steps)
    got = run_ranks(_job, 2, "graphpipe", "step", steps, timeout=900, pg_timeout=600)
    _losses_equal(interleaved[1]["losses"], got[0]["losses"])
    for s in range(steps):
        full = {**interleaved[0]["grads"][s], **interleaved[1]["grads"][s]}
        mine = {**got[0]["grads"][s], **got[1]["grads"][s]}
        assert sorted(mine) == sorted(full)
        for name, want in full.items():
            _grad_close(name, mine[name], want)


def test_pipelining_fn_runs_torchs_order_of_other_schedules() -> None:
    """Interleaved1F1B, which graphpipe does not generate: pipelining_fn runs the order
    torch's class generated (its pipeline_order) with the same losses and gradients."""
    steps = 1
    want = _torch_interleaved1f1b(steps)
    got = run_ranks(
        _job, 2, "graphpipe", None, steps, "Interleaved1F1B", timeout=900, pg_timeout=600
    )
    assert (got[1]["first"], got[1]["last"]) == (False, True)  # loop placement: 3 on rank 1
    _losses_equal(want[1]["losses"], got[1]["losses"])
    assert got[1]["losses"][0]
    for r in range(2):
        assert sorted(got[r]["grads"][0]) == sorted(want[r]["grads"][0])
        for name, w in want[r]["grads"][0].items():
            _grad_close(name, got[r]["grads"][0][name], w)


@pytest.mark.parametrize(
    ("degrees", "backend", "match"),
    [
        ({"cp": 2}, "partial_dtensor", r"also has \{'cp': 2\}: graphpipe has no context"),
        ({"dp_shard": 4, "ep": 4}, "spmd_types", r"\{'dp_shard': 4, 'ep': 4\} needs"),
        (
            {"dp_shard": 2},
            "spmd_types",
            r"\{'dp_shard': 2\} needs .*got 'spmd_types'",
        ),
        (
            {"dp_replicate": 2, "tp": 2},
            "full_dtensor",
            r"'dp_replicate': 2, 'tp': 2\}.*got 'full_dtensor'",
        ),
    ],
)
def test_pipelining_fn_refuses_what_it_does_not_run_naming_it(
    degrees: dict, backend: str, match: str
) -> None:
    from types import SimpleNamespace

    from graphpipe.integrations.torchtitan import pipelining_fn

    dims = SimpleNamespace(
        **{"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1, **degrees}
    )
    parallelism = SimpleNamespace(spmd_backend=backend, pipeline_parallel_schedule="DualPipeV")
    with pytest.raises(ValueError, match=match):
        pipelining_fn(
            torch.nn.Linear(2, 2), parallel_dims=dims, training=None, parallelism=parallelism,
            compile_config=None, ac_config=None, dump_folder="", device=torch.device("cpu"),
            model_config=None, parallelize_fn=lambda m, **kw: m, loss_fn=None,
        )  # fmt: skip


def _edges_job(rank: int, world: int) -> None:
    """Two stages split at a DTensor edge on a tp mesh of 2 ranks: the shards sent and
    rebuilt give the losses and gradients of the unsplit computation; each layout the
    edges cannot carry is refused, naming the stage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from graphpipe.integrations.torchtitan import _TensorParallelEdges

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for sequence_parallel in (True, False):
        edges = _TensorParallelEdges(mesh, sequence_parallel=sequence_parallel)
        layout = [Shard(1)] if sequence_parallel else [Replicate()]

        def first(x: torch.Tensor, layout: list = layout) -> DTensor:
            h = distribute_tensor(x, mesh, [Shard(1)]) @ distribute_tensor(w, mesh, [Replicate()])
            return h.redistribute(mesh, layout)

        def second(h: DTensor) -> torch.Tensor:
            return (h.redistribute(mesh, [Replicate()]).to_local() ** 2).sum()

        xa = x.clone().requires_grad_()
        want = second(first(xa))
        want.backward()
        # The split: the send hook's shard crosses as a leaf; the receive hook rebuilds it.
        xb = x.clone().requires_grad_()
        shard = edges.send(0, None, (xb,), first(xb))
        width = 6 // world if sequence_parallel else 6
        assert type(shard) is torch.Tensor and list(shard.shape) == [2, width, 4]
        leaf = shard.detach().requires_grad_()
        (h,), _ = edges.receive(1, None, (leaf,), {})
        got = second(h)
        got.backward()
        shard.backward(leaf.grad)  # the gradient sent back
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-15, atol=1e-15)

    edges = _TensorParallelEdges(mesh, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"stage 2's output has placements \(Replicate\(\),\)"):
        edges.send(2, None, (), distribute_tensor(x, mesh, [Replicate()]))
    with pytest.raises(ValueError, match=r"stage 2's output \[2, 5, 4\] is sharded unevenly"):
        edges.send(2, None, (), distribute_tensor(x[:, :5], mesh, [Shard(1)]))
    with pytest.raises(TypeError, match="stage 2's output is a Tensor, not the DTensor"):
        edges.send(2, None, (), x)
    with pytest.raises(TypeError, match=r"stage 3 under tensor .* got a torch.int64 tensor"):
        edges.receive(3, None, (torch.zeros(2, 3, dtype=torch.long),), {})


def test_tensor_parallel_edges_carry_dtensor_hidden_states_exactly() -> None:
    run_ranks(_edges_job, 2)
