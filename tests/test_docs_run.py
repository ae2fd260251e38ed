"""Every command and code block of README.md, docs/*.md and profiles/README.md runs as written
in a fresh copy of the repository, or says here why it does not run on CPU.

The blocks: every fenced block (any language) and indented block, and the commands in the
last column of profiles/README.md's table. Each has an entry in ``VERDICTS``, keyed by its page
and its first line that is not blank or an import (``#2``, ``#3`` for a repeat on one page;
the pages of ``PAGE_VERDICTS`` have one verdict for all their blocks):
``Run`` runs it, ``Skip`` says why not (a fragment of a larger program, printed output, a
GPU, an install, the suite itself, a page another change owns). ``test_every_block_has_a_
verdict`` fails for a block without one, or a verdict without its block: a new block in the
docs needs a line here.

How a block runs: in a copy of the repository's files as a fresh clone has them (with the
changes not committed yet; one copy per page, its blocks in page order), with the venv's
``bin`` first on ``PATH`` and without the test suite's ``TRITON_INTERPRET``. A shell block
runs as one ``bash -e`` script; in a block with ``$`` prompts only the prompted lines run, and
the lines the page shows after them are compared with what they print. Paths under ``/tmp/``
become paths under a private temporary folder (the same names), so that the runs neither
meet nor remove anyone's files. A python block runs as a file (``python FILE``, or the
command the page gives for it). Most of them are slow (``-m slow``); the quick ones run in the
default suite.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
    "profiles/README.md",
]
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # where the code starts in the page
    lang: str  # the fence's language; "indented"; "table" (a profiles/README.md command)
    code: str
    key: str = ""


def _first_line(code: str) -> str:
    for line in code.splitlines():
        s = line.strip()
        if s and not s.startswith(("import ", "from ")):
            return s
    return next((x.strip() for x in code.splitlines() if x.strip()), "")


def _raw_blocks(text: str) -> Iterator[tuple[int, str, str]]:
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"\s*(```+|~~~+)\s*([\w-]*)", line)
        if fence:
            indent = len(line) - len(line.lstrip())
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(fence[1]):
                end += 1
            body = [x[indent:] if x[:indent].isspace() else x for x in lines[i + 1 : end]]
            yield i + 2, fence[2].lower(), "\n".join(body)
            i = end + 1
            continue
        if line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            yield i + 1, "indented", "\n".join(x[4:] for x in lines[i:end]).strip("\n")
            i = end
            continue
        i += 1


_COMMAND = re.compile(r"^(python |bash |nice |graphpipe |profiles/|GPU_CHECK_ONLY=|torchrun )")


def _table_commands(text: str) -> Iterator[tuple[int, str, str]]:
    """The commands in the last column of the page's table rows (profiles/README.md)."""
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("| `"):
            continue
        last = line.replace("\\|", "\0").rstrip().rstrip("|").rsplit("|", 1)[-1]
        for span in re.findall(r"`([^`]+)`", last.replace("\0", "|")):
            if _COMMAND.match(span):
                yield n, "table", span


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        items = list(_raw_blocks(text))
        if page == "profiles/README.md":
            items += list(_table_commands(text))
        seen: dict[str, int] = {}
        for line, lang, code in items:
            first = _first_line(code)
            seen[first] = seen.get(first, 0) + 1
            key = f"{page}: {first}" + (f" #{seen[first]}" if seen[first] > 1 else "")
            found.append(Block(page, line, lang, code, key))
    return found


# ------------------------------------------------------------------ verdicts


@dataclass(frozen=True)
class Skip:
    why: str


FRAGMENT = Skip("a fragment: it uses names the page defines around it (stages, a mesh, ...)")
OUTPUT = Skip("output or a message the page quotes, not a command")
GPU = Skip("needs CUDA")
SUITE = Skip("the test suite itself (or an install and the suite)")
INSTALL = Skip(
    "an install: a package index and minutes; `python profiles/docs_figures.py --long --only "
    "install` runs it in a fresh copy"
)


