"""torchtitan's Trainer on graphpipe's DualPipeV, on CPU: one command that writes what the run
needs and trains a few steps.

    python profiles/torchtitan_cpu.py                       # 2 gloo processes, 5 steps
    python profiles/torchtitan_cpu.py --steps 10 --capture step --out /tmp/titan
    python profiles/torchtitan_cpu.py --nproc 4 -- --parallelism.pipeline_parallel_degree 2 \
        --parallelism.data_parallel_shard_degree 2 --parallelism.spmd_backend partial_dtensor

``torchrun -m torchtitan.train`` does not start on a CPU-only machine (torchtitan 0.3 calls
``torch.cuda`` APIs there), and torchtitan's debug dataset and tokenizer come from its own
repository, not its wheel. This script writes a word-level tokenizer and a small ``c4_test``
dataset into ``--out`` (the folder the run starts in), then runs torchtitan's unmodified
``Trainer`` with ``torchrun`` through ``tests/torchtitan_trainer/launch.py`` (torchtitan's
``main`` with the CPU shims docs/torchtitan.md lists) and the config module
``tests/torchtitan_trainer/graphpipe_titan.py`` (llama3's debugmodel with graphpipe's
``pipelining_fn``): pipeline parallelism over ``--nproc`` processes, two stages each,
micro-batches of one 128-token sequence; arguments after ``--`` are added to torchtitan's
command line (a later flag wins). It prints each step's loss and gradient norm as the
Trainer logs them; ``OUT/log.txt`` holds the whole log. Needs the ``torchtitan`` extra
(``pip install -e '.[torchtitan]'``, which brings ``tokenizers``) and a clone of the
repository (the launcher and the config module live in ``tests/``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TITAN = ROOT / "tests" / "torchtitan_trainer"
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+(-?[\d.]+)\s+grad_norm:\s+([\d.]+)")
CONFIGS = {"none": "graphpipe_debugmodel", "step": "graphpipe_debugmodel_captured"}


def write_assets(out: Path, texts: int = 400, words_per_text: int = 300) -> None:
    """A word-level tokenizer of 1,503 ids (the debugmodel's vocabulary is 2,048) in
    ``out/tok`` and ``texts`` texts of random words in ``out/tests/assets/c4_test/data.json``,
    where torchtitan's ``c4_test`` loader reads them (relative to the folder the run starts
    in)."""
    import tokenizers

    rng = random.Random(0)
    words = [f"w{i}" for i in range(1500)]
    data = out / "tests" / "assets" / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "data.json", "w") as f:
        for _ in range(texts):
            text = " ".join(rng.choice(words) for _ in range(words_per_text))
            f.write(json.dumps({"text": text}) + "\n")
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(
        [tokenizers.AddedToken("<bos>", special=True), tokenizers.AddedToken("<eos>", special=True)]
    )
    (out / "tok").mkdir(exist_ok=True)
    tok.save(str(out / "tok" / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}
    (out / "tok" / "tokenizer_config.json").write_text(json.dumps(config))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line of the run."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
        "--master_port", str(_free_port()), str(TITAN / "launch.py"),
        "--module", "graphpipe_titan", "--config", CONFIGS[args.capture],
        "--parallelism.pipeline_parallel_degree", str(args.nproc),
        "--parallelism.pipeline_parallel_schedule", args.schedule,
        "--parallelism.pipeline_parallel_microbatch_size", "1",
        "--training.local_batch_size", "4", "--training.seq_len", "128",
        "--training.steps", str(args.steps), "--training.disable-cuda-graphs",
        "--hf_assets_path", "./tok", "--dump_folder", "./outputs", "--debug.seed", "0",
        *args.titan_args, "activation-checkpoint:none",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/graphpipe-titan", help="the run's folder (created)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--nproc", type=int, default=2, help="pipeline ranks (default 2)")
    p.add_argument(
        "--schedule",
        default="DualPipeV",
        help="--parallelism.pipeline_parallel_schedule (default DualPipeV)",
    )
    p.add_argument("--capture", choices=sorted(CONFIGS), default="none", help="graphpipe's capture")
    p.add_argument("titan_args", nargs="*", metavar="-- TORCHTITAN_ARGS")
    args = p.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--nproc", args.nproc)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    try:
        import tokenizers  # noqa: F401
        import torchtitan  # noqa: F401
    except ImportError as e:
        p.error(f"{e.name} is not installed: pip install -e '.[torchtitan]'")
    if not (TITAN / "launch.py").is_file():
        p.error(f"{TITAN / 'launch.py'} is missing: run this from a clone of the repository")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_assets(out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TITAN), str(ROOT)])}
    print(f"torchtitan_cpu: training in {out} ({args.nproc} processes, {args.steps} steps)")
    run = subprocess.run(command(args), cwd=out, env=env, capture_output=True, text=True)
    log = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout + run.stderr)
    (out / "log.txt").write_text(log)
    if run.returncode != 0:
        print(log[-4000:], file=sys.stderr)
        print(f"torchtitan_cpu: the run failed (status {run.returncode}); log: {out / 'log.txt'}")
        return 1
    steps = {int(s): (v, n) for s, v, n in STEP.findall(log) if float(v) >= 0}
    for s in sorted(steps):
        print(f"step {s}: loss {steps[s][0]}, grad norm {steps[s][1]}")
    if sorted(steps) != list(range(1, args.steps + 1)):
        print(f"torchtitan_cpu: the log lacks some steps; log: {out / 'log.txt'}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
