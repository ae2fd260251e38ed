"""Every ``graphpipe`` command the docs show parses with the real parser.

The commands are taken from the shell code blocks of README.md, docs/*.md and profiles/*.md
(fenced blocks other than python/text/output ones, and indented blocks), with ``\\``
continuations joined and comments dropped; a command is ``graphpipe ...``, ``python -m
graphpipe ...``, ``torchrun ... -m graphpipe ...`` or ``python -m graphpipe.bench ...``. Each
is parsed by ``graphpipe.cli``'s parser (parse only: nothing runs). In a block with ``$``
prompts only the prompted lines are commands; a line like ``graphpipe train: error: ...``
is output. The inline synopses (```graphpipe SUB [--flag ...]```) are checked too: every
flag they name is an option of SUB. ``tests/test_docs_run.py`` runs the blocks (every
command and code block that runs on CPU, slow-marked where long).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from graphpipe.cli import _build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS += sorted((ROOT / "profiles").glob("*.md"))

_NOT_SHELL = {"python", "py", "text", "output", "console-output", "json", "csv", "toml"}
_SEPARATORS = {"&&", "||", ";", "|"}


@dataclass(frozen=True)
class DocCommand:
    where: str  # FILE:LINE
    argv: tuple[str, ...]  # graphpipe's arguments, the subcommand first


def _shell_blocks(text: str) -> Iterator[tuple[int, list[str]]]:
    """``(first line number, lines)`` of every shell code block of a markdown text."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"\s*(```+|~~~+)\s*([\w-]*)", line)
        if fence:
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(fence[1]):
                end += 1
            if fence[2].lower() not in _NOT_SHELL:
                yield i + 2, lines[i + 1 : end]
            i = end + 1
            continue
        if line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            yield i + 1, [x[4:] for x in lines[i:end]]
            i = end
            continue
        i += 1


def _logical_lines(first: int, lines: list[str]) -> Iterator[tuple[int, str]]:
    """Join ``\\`` continuations; drop output lines of a block with ``$`` prompts."""
    prompted = any(x.lstrip().startswith("$ ") for x in lines)
    start, parts = None, []
    for n, line in enumerate(lines, start=first):
        if start is None:
            if prompted and not line.lstrip().startswith("$ "):
                continue
            start = n
            line = line.lstrip().removeprefix("$ ")
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        yield start, " ".join(parts)
        start, parts = None, []


def _graphpipe_argv(tokens: list[str]) -> tuple[str, ...] | None:
    """The arguments given to graphpipe by one shell command, or None if it runs no graphpipe."""
    for i, tok in enumerate(tokens):
        if i > 0 and tokens[i - 1] == "-m" and tok in ("graphpipe", "graphpipe.bench"):
            return (*(["bench"] if tok == "graphpipe.bench" else []), *tokens[i + 1 :])
        if tok == "graphpipe" and all(re.match(r"\w+=", t) for t in tokens[:i]):
            return tuple(tokens[i + 1 :])
    return None


def doc_commands(text: str, name: str) -> list[DocCommand]:
    """The graphpipe commands of a markdown text's shell code blocks."""
    found = []
    for first, block in _shell_blocks(text):
        for n, line in _logical_lines(first, block):
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:
                continue  # not shell (an unbalanced quote): nothing to run here
            command: list[str] = []
            for tok in [*tokens, ";"]:
                if tok not in _SEPARATORS:
                    command.append(tok)
                    continue
                argv = _graphpipe_argv(command)
                command = []
                if argv is None or (argv and argv[0].endswith(":")):  # "graphpipe train: ..."
                    continue
                found.append(DocCommand(f"{name}:{n}", argv))
    return found


def _parse(argv: tuple[str, ...]) -> tuple[int, str]:
    """Parse ``graphpipe ARGV`` (``--help`` stops with 0); the exit status and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            _build_parser().parse_args(list(argv))
        except SystemExit as e:
            return int(e.code or 0), err.getvalue()
    return 0, ""


def _all_commands() -> list[DocCommand]:
    return [c for path in DOCS for c in doc_commands(path.read_text(), path.name)]


def test_the_extractor_finds_commands_and_skips_python_and_output() -> None:
    text = "\n".join(
        [
            "Text with `graphpipe train --nope` inline (a synopsis, not a block).",
            "```bash",
            "pip install -e . && graphpipe train --steps 3   # a comment --bad",
            "torchrun --nproc-per-node 2 -m graphpipe train \\",
            "    --dp 2",
            "python -m graphpipe.bench --regime moe",
            "graphpipe train: error: --ranks must be >= 1, got 0",
            "```",
            "```python",
            "import graphpipe  # graphpipe train --not-a-command",
            "```",
            "```console",
            "$ graphpipe schedule --ranks 2 --microbatches 4",
            "graphpipe --wrong output",
            "```",
            "",
            "    graphpipe profile --out /tmp/p",
        ]
    )
    got = [(c.where, c.argv) for c in doc_commands(text, "x.md")]
    assert got == [
        ("x.md:3", ("train", "--steps", "3")),
        ("x.md:4", ("train", "--dp", "2")),
        ("x.md:6", ("bench", "--regime", "moe")),
        ("x.md:13", ("schedule", "--ranks", "2", "--microbatches", "4")),
        ("x.md:17", ("profile", "--out", "/tmp/p")),
    ]


def test_a_command_with_an_unknown_flag_fails_to_parse() -> None:
    code, err = _parse(("profile", "--out", "/tmp/p", "--no-such-flag"))
    assert code == 2 and "unrecognized arguments: --no-such-flag" in err


def test_the_readme_shows_commands() -> None:
    readme = DOCS[0].read_text()
    assert doc_commands(readme, "README.md"), "no graphpipe command found in README.md"


@pytest.mark.parametrize("command", _all_commands(), ids=lambda c: c.where)
def test_every_command_in_the_docs_parses(command: DocCommand) -> None:
    code, err = _parse(command.argv)
    assert code == 0, f"{command.where}: graphpipe {shlex.join(command.argv)}\n{err}"


def _synopses(text: str) -> Iterator[tuple[str, str]]:
    """``(subcommand, code span)`` of every inline code span ```graphpipe SUB ...```."""
    for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", text):
        span = " ".join(span.split())  # spans may wrap across lines
        found = re.match(r"graphpipe (schedule|train|bench|profile)\b", span)
        if found:
            yield found[1], span


def _option_strings(command: str) -> set[str]:
    parser = _build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {s for a in sub.choices[command]._actions for s in a.option_strings}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_flag_an_inline_synopsis_names_exists(path: Path) -> None:
    options = {c: _option_strings(c) for c in ("schedule", "train", "bench", "profile")}
    unknown = [
        (command, flag, span)
        for command, span in _synopses(path.read_text())
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", span)
        if flag not in options[command]
    ]
    assert unknown == [], f"{path.name}: flags that the parsers do not have: {unknown}"