@dataclass(frozen=True)
class Run:
    """Run the block. ``only``: the indexes of the logical command lines to run (default all;
    the others are named in ``why_not``). ``file``/``command``: a python block is saved as
    ``file`` and run by ``command`` (default ``python FILE``). ``needs``: blocks of the same
    page to run first (once). ``setup``: called with the copy first. ``check``: called with the
    copy, the block and the output. ``status``: the exit status expected."""

    slow: bool = True
    timeout: float = 900
    only: tuple[int, ...] | None = None
    why_not: str = ""
    file: str | None = None
    command: str | None = None
    needs: tuple[str, ...] = ()
    setup: Callable[[Path], None] | None = None
    check: Callable[[Path, Block, str], None] | None = None
    status: int = 0
    when: Callable[[], str | None] = field(default=lambda: None)  # a reason to skip now


def _readme() -> str:
    """README.md with its whitespace runs one space (sentences wrap across lines)."""
    return " ".join((ROOT / "README.md").read_text().split())


def _readme_losses(copy: Path, block: Block, out: str) -> None:
    """The README's words on the example's losses are what it prints."""
    said = re.search(
        r"prints the loss falling from ([\d.]+) at step 10 to ([\d.]+) at step 50", _readme()
    )
    assert said is not None, "README.md no longer says what the example prints"
    printed = {int(s): float(v) for s, v in re.findall(r"step (\d+): loss ([\d.]+)", out)}
    assert f"{printed[10]:.2f}" == said[1] and f"{printed[50]:.2f}" == said[2], printed


def _readme_train(copy: Path, block: Block, out: str) -> None:
    said = re.search(r"the loss falls from ([\d.]+) to about ([\d.]+) nats", _readme())
    assert said is not None, "README.md no longer says where graphpipe train's loss goes"
    found = re.search(r"loss ([\d.]+) -> ([\d.]+)", out)
    assert found is not None, out[-2000:]
    assert f"{float(found[1]):.2f}" == said[1], (found[0], said[0])
    assert f"{float(found[2]):.{len(said[2].split('.')[1])}f}" == said[2], (found[0], said[0])


def _profile_report(copy: Path, block: Block, out: str) -> None:
    """docs/profiling.md: report.json's per_rank holds one entry per rank, each field a mean
    (a number), not a list of steps."""
    page = (ROOT / "docs" / "profiling.md").read_text()
    fields = re.findall(r"^\| `(\w+)` \|", page.split("### `report.json`, field by field")[1], re.M)
    assert "busy_s" in fields, fields
    report = json.loads((_private_tmp(copy) / "gp-default" / "report.json").read_text())
    assert len(report["per_rank"]) == report["ranks"]
    for rank in report["per_rank"]:
        for name in fields:
            assert name in rank, (name, sorted(rank))
            assert not isinstance(rank[name], list), (name, rank[name])


def _bring_your_model_examples(copy: Path) -> None:
    """What the export commands read: the checkpoint and config of the page's example."""
    from tests.test_bring_your_model import SECTIONS

    cwd = Path.cwd()
    os.chdir(copy)
    try:
        namespace: dict = {"__name__": "__example__"}
        for code in SECTIONS["Hugging Face causal LMs"]:
            exec(compile(code, "bring-your-model.md", "exec"), namespace)
    finally:
        os.chdir(cwd)


def _schedule_tail(copy: Path, block: Block, out: str) -> None:
    """The lines the page shows after ``...`` are the command's last lines."""
    shown = block.code.split("...\n", 1)[1].strip().splitlines()
    printed = out.strip().splitlines()
    assert printed[-len(shown) :] == shown, "\n".join(printed[-len(shown) :])


