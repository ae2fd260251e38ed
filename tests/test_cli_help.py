"""Every option of every subcommand says what it does in ``--help``."""

from __future__ import annotations

import argparse

import pytest

from graphpipe.cli import _SUBCOMMANDS, _build_parser
from graphpipe.train.options import add_model_options


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = _build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"graphpipe": parser, **sub.choices}


def test_every_subcommand_is_registered() -> None:
    assert set(_subparsers()) == {"graphpipe", *_SUBCOMMANDS}


@pytest.mark.parametrize("name", ["graphpipe", *_SUBCOMMANDS])
def test_every_option_has_a_help_text(name: str) -> None:
    parser = _subparsers()[name]
    missing = [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert missing == [], f"{name}: options without a help text: {missing}"


def test_profile_takes_every_model_and_pipeline_option_of_train() -> None:
    shared = argparse.ArgumentParser()
    add_model_options(shared)
    model = {s for a in shared._actions for s in a.option_strings} - {"-h", "--help"}
    assert {"--ranks", "--dp", "--microbatches", "--capture", "--experts", "--ep"} <= model
    for name in ("train", "profile"):
        options = {s for a in _subparsers()[name]._actions for s in a.option_strings}
        assert model <= options, name
