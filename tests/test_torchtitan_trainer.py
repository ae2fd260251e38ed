"""torchtitan's unmodified Trainer trains with graphpipe's pipelining_fn (DualPipeV) set by a
config module, on CPU gloo processes (torchrun), every run from one seed checkpoint, each
step's loss and gradient norm compared with torch's stock Interleaved1F1B on the same stages
and parallelism: llama3's debugmodel on 2 processes for 5 steps, eager (resumed from a
checkpoint after step 2) and captured, with validation (and step 1 of torch's stock
DualPipeV); on 4 processes for 2 steps, pipeline 2 x FSDP2 2 (eager) or HSDP 2 (captured), and
pipeline 2 x tensor 2 (captured); DeepSeek-V3's MoE debugmodel for 3 steps on pipeline 2 x
FSDP2 2 with the experts over the same ranks (captured). The CPU shims live in
tests/torchtitan_trainer/launch.py, each with a comment; the tokenizer and the dataset are
written here. Skipped where torchtitan is not installed."""

from __future__ import annotations

import functools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.spawn import free_port

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install '.[torchtitan]')"
)
tokenizers = pytest.importorskip("tokenizers", reason="the test's tokenizer needs tokenizers")

HERE = Path(__file__).resolve().parent / "torchtitan_trainer"
ROOT = HERE.parent.parent
STEPS = 5
_STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+(-?[\d.]+)\s+grad_norm:\s+([\d.]+)")
_VALIDATE = re.compile(r"validate step:\s+(\d+)\s+loss:\s+(-?[\d.]+)")
# Validation (schedule.eval) at steps 1, 2 and 4, on one batch of the test's dataset.
_VALIDATION = (
    "--validator.enable", "--validator.freq", "2", "--validator.steps", "1",
    "--validator.dataloader.dataset", "c4_test",
)  # fmt: skip
_BACKEND = ("--parallelism.spmd_backend", "partial_dtensor")  # data / tensor parallelism
_BUILDS = re.compile(r"PP rank (\d+) is building stage_idx (\d+) with modules (\[.*?\])")


def _assets(tmp: Path) -> None:
    """A word-level tokenizer of 1,503 ids (the model's vocabulary is 2,048) and 400 texts of
    300 words, as torchtitan's c4_test loader reads them."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(1500)]
    data = tmp / "tests" / "assets" / "c4_test"
    data.mkdir(parents=True)
    with open(data / "data.json", "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n")
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(
        [tokenizers.AddedToken("<bos>", special=True), tokenizers.AddedToken("<eos>", special=True)]
    )
    (tmp / "tok").mkdir()
    tok.save(str(tmp / "tok" / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}
    (tmp / "tok" / "tokenizer_config.json").write_text(json.dumps(config))


def _torchrun(tmp: Path, nproc: int, config: str, *args: str, fails: bool = False) -> str:
    """torchrun of the Trainer (launch.py) with ``config`` and ``args``; its log (``fails``:
    the run must fail)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_port", str(free_port()), str(HERE / "launch.py"),
        "--module", "graphpipe_titan", "--config", config,
        "--training.local_batch_size", "4", "--training.seq_len", "128",
        "--training.disable-cuda-graphs", "--hf_assets_path", "./tok", "--debug.seed", "0",
        *args, "activation-checkpoint:none",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    log = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout + run.stderr)
    assert (run.returncode != 0) == fails, log[-4000:]
    return log


def _seed_checkpoint(tmp: Path, config: str = "stock_debugmodel") -> Path:
    """torchtitan's seed checkpoint of ``config``'s model (one process, the whole model, seed
    0): each pipeline rank initializes its own stages from its own seed (seed + rank), in
    placement order, so DualPipeV's V (stages 0 and 3 on rank 0) and Interleaved1F1B's loop (0
    and 2) would start from other weights; every run loads this checkpoint instead."""
    _torchrun(
        tmp, 1, config, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
        "--parallelism.pipeline_parallel_degree", "1", "--dump_folder", str(tmp / f"seed-{config}"),
    )  # fmt: skip
    return tmp / f"seed-{config}" / "checkpoint" / "step-0"