def _memory_refusal(copy: Path, block: Block, out: str) -> None:
    """The refusal as the page shows it, but for the memory available here."""
    shown = block.code.strip().splitlines()[1]
    pattern = re.escape(shown).replace(re.escape("21.16 GiB"), r"[\d.]+ [KMGT]iB")
    assert re.search(pattern, out), (shown, out)


def _same_as_test_module(copy: Path, block: Block, out: str) -> None:
    """docs/torchtitan.md's config module is the one the tests and the CPU recipe run."""
    module = (ROOT / "tests" / "torchtitan_trainer" / "graphpipe_titan.py").read_text()
    body = block.code.split("\n", 1)[1].strip()  # after "# graphpipe_titan.py (...)"
    for part in re.split(r"\n\n+", body):
        assert part.strip() in module, part


def _shown_after(block: Block) -> str:
    """The page's next block: what it shows ``block`` printing."""
    later = [b for b in BLOCKS if b.page == block.page and b.line > block.line]
    return min(later, key=lambda b: b.line).code


def _prints_what_follows(copy: Path, block: Block, out: str) -> None:
    """What the block prints begins with the lines the page shows after it."""
    shown = _shown_after(block).strip().splitlines()
    assert out.strip().splitlines()[: len(shown)] == shown, out


def _have(program: str) -> Callable[[], str | None]:
    return lambda: None if shutil.which(program) else f"{program} is not installed"


_TITAN = "torchtitan (the torchtitan extra) is not installed"


def _have_torchtitan() -> str | None:
    try:
        import tokenizers  # noqa: F401
        import torchtitan  # noqa: F401
    except ImportError:
        return _TITAN
    return None


def _have_transformers() -> str | None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed"
    return None


