"""The options several commands share (``graphpipe.cmdline.options``): each command's parser has
them with the same names, choices, defaults and help texts, and a bad value is the same
one-line error, exit status 2, from every command. In this process: nothing is spawned."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from graphpipe.cli import _build_parser, main
from graphpipe.cmdline import options as cli_options
from graphpipe.schedule.costs import Costs


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parser = _build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _option(command: str, flag: str) -> argparse.Action:
    actions = _parsers()[command]._actions
    return next(a for a in actions if flag in a.option_strings)


# The commands that take each shared option, and its (choices, default).
SHARED = {
    "--device": (("plan", "train", "bench", "profile"), ("cpu", "cuda"), "cpu"),
    "--dtype": (("plan", "train", "profile"), ("float32", "bfloat16"), "float32"),
    "--batch-size": (("plan", "train", "profile"), None, 16),
    "--seq-len": (("plan", "train", "profile"), None, 64),
    "--hidden": (("plan", "train", "profile"), None, 64),
    "--layers": (("plan", "train", "profile"), None, None),
    "--heads": (("plan", "train", "profile"), None, 4),
    "--no-kernels": (("plan", "train", "profile"), None, False),
}


@pytest.mark.parametrize("flag", SHARED)
def test_every_command_has_the_shared_option_with_its_default(flag: str) -> None:
    commands, choices, default = SHARED[flag]
    for command in commands:
        action = _option(command, flag)
        assert action.default == default, (command, flag)
        assert (tuple(action.choices) if action.choices else None) == choices, (command, flag)


@pytest.mark.parametrize("flag", ["--batch-size", "--seq-len", "--hidden", "--heads"])
def test_the_model_options_read_the_same_in_every_command(flag: str) -> None:
    helps = {command: _option(command, flag).help for command in ("plan", "train", "profile")}
    assert len(set(helps.values())) == 1, helps


def test_the_help_of_device_and_dtype_is_the_commands_meaning_and_the_default() -> None:
    for command in SHARED["--device"][0]:
        assert _option(command, "--device").help.endswith(" (default cpu)"), command
    assert _option("train", "--device").help.startswith(cli_options.RANK_DEVICES)
    assert _option("bench", "--device").help == (
        f"{cli_options.RANK_DEVICES} (without CUDA the benchmark is skipped with a note, "
        "status 0) (default cpu)"
    )
    assert _option("plan", "--device").help.startswith("where the pieces are measured: ")
    for command in SHARED["--dtype"][0]:
        assert _option(command, "--dtype").help.endswith(" (default float32)"), command
    assert _option("train", "--layers").help.endswith(", or the sum of --layers-per-stage)")


def _error(command: str, argv: list[str], tmp_path: Path, capsys) -> tuple[int, str]:
    """Exit status and stderr of ``graphpipe COMMAND ARGV`` that stops at its arguments."""
    if command == "profile":
        argv = [*argv, "--out", str(tmp_path / "prof")]
    try:
        code = main([command, *argv])
    except SystemExit as e:  # argparse's errors, and plan's parser.error
        code = e.code
    return code, capsys.readouterr().err


def _same_error_from(commands, argv, tmp_path, capsys) -> str:
    """The one message every command of ``commands`` gives for ``argv``, without its
    ``graphpipe COMMAND: error: `` prefix."""
    messages = {}
    for command in commands:
        code, err = _error(command, argv, tmp_path, capsys)
        prefix = f"graphpipe {command}: error: "
        assert code == 2, (command, err)
        assert err.count("\n") == 1 and err.startswith(prefix), (command, err)
        messages[command] = err.removeprefix(prefix).rstrip("\n")
    assert len(set(messages.values())) == 1, messages
    return next(iter(messages.values()))


@pytest.mark.parametrize(
    "argv,start",
    [
        # the choices are quoted by argparse before Python 3.12, bare after
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu' (choose from "),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16' (choose from "),
        (["--hidden", "x"], "argument --hidden: invalid int value: 'x'"),
    ],
)
def test_a_value_argparse_refuses_is_the_same_line_from_every_command(
    argv: list[str], start: str, tmp_path: Path, capsys
) -> None:
    commands = SHARED[argv[0]][0]  # bench's --hidden is its own: a regime's override, >= 1
    assert _same_error_from(commands, argv, tmp_path, capsys).startswith(start)


@pytest.mark.parametrize("flag", ["--batch-size", "--seq-len", "--hidden", "--layers", "--heads"])
def test_a_model_size_below_one_is_the_same_line_from_every_command(
    flag: str, tmp_path: Path, capsys
) -> None:
    got = _same_error_from(("plan", "train", "profile"), [flag, "0"], tmp_path, capsys)
    assert got == f"{flag} must be >= 1, got 0"
    assert not (tmp_path / "prof").exists()  # profile refused it before creating --out


def test_cuda_without_cuda_is_the_same_line_from_every_command(tmp_path: Path, capsys) -> None:
    problem = cli_options.cuda_problem("cuda")
    if problem is None:
        pytest.skip("CUDA is available here")
    got = _same_error_from(("plan", "train", "profile"), ["--device", "cuda"], tmp_path, capsys)
    assert got == problem and got.startswith("--device cuda: CUDA is not available to this torch")


def test_whole_number_types() -> None:
    assert cli_options.positive_int("3") == 3
    assert cli_options.non_negative_int("0") == 0
    for parse, text, message in [
        (cli_options.positive_int, "0", "must be >= 1, got 0"),
        (cli_options.positive_int, "two", "expected a whole number, got 'two'"),
        (cli_options.non_negative_int, "-1", "must be >= 0, got -1"),
        (cli_options.non_negative_int, "1.5", "expected a whole number, got '1.5'"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


def test_costs_arg() -> None:
    assert cli_options.costs_arg("F=2,B=3") == Costs.parse("F=2,B=3")
    with pytest.raises(argparse.ArgumentTypeError):
        cli_options.costs_arg("Q=1")


def test_schedule_and_bench_refuse_a_bad_whole_number_alike(tmp_path: Path, capsys) -> None:
    got = {}
    for command in ("schedule", "bench"):
        code, err = _error(command, ["--ranks", "two", "--microbatches", "4"], tmp_path, capsys)
        assert code == 2 and err.count("\n") == 1, err
        got[command] = err.removeprefix(f"graphpipe {command}: error: ")
    assert (
        got["schedule"] == got["bench"] == "argument --ranks: expected a whole number, got 'two'\n"
    )


def test_first_below_names_the_first_option_below_and_passes_none() -> None:
    args = argparse.Namespace(steps=3, warmup=-1, layers=None, keep_checkpoints=0)
    assert cli_options.first_below(args, 1, "steps", "layers") is None
    assert cli_options.first_below(args, 0, "warmup") == "--warmup must be >= 0, got -1"
    assert (
        cli_options.first_below(args, 1, "layers", "keep_checkpoints", "warmup")
        == "--keep-checkpoints must be >= 1, got 0"
    )


def test_cuda_problem_is_none_for_cpu() -> None:
    assert cli_options.cuda_problem("cpu") is None


def test_the_builders_on_a_parser_of_their_own() -> None:
    p = argparse.ArgumentParser()
    cli_options.add_device_option(p, meaning="M", note="N")
    cli_options.add_dtype_option(p, meaning="D")
    cli_options.add_batch_options(p)
    cli_options.add_builtin_model_options(p, layers_note=", or L")
    args = p.parse_args(["--device", "cuda", "--no-kernels"])
    assert vars(args) == {
        "device": "cuda",
        "dtype": "float32",
        "batch_size": 16,
        "seq_len": 64,
        "hidden": 64,
        "layers": None,
        "heads": 4,
        "no_kernels": True,
    }
    helps = {a.dest: a.help for a in p._actions}
    assert helps["device"] == "M (N) (default cpu)"
    assert helps["dtype"] == "D (default float32)"
    assert helps["layers"].endswith("(default max(4, 2N-2): 4 for N <= 3, or L)")
