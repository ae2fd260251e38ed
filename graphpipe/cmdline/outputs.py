"""The command line's output paths, checked before any work starts.

Every file or directory a subcommand writes (``schedule --out``, ``train --metrics`` and
``--checkpoint-dir``, ``bench --json`` and ``--plot``, ``profile --out``) is checked when the
arguments are, so that a path that cannot be written is a one-line error (exit status 2)
before a benchmark runs or a rank starts, not a traceback after the work.

The rule, the same for every subcommand: graphpipe creates the file or the directory you
name, never the directories above it. Their parent must exist and be writable (a missing
parent is refused, not created: a mistyped path does not grow a tree); an existing file is
overwritten, an existing directory must be writable. Writability is probed by creating and
removing a file there, which is what counts (permission bits do not stop root; ``/proc`` and
read-only mounts refuse it anyway).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["check_output_dir", "check_output_file"]


def _unwritable(directory: Path) -> str | None:
    """Why no file can be created in the existing directory ``directory`` (None: it can)."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".graphpipe-write-check-")
    except OSError as e:
        return e.strerror or type(e).__name__
    os.close(fd)
    os.unlink(probe)
    return None


def _parent_problem(flag: str, path: Path) -> str | None:
    parent = path.absolute().parent
    if not parent.exists():
        return f"{flag} {path}: directory {parent} does not exist (create it first)"
    if not parent.is_dir():
        return f"{flag} {path}: {parent} is not a directory"
    why = _unwritable(parent)
    if why is not None:
        return f"{flag} {path}: cannot write in directory {parent} ({why})"
    return None


def check_output_file(flag: str, path: str | os.PathLike) -> str | None:
    """The problem with writing the file ``path`` given as ``flag``, as one line (None: fine).

    The file may exist (it is overwritten) but not be a directory; its parent directory must
    exist and be writable."""
    path = Path(path)
    if path.is_dir():
        return f"{flag} {path}: is a directory; give a file name"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{flag} {path}: the file exists and is not writable"
    return _parent_problem(flag, path)


def check_output_dir(flag: str, path: str | os.PathLike) -> str | None:
    """The problem with writing into the directory ``path`` given as ``flag``, as one line
    (None: fine). An existing one must be a writable directory; a new one is created by the
    command, in a parent directory that must exist and be writable."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            return f"{flag} {path}: exists and is not a directory"
        why = _unwritable(path)
        return None if why is None else f"{flag} {path}: cannot write in it ({why})"
    return _parent_problem(flag, path)