VERDICTS: dict[str, Skip | Run] = {
    # README.md
    "README.md: python3 -m venv .venv && . .venv/bin/activate": INSTALL,
    "README.md: graphpipe train": Run(check=_readme_train),
    "README.md: python -m pytest -q": SUITE,
    "README.md: # train_mlp.py: torchrun --nproc-per-node 2 train_mlp.py": Run(
        slow=False,
        file="train_mlp.py",
        command="torchrun --nproc-per-node 2 train_mlp.py",
        check=_readme_losses,
    ),
    # docs/benchmarks.md
    "docs/benchmarks.md: graphpipe bench --regime overhead --steps 60 --warmup 5 --json ov.json": (
        Run(timeout=3600)
    ),
    "docs/benchmarks.md: python -m pytest tests/benchmarks/bench_pipeline.py -p no:cacheprovider "
    "--benchmark-only \\": Run(),
    "docs/benchmarks.md: python -m pytest tests/benchmarks/bench_pipeline.py -p no:cacheprovider "
    "--benchmark-only \\ #2": Run(),
    "docs/benchmarks.md: python profiles/plan_check.py --model hf --rounds 7 --reps 9": Run(
        timeout=1800, when=_have_transformers
    ),
    "docs/benchmarks.md: graphpipe bench --regime moe --steps 20 --warmup 3 --json moe.json"
    "             # ep=2, 2 ranks": Run(),
    # docs/capture.md
    "docs/capture.md: pipe = graphpipe.DualPipeV(stages, num_microbatches=8, loss_fn=loss_fn, "
    "capture=True)": FRAGMENT,
    "docs/capture.md: CaptureError: the step cannot be captured: 1 place(s) need the host "
    "inside it": OUTPUT,
    # docs/planning.md
    "docs/planning.md: layer = LayerCost(forward=1.0, backward_input=1.0, backward_weight=1.0)  "
    "# seconds per micro-batch": Run(slow=False, file="plan.py", check=_prints_what_follows),
    "docs/planning.md: dualpipev: 2 ranks, 4 stages, 8 micro-batches": OUTPUT,
    'docs/planning.md: python -c "': Run(),
    "docs/planning.md: plan = plan_hf_split(": FRAGMENT,
    "docs/planning.md: graphpipe plan --hf path/to/model                  # a directory with "
    "config.json, or the file": Skip(
        "the paths of a user's model; tests/test_plan_cli.py runs these options on a config"
    ),
    "docs/planning.md: chosen: zbv with 16 micro-batches, of the 2 within the 5% tie margin of "
    "the fastest, the least memory on the even split": OUTPUT,
    "docs/planning.md: the built-in model (hidden 64, 4 heads): 8 layers; micro-batch 2 x 64 "
    "tokens, float32; costs measured here (cpu), 5 rounds per piece": OUTPUT,
    "docs/planning.md: LlamaForCausalLM from DIR (sdpa attention): 12 layers; micro-batch 2 x 64 "
    "tokens, float32; costs measured here (cpu), 5 rounds per piece": OUTPUT,
    "docs/planning.md: no split fits memory_budget=2500 bytes: the closest (1f1b, 4 "
    "micro-batches, layers per stage [3, 3]) needs 3060 bytes on rank 0, 560 bytes (0.0 MiB) "
    "more than the budget": OUTPUT,
    # docs/bring-your-model.md
    "docs/bring-your-model.md: config = transformers.LlamaConfig(": Skip(
        "an example: tests/test_bring_your_model.py runs it"
    ),
    "docs/bring-your-model.md: rank, n = dist.get_rank(), dist.get_world_size()": FRAGMENT,
    'docs/bring-your-model.md: mesh = init_device_mesh("cpu", (D, N), '
    'mesh_dim_names=("dp", "pp"))': FRAGMENT,
    'docs/bring-your-model.md: path = save_checkpoint("ckpt", 1, dict(enumerate(stages)), opt)'
    "  # {stage index: stage}": Skip("an example: tests/test_bring_your_model.py runs it"),
    "docs/bring-your-model.md: graphpipe export ckpt llama-cli --hf-config base": Run(
        setup=_bring_your_model_examples, when=_have_transformers
    ),
    "docs/bring-your-model.md: VOCAB, DIM, SEQ = 32, 16, 8": Skip(
        "an example: tests/test_bring_your_model.py runs it"
    ),
    'docs/bring-your-model.md: mesh = init_device_mesh("cuda", (D, N), '
    'mesh_dim_names=("dp", "pp"))': FRAGMENT,
    "docs/bring-your-model.md: UserWarning: graphpipe: Block.proj (mylib.ScaledLinear) is not "
    "deferred: its class": OUTPUT,
    "docs/bring-your-model.md: class Linear(nn.Linear):  # like torchtitan's: a subclass that "
    "keeps nn.Linear.forward": Run(file="deferral.py", timeout=1200),
    # docs/checkpoints.md
    "docs/checkpoints.md: mine = {rank: stages[rank], 2 * n - 1 - rank: stages[2 * n - 1 - rank]}"
    "  # DualPipeV": FRAGMENT,
    "docs/checkpoints.md: CheckpointError: checkpoint ckpt/step-00000004: file __1_0.distcp is "
    "corrupt (CRC-32 5d3e0b7c, 0a4f2e91 when saved)": OUTPUT,
    "docs/checkpoints.md: graphpipe train: saved DIR/step-00000004, replacing the one --resume "
    "skipped: file __1_0.distcp is not listed in graphpipe.json (...)": OUTPUT,
    "docs/checkpoints.md: torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m "
    "graphpipe train \\": Run(),
    'docs/checkpoints.md: state = export_state_dict("ckpt/step-00000100")  # one process, no '
    "process group": Run(
        file="export_state.py",
        needs=(
            "docs/checkpoints.md: torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m "
            "graphpipe train \\",
        ),
    ),
    "docs/checkpoints.md: graphpipe export ckpt model.pt                    # ckpt's newest "
    "checkpoint that verifies": Run(
        needs=(
            "docs/checkpoints.md: torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m "
            "graphpipe train \\",
        ),
    ),
    "docs/checkpoints.md: graphpipe export ckpt trained --hf-config base-model       # "
    "base-model/config.json": Skip(
        "needs a checkpoint of a Hugging Face model's stages and its config: "
        "docs/bring-your-model.md's export block runs the same command on one"
    ),
    "docs/checkpoints.md: # A stage holding decoder layers 4 and 5 as self.layers[0], "
    "self.layers[1]:": FRAGMENT,
    # docs/cli.md
    "docs/cli.md: graphpipe schedule --ranks 4 --microbatches 10 --out /tmp/dualpipev.svg": Run(
        timeout=1800
    ),
    "docs/cli.md: graphpipe train: error: --layers 4 is too few for --ranks 4: every middle "
    "stage of the 8 stages needs a layer, so --layers must be >= 6": OUTPUT,
    "docs/cli.md: graphpipe bench: error: --json /nonexistent/dir/b.json: directory "
    "/nonexistent/dir does not exist (create it first)": OUTPUT,
    "docs/cli.md: graphpipe train: the loss of step 2 is nan; stopping (--allow-nonfinite trains "
    "on)": OUTPUT,
    # docs/composition.md
    'docs/composition.md: mesh = init_device_mesh("cuda", (D, N), mesh_dim_names=("dp", "pp"))'
    '  # or "cpu" (gloo)': FRAGMENT,
    "docs/composition.md: cfg = LlamaConfig(num_experts=8, top_k=2, capacity_factor=1.25)  # "
    "every block an MoE block": FRAGMENT,
    "docs/composition.md: loss = pipe.step(x, y)": FRAGMENT,
    "docs/composition.md: opt.zero_grad()": FRAGMENT,
    "docs/composition.md: class Block(nn.Module):": FRAGMENT,
    'docs/composition.md: mesh = init_device_mesh("cuda", (dp, n), '
    'mesh_dim_names=("dp", "pp"))': FRAGMENT,
    'docs/composition.md: mesh = init_device_mesh("cuda", (n, tp), '
    'mesh_dim_names=("pp", "tp"))': FRAGMENT,
    "docs/composition.md: # on machine 0 (NODE=0) and machine 1 (NODE=1); HOST is machine 0's "
    "address": Skip("two machines with 8 GPUs each"),
    # docs/development.md
    "docs/development.md: python3 -m venv .venv && . .venv/bin/activate": SUITE,
    "docs/development.md: python -m pytest -q tests/test_torchtitan.py "
    "tests/test_torchtitan_trainer.py \\": Run(timeout=2400, when=_have_torchtitan),
    "docs/development.md: python -m pytest tests/gpu                # CUDA-graph capture, NCCL, "
    "kernels in graphs": GPU,
    "docs/development.md: graphpipe/__init__.py        the public names (imported on first "
    "use: _lazy.py)": Skip("the source layout, not a command"),
    "docs/development.md: GRAPHPIPE_DIFFERENTIAL_EXAMPLES=1000 GRAPHPIPE_DIFFERENTIAL_RANDOM=1 "
    'python -m pytest -q tests/test_differential.py -m "slow or not slow" '
    "--hypothesis-show-statistics": Run(timeout=3600),
    # docs/gpu-check.md
    "docs/gpu-check.md: bash profiles/gpu_check.sh                      # writes "
    "$OUT/gpu_check.json and .log": GPU,
    "docs/gpu-check.md: nice bash profiles/gpu_image_suite.sh [PYTEST ARGS...]": Skip(
        "a second venv (Python 3.12, a package index) and the whole suite in it"
    ),
    # docs/guide.md
    'docs/guide.md: dist.init_process_group("gloo")': FRAGMENT,
    'docs/guide.md: dist.init_process_group("gloo") #2': FRAGMENT,
    'docs/guide.md: graphpipe.mark_tied(first_stage.embed.weight, "embedding")  # on rank 0': (
        FRAGMENT
    ),
    "docs/guide.md: loss = pipe.step(x, y, scaler=scaler)  # the backward seed is scaled": (
        FRAGMENT
    ),
    "docs/guide.md: bad_step = torch.zeros((), dtype=torch.long, device=device)  # 0: every loss "
    "so far finite": FRAGMENT,
    # docs/kernels.md
    "docs/kernels.md: python tests/benchmarks/bench_kernels.py [--no-compile] [--json FILE]   # "
    "GB/s per op and shape": GPU,
    # docs/model.md
    "docs/model.md: cfg = LlamaConfig(hidden=64, n_layers=4, n_heads=4)  # the defaults: about "
    "0.2M parameters": FRAGMENT,
    "docs/model.md: graphpipe train                                   # 2 CPU ranks, 100 steps, "
    "the defaults": Run(timeout=1800),
    # docs/profiling.md
    "docs/profiling.md: graphpipe profile --steps 3 --out /tmp/prof                             "
    "      # 2 CPU ranks": Run(
        only=(0,), why_not="the second needs CUDA, the third an nsys export of a CUDA run"
    ),
    "docs/profiling.md: $ graphpipe profile --steps 3 --out /tmp/gp-default": Run(
        check=_profile_report
    ),
    "docs/profiling.md: python profiles/run_steps.py --mode eager --regime overhead --steps 20 "
    "--torch-profile /tmp/prof": Run(),
    "docs/profiling.md: py-spy record --subprocesses --rate 1000 -o /tmp/eager.svg -- \\": Run(
        when=_have("py-spy")
    ),
    "docs/profiling.md: profiles/nsys.sh /tmp/gp -- --device cuda --ranks 1 --steps 10 "
    "--capture action": GPU,
    # docs/runtime.md
    'docs/runtime.md: ranges.push("step")': Skip("pseudo-code of the runtime's step loop"),
    # docs/schedules.md
    "docs/schedules.md: graphpipe schedule --ranks N --microbatches M [--schedule "
    "dualpipev|1f1b|zbv]": Skip("a synopsis"),
    "docs/schedules.md: $ graphpipe schedule --ranks 2 --microbatches 4 --costs FB=2.5": Run(
        slow=False, check=_schedule_tail
    ),
    "docs/schedules.md: $ graphpipe schedule --ranks 2 --microbatches 1000000000": Run(
        slow=False, status=2, check=_memory_refusal
    ),
    'docs/schedules.md: kind = SCHEDULES["dualpipev"]': Run(file="figures.py"),
    # docs/torch-pipelining.md
    "docs/torch-pipelining.md: # from torch.distributed.pipelining import ScheduleDualPipeV": (
        FRAGMENT
    ),
    # docs/torchtitan.md
    "docs/torchtitan.md: pip install torch==2.13.0 -e '.[torchtitan]'   # torchtitan 0.3.x, "
    "with torch pinned": INSTALL,
    "docs/torchtitan.md: # graphpipe_titan.py (on PYTHONPATH)": Run(
        slow=False, command="true", file="graphpipe_titan.py", check=_same_as_test_module
    ),
    "docs/torchtitan.md: torchrun --nproc_per_node 2 -m torchtitan.train --module "
    "graphpipe_titan \\": Skip(
        "torchtitan's own entry point stops on a CPU-only machine (it calls torch.cuda): the "
        "CPU recipe below runs the same Trainer"
    ),
    "docs/torchtitan.md: python profiles/torchtitan_cpu.py                  # 2 gloo "
    "processes, DualPipeV, 5 steps": Run(when=_have_torchtitan),
    # profiles/README.md: the indented block and the table's commands
    "profiles/README.md: py-spy record --subprocesses --rate 1000 -o /tmp/eager.svg -- \\": Run(
        when=_have("py-spy")
    ),
    "profiles/README.md: bash profiles/gpu_check.sh [OUTDIR]": GPU,
    "profiles/README.md: GPU_CHECK_ONLY=replay_sweep,kernel_bandwidth bash profiles/gpu_check.sh "
    "/tmp/gc": GPU,
    "profiles/README.md: nice bash profiles/gpu_image_suite.sh": Skip(
        "a second venv (Python 3.12, a package index) and the whole suite in it"
    ),
    "profiles/README.md: python profiles/gpu_replay_bench.py [--steps 20] [--points "
    "256x1,1024x1,1024x4,1024x16] [--json FILE]": GPU,
    "profiles/README.md: profiles/nsys.sh /tmp/gp -- --device cuda --ranks 1 --steps 10 "
    "--capture action": GPU,
    "profiles/README.md: python profiles/run_steps.py --mode eager --regime overhead --steps 20 "
    "--torch-profile /tmp/prof": Run(),
    "profiles/README.md: python profiles/soak.py --steps 1000 --mallinfo": Run(timeout=1800),
    "profiles/README.md: python profiles/exit_soak.py --runs 100 [--parallel 2] [--destroy]": Skip(
        "a synopsis of 100 runs of fresh ranks (minutes): `python profiles/docs_figures.py "
        "--long --only exit_soak` reruns docs/failures.md's runs"
    ),
    "profiles/README.md: python profiles/status_cost.py --steps 200": Run(),
    "profiles/README.md: python profiles/no_sync_cost.py --dim 512 --calls 4 --rounds 5": Run(),
    "profiles/README.md: python profiles/gloo_exchange.py [--reps 400] [--ops 1,2,4]": Run(
        command="python profiles/gloo_exchange.py"
    ),
    "profiles/README.md: python profiles/plan_check.py [--model builtin|hf] [--rounds 5] "
    "[--reps 5] [--json FILE]": Run(command="python profiles/plan_check.py", timeout=1800),
    "profiles/README.md: graphpipe bench --regime all --steps 10 --warmup 2 --plot "
    "profiles/bench_timeline.svg": Run(timeout=1800),
    "profiles/README.md: graphpipe profile --steps 3 --out /tmp/gp-default": Run(),
    "profiles/README.md: python profiles/torchtitan_cpu.py [--steps 5] [--capture step] [--out "
    "DIR]": Run(command="python profiles/torchtitan_cpu.py", when=_have_torchtitan),
    "profiles/README.md: python profiles/docs_figures.py [--only NAMES] [--long] [--repeats 3]": (
        Run(command="python profiles/docs_figures.py --only schedule_start_cpu --repeats 1")
    ),
}