def _train(
    tmp: Path,
    seed: Path,
    config: str,
    schedule: str = "DualPipeV",
    *args: str,
    nproc: int = 2,
    pp: int = 2,
    steps: int = STEPS,
    resumes: int = 0,
) -> tuple[list[tuple[float, float]], str]:
    """The Trainer with ``config``, ``schedule`` and ``args`` on ``nproc`` processes (``pp``
    pipeline ranks of 2 stages each), from the seed checkpoint ``seed``: the loss and the
    gradient norm logged at each step (the loss on the last stage's ranks; the others log a
    negative placeholder), and the log. ``resumes``: the run ends after that step, saving
    its checkpoint, and a second run resumes from it to ``steps`` (the losses of both)."""
    dump = tmp / f"out-{config}-{schedule}-{nproc}-{resumes}-{'-'.join(args)}"
    common = (
        "--parallelism.pipeline_parallel_degree", str(pp),
        "--parallelism.pipeline_parallel_schedule", schedule,
        "--parallelism.pipeline_parallel_microbatch_size", "1", "--validator.freq", "100",
        "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
        "--dump_folder", str(dump),
    )  # fmt: skip
    if resumes:
        save = ("--checkpoint.interval", str(resumes))
        first = _torchrun(
            tmp, nproc, config, *common, *save, "--training.steps", str(resumes), *args
        )
        rest = _torchrun(tmp, nproc, config, *common, *save, "--training.steps", str(steps), *args)
        assert f"checkpoint/step-{resumes}" in rest, rest[-4000:]  # it resumed from there
        log = first + rest
    else:
        log = _torchrun(
            tmp, nproc, config, *common, "--checkpoint.load_only", "--training.steps",
            str(steps), *args,
        )  # fmt: skip
    logged = {int(s): (float(v), float(n)) for s, v, n in _STEP.findall(log) if float(v) >= 0}
    assert sorted(logged) == list(range(1, steps + 1)), log[-4000:]
    return [logged[s] for s in range(1, steps + 1)], log


def _validation(log: str) -> dict[int, float]:
    """The validation loss logged at each step that validated (on the last stage's ranks)."""
    return {int(s): float(v) for s, v in _VALIDATE.findall(log) if float(v) >= 0}


def _split(log: str) -> dict[int, tuple[int, str]]:
    """Each stage's rank and modules, as the Trainer logs them."""
    return {int(s): (int(r), m) for r, s, m in _BUILDS.findall(log)}


def _close(got: list[tuple[float, float]], want: list[tuple[float, float]], rtol: float) -> bool:
    """Each step's loss within ``rtol`` (relative), and its gradient norm to the last of the
    four decimals torchtitan logs (the norm catches a gradient off by a factor, which AdamW's
    update, and so the next loss, hardly shows)."""
    return all(
        abs(g - w) <= rtol * abs(w) and abs(gn - wn) <= 1.5e-4
        for (g, gn), (w, wn) in zip(got, want, strict=True)
    )


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The folder the runs start in (tokenizer, dataset) and the seed checkpoint."""
    tmp = tmp_path_factory.mktemp("titan")
    _assets(tmp)
    return tmp, _seed_checkpoint(tmp)


@pytest.mark.slow  # several torchtitan runs of 4 processes each: the slow lane
@pytest.mark.distributed
def test_torchtitans_trainer_trains_with_graphpipe_eager_and_captured(
    titan: tuple[Path, Path],
) -> None:
    tmp, seed = titan
    interleaved, interleaved_log = _train(
        tmp, seed, "stock_debugmodel", "Interleaved1F1B", *_VALIDATION
    )
    # (torch 2.13's DualPipeV cannot eval after a training step: no validation there.)
    stock, stock_log = _train(tmp, seed, "stock_debugmodel", steps=1)  # (its step 1 only)
    # Eager: 2 steps, a checkpoint (torchtitan's DCP of graphpipe's stages), then a second
    # run that resumes from it for steps 3 to 5.
    eager, eager_log = _train(
        tmp, seed, "graphpipe_debugmodel", "DualPipeV", *_VALIDATION, resumes=2
    )
    captured, captured_log = _train(
        tmp, seed, "graphpipe_debugmodel_captured", "DualPipeV", *_VALIDATION
    )
    # Validation (schedule.eval between steps, no loss_kwargs): the same losses.
    validated = _validation(interleaved_log)
    assert sorted(validated) == [1, 2, 4], interleaved_log[-4000:]
    for log in (eager_log, captured_log):
        got = _validation(log)
        assert sorted(got) == [1, 2, 4], log[-4000:]
        assert all(abs(got[s] - v) <= 1.5e-4 for s, v in validated.items()), (validated, got)
    # The same four stages: Interleaved1F1B places them 0 2 | 1 3, DualPipeV's V 0 3 | 1 2.
    loop, v = _split(interleaved_log), _split(stock_log)
    assert sorted(loop) == sorted(v) == [0, 1, 2, 3], (loop, v)
    assert [loop[s][1] for s in range(4)] == [v[s][1] for s in range(4)], (loop, v)
    assert [loop[s][0] for s in range(4)] == [0, 1, 0, 1], loop
    assert [v[s][0] for s in range(4)] == [0, 1, 1, 0], v
    # The reference: torch's Interleaved1F1B runs every backward whole, so it trains the
    # weights plain autograd does; graphpipe's DualPipeV, eager and captured, at every step.
    assert _close(eager, interleaved, 1e-5), (interleaved, eager)
    assert _close(captured, interleaved, 1e-5), (interleaved, captured)
    # torch's stock DualPipeV: step 1's loss is computed before any update, so it is the
    # same. Its split backward drops the last stage's norm.weight gradient of micro-batch 0
    # (tests/test_torch_dualpipev_reference.py): its gradient norm is off from step 1 on
    # (0.7345 against 0.7360), and from step 2 on it trains other weights (losses 0.8e-5
    # to 3.2e-5, relative, from the others at steps 2 to 5).
    assert abs(stock[0][0] - eager[0][0]) <= 1e-5 * eager[0][0], (stock, eager)


@pytest.mark.slow  # several torchtitan runs of 4 processes each: the slow lane
@pytest.mark.distributed
def test_torchtitans_trainer_with_data_parallelism_trains_with_graphpipe(
    titan: tuple[Path, Path],
) -> None:
    """pp 2 x dp 2 on 4 processes, FSDP2 (eager) and HSDP (captured): torchtitan's
    parallelize_fn shards each stage over its dp pair, graphpipe's dp_group is the batch
    mesh; against torch's stock Interleaved1F1B with FSDP2 on the same four stages and
    micro-batches."""
    tmp, seed = titan
    shard = ("--parallelism.data_parallel_shard_degree", "2", *_BACKEND)
    replicate = ("--parallelism.data_parallel_replicate_degree", "2", *_BACKEND)
    run = functools.partial(_train, tmp, seed, nproc=4, steps=2)
    reference, _ = run("stock_debugmodel", "Interleaved1F1B", *shard)
    eager, log = run("graphpipe_debugmodel", "DualPipeV", *shard)
    assert "Applied FSDP to the model" in log, log[-4000:]
    # Captured with HSDP: one run for both (HSDP's values are FSDP2's here, and a captured
    # run's first step is the eager step that records the plan).
    captured, log = run("graphpipe_debugmodel_captured", "DualPipeV", *replicate)
    assert "Applied HSDP to the model" in log, log[-4000:]
    # (torchtitan without a pipeline, FSDP2 on 2 processes, differs from all of these by up
    # to 1.5e-5: one bf16 forward of 4 sequences rounds otherwise than 4 of one sequence.)
    assert _close(eager, reference, 1e-5), (reference, eager)
    assert _close(captured, reference, 1e-5), (reference, captured)


@pytest.mark.slow  # several torchtitan runs of 4 processes each: the slow lane
@pytest.mark.distributed
def test_torchtitans_trainer_with_tensor_parallelism_trains_with_graphpipe(
    titan: tuple[Path, Path],
) -> None:
    """pp 2 x tp 2 on 4 processes, sequence parallel (the hidden states cross the pipeline's
    edges as DTensor shards), against torch's stock Interleaved1F1B on the same stages."""
    tmp, seed = titan
    tp = ("--parallelism.tensor_parallel_degree", "2", *_BACKEND)
    run = functools.partial(_train, tmp, seed, nproc=4, steps=2)
    reference, _ = run("stock_debugmodel", "Interleaved1F1B", *tp)
    # Captured only: its first step is the eager step that records the plan.
    captured, _ = run("graphpipe_debugmodel_captured", "DualPipeV", *tp)
    assert _close(captured, reference, 1e-5), (reference, captured)