def verdict(block: Block) -> Skip | Run | None:
    return VERDICTS.get(block.key)


BLOCKS = blocks()


def test_every_block_has_a_verdict() -> None:
    keys = {b.key for b in BLOCKS}
    missing = [f"{b.page}:{b.line}: {b.key!r}" for b in BLOCKS if verdict(b) is None]
    stale = sorted(set(VERDICTS) - keys)
    assert not missing, "blocks without a verdict in tests/test_docs_run.py:\n" + "\n".join(missing)
    assert not stale, f"verdicts whose block is gone: {stale}"


def test_the_extractor_finds_fences_indented_blocks_and_table_commands() -> None:
    text = "\n".join(
        [
            "Prose.",
            "",
            "```bash",
            "graphpipe train",
            "```",
            "",
            "Code:",
            "",
            "    python profiles/x.py",
            "",
            "| `x.py` | what | needs | `python profiles/x.py [--y a\\|b]` |",
        ]
    )
    assert list(_raw_blocks(text)) == [
        (4, "bash", "graphpipe train"),
        (9, "indented", "python profiles/x.py"),
    ]
    assert list(_table_commands(text)) == [(11, "table", "python profiles/x.py [--y a|b]")]


# ------------------------------------------------------------------ running


_COPIES: dict[str, Path] = {}
_RAN: set[str] = set()