@pytest.mark.slow  # several torchtitan runs of 4 processes each: the slow lane
@pytest.mark.distributed
def test_torchtitans_trainer_with_expert_parallelism_trains_with_graphpipe(
    titan: tuple[Path, Path],
) -> None:
    """DeepSeek-V3's debugmodel (MoE, auxiliary-loss-free load balancing) on pp 2 x FSDP2 2,
    the experts over the same 2 ranks (ep 2), against torch's stock Interleaved1F1B. torch's
    stages run one forward more at the first step (their metadata inference), which counts in
    the MoE layers' tokens_per_expert_E; launch.py puts those buffers back, else torch's
    first expert-bias update, and every step after it, would differ."""
    tmp, _ = titan
    seed = _seed_checkpoint(tmp, "stock_deepseek_v3")
    ep = (
        "--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree",
        "2", *_BACKEND,
    )  # fmt: skip
    run = functools.partial(_train, tmp, seed, nproc=4, steps=3)
    reference, _ = run("stock_deepseek_v3", "Interleaved1F1B", *ep)
    eager, _ = run("graphpipe_deepseek_v3", "DualPipeV", *ep)
    assert _close(eager, reference, 1e-5), (reference, eager)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchtitans_expert_parallel_dispatch_is_refused_under_capture_naming_its_host_read(
    titan: tuple[Path, Path],
) -> None:
    """torchtitan's token dispatcher reads the all-to-all's split sizes on the host
    (``input_splits.tolist()``): a CUDA graph cannot hold that, so the capture (the CPU graph
    here) refuses the step, naming the line, instead of replaying stale split sizes."""
    tmp, _ = titan
    seed = _seed_checkpoint(tmp, "stock_deepseek_v3")
    ep = (
        "--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree",
        "2", *_BACKEND,
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "DualPipeV",
        "--parallelism.pipeline_parallel_microbatch_size", "1",
        "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
        "--checkpoint.load_only", "--training.steps", "2", "--dump_folder", str(tmp / "ep-capture"),
    )  # fmt: skip
    log = _torchrun(tmp, 4, "graphpipe_deepseek_v3_captured", *ep, fails=True)
    assert "CaptureError: the step cannot be captured" in log, log[-4000:]
    assert "token_dispatcher.py" in log and ".tolist()" in log, log[-4000:]