def _copy_of(page: str, factory: pytest.TempPathFactory) -> Path:
    """The page's fresh copy of the repository (made once per page)."""
    if page not in _COPIES:
        dest = factory.mktemp(re.sub(r"\W", "_", page))
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.split(b"\0")
        for raw in filter(None, listed):
            src = ROOT / raw.decode()
            if src.is_file():
                (dest / raw.decode()).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / raw.decode())
        (dest / ".tmp").mkdir()
        _COPIES[page] = dest
    return _COPIES[page]


def _private_tmp(copy: Path) -> Path:
    return copy / ".tmp"


def _private(text: str, copy: Path) -> str:
    """``/tmp/...`` paths as paths under the copy's private temporary folder."""
    return re.sub(r"(?<![\w./])/tmp/", f"{_private_tmp(copy)}/", text)


def _logical_lines(code: str) -> list[str]:
    """The block's commands: ``\\`` continuations joined, blank and comment lines dropped."""
    out, parts = [], []
    for line in code.splitlines():
        if not parts and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        out.append(" ".join(p.strip() for p in parts))
        parts = []
    return out


def _script(block: Block, run: Run) -> str:
    """The bash script a block runs as."""
    if run.command is not None:
        return run.command
    if block.lang == "python" or run.file is not None:
        return f"python {run.file}"
    lines = block.code.splitlines()
    if any(x.lstrip().startswith("$ ") for x in lines):
        return "\n".join(x.lstrip()[2:] for x in lines if x.lstrip().startswith("$ "))
    commands = _logical_lines(block.code)
    if run.only is not None:
        commands = [commands[i] for i in run.only]
    return "\n".join(commands)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(block: Block, factory: pytest.TempPathFactory) -> None:
    run = verdict(block)
    assert isinstance(run, Run)
    if (why := run.when()) is not None:
        pytest.skip(why)
    copy = _copy_of(block.page, factory)
    for key in run.needs:
        if key not in _RAN:
            _run(next(b for b in BLOCKS if b.key == key), factory)
    if run.setup is not None:
        run.setup(copy)
    if run.file is not None:
        (copy / run.file).write_text(_private(block.code, copy))
    script = _private(_script(block, run), copy)
    done = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=copy,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=run.timeout,
    )
    out = done.stdout + done.stderr
    where = f"{block.page}:{block.line}"
    assert done.returncode == run.status, (
        f"{where}: exit status {done.returncode}:\n{script}\n{out[-6000:]}"
    )
    if run.check is not None:
        run.check(copy, block, _private(out, copy).replace(f"{_private_tmp(copy)}/", "/tmp/"))
    _RAN.add(block.key)


def _params(slow: bool) -> list:
    return [
        pytest.param(b, id=f"{b.page}:{b.line}")
        for b in BLOCKS
        if isinstance(verdict(b), Run) and verdict(b).slow == slow
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("block", _params(slow=False))
def test_a_quick_block_runs_as_written(block: Block, tmp_path_factory) -> None:
    _run(block, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("block", _params(slow=True))
def test_a_block_runs_as_written(block: Block, tmp_path_factory) -> None:
    _run(block, tmp_path_factory)


def test_a_script_beside_a_clone_named_graphpipe_fails_as_the_readme_says(tmp_path) -> None:
    """README.md: a script saved next to the clone's folder imports that folder, not the
    installed package; the README quotes the error and says what to do."""
    (tmp_path / "graphpipe").symlink_to(ROOT, target_is_directory=True)
    (tmp_path / "script.py").write_text("import graphpipe\n\ngraphpipe.DualPipeV\n")
    done = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, env=_env()
    )
    error = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and error == (
        "AttributeError: module 'graphpipe' has no attribute 'DualPipeV'"
    ), done.stderr
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"`{error}`" in readme, "README.md does not quote the error a script beside it gets"
