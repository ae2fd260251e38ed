"""A checkpoint directory's files: its marker, their sizes and CRC-32s, and their verification.

The layer under ``graphpipe.checkpoint`` that needs no torch: which ``step-N`` directories a
root holds and which are complete (a readable marker), the CRC-32 of a file, and the checks of
a checkpoint's files against its marker (``verify_files``: missing, truncated, corrupt, or not
listed), ``verify_checkpoint`` and ``find_resumable``. ``graphpipe.checkpoint`` re-exports the
public names; see its doc for what a checkpoint holds.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "MARKER",
    "CheckpointError",
    "checkpoint_info",
    "checkpoint_path",
    "complete_dirs",
    "crc32",
    "file_record",
    "find_resumable",
    "latest_checkpoint",
    "marker_of",
    "read_marker",
    "resolve_checkpoint",
    "step_dirs",
    "verify_checkpoint",
    "verify_files",
]

MARKER = "graphpipe.json"
"""The file that marks a checkpoint directory complete (its step, ranks, stages and files)."""

FORMAT = "graphpipe-checkpoint-2"
UNVERIFIED_FORMAT = "graphpipe-checkpoint-1"  # no checksums, key maps or tied names
STEP_NAME = re.compile(r"step-(\d+)")
DCP_METADATA = ".metadata"
CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as saved: a file damaged, truncated or missing, or a
    marker without checksums. ``path``: the checkpoint; ``reason``: what is wrong, naming
    the file (``file``, or None when the fault is not one file's)."""

    def __init__(self, path: str | os.PathLike, reason: str, file: str | None = None) -> None:
        super().__init__(f"checkpoint {path}: {reason}")
        self.path, self.reason, self.file = Path(path), reason, file

    def __reduce__(self) -> tuple[Any, ...]:  # rebuilt whole on the ranks that receive it
        return (type(self), (self.path, self.reason, self.file))


def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` lives: ``ROOT/step-00000012``."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got step={step!r}")
    return Path(root) / f"step-{step:08d}"


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(info, dict) and info.get("format") in (FORMAT, UNVERIFIED_FORMAT)
    return info if ok else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` directory under ``root`` as (step, path), oldest first."""
    found = []
    if root.is_dir():
        for child in root.iterdir():
            m = STEP_NAME.fullmatch(child.name)
            if m and child.is_dir():
                found.append((int(m.group(1)), child))
    return sorted(found)


def complete_dirs(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` as (step, path), oldest first."""
    return [(step, p) for step, p in step_dirs(root) if read_marker(p) is not None]


def checkpoint_info(path: str | os.PathLike) -> dict[str, Any]:
    """What the marker of the checkpoint at ``path`` says: ``{"step", "world_size", "stages",
    "meta"}`` (``stages[r]``: rank r's stage indices; ``meta``: what the saver passed).

    Raises ``FileNotFoundError`` naming ``path`` when it is not a complete checkpoint.
    """
    info = marker_of(Path(path))
    return {k: info.get(k) for k in ("step", "world_size", "stages", "meta")}


def marker_of(path: Path) -> dict[str, Any]:
    info = read_marker(path)
    if info is None:
        raise FileNotFoundError(
            f"{str(path)!r} is not a complete graphpipe checkpoint (no readable {MARKER})"
        )
    return info


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (None if there is none or no ``root``);
    its files are not verified (``find_resumable`` does that)."""
    found = complete_dirs(Path(root))
    return found[-1][1] if found else None


# ------------------------------------------------------------------ checksums


def crc32(file: Path) -> int:
    crc, buf = 0, bytearray(CHUNK)
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def file_record(file: Path, rank: int) -> dict[str, int]:
    return {"rank": rank, "size": file.stat().st_size, "crc32": crc32(file)}


def size_problem(path: Path, name: str, saved: Mapping[str, Any]) -> str | None:
    try:
        size = (path / name).stat().st_size
    except FileNotFoundError:
        return f"file {name} is missing"
    except OSError as e:
        return f"file {name} cannot be read ({e.strerror or e})"
    if size != saved["size"]:
        how = "truncated" if size < saved["size"] else "longer than saved"
        return f"file {name} is {how} ({size} bytes, {saved['size']} when saved)"
    return None


def crc_problem(path: Path, name: str, saved: Mapping[str, Any]) -> str | None:
    try:
        crc = crc32(path / name)
    except OSError as e:
        return f"file {name} cannot be read ({e.strerror or e})"
    if crc != saved["crc32"]:
        return f"file {name} is corrupt (CRC-32 {crc:08x}, {saved['crc32']:08x} when saved)"
    return None


def first_unlisted(path: Path, files: Mapping[str, Any]) -> str | None:
    """The first entry of the directory ``path`` that is neither the marker nor listed in
    ``files`` (None: there is none)."""
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError:
        return None  # the files' own checks name what cannot be read
    return next((n for n in names if n != MARKER and n not in files), None)


def verify_files(path: Path, info: Mapping[str, Any], rank: int | None = None) -> None:
    """Check the checkpoint's files against the marker ``info``: all of them and the
    directory's listing (``rank`` None), or ``.metadata`` and the ones ``rank`` wrote (rank 0
    the listing too). Raises ``CheckpointError``: a file missing, truncated, corrupt, or
    present but not listed in the marker (DCP would read it through ``.metadata``)."""
    if info.get("format") != FORMAT or not isinstance(info.get("files"), dict):
        raise CheckpointError(
            path,
            f"its {MARKER} records no checksums (format {info.get('format')!r}); "
            "load_checkpoint(..., verify=False) loads it unverified",
        )
    files: dict[str, Any] = info["files"]
    if rank is None or rank == 0:  # the directory's listing: no file may be unaccounted for
        unlisted = first_unlisted(path, files)
        if unlisted is not None:
            raise CheckpointError(
                path,
                f"file {unlisted} is not listed in {MARKER} (a save lists every file it "
                "writes: this one was added, or its entry removed, since)",
                unlisted,
            )
    names = sorted(
        name
        for name, saved in files.items()
        if rank is None or name == DCP_METADATA or saved.get("rank") == rank
    )
    # Every size first: a truncated or missing file is found without reading the others.
    for check in (size_problem, crc_problem):
        for name in names:
            problem = check(path, name, files[name])
            if problem is not None:
                raise CheckpointError(path, problem, name)


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check every file of the checkpoint at ``path`` against the sizes and CRC-32s its marker
    recorded, and that it holds no file the marker does not list, in this process. Raises
    ``FileNotFoundError`` when ``path`` is not a complete checkpoint, ``CheckpointError``
    naming the first unlisted, damaged, truncated or missing file."""
    path = Path(path)
    verify_files(path, marker_of(path))


def find_resumable(root: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``root`` whose files verify (None if there is none), and
    the newer ones it skipped, newest first, each with why: ``(path, reason)``.

    A ``step-N`` directory without a readable marker (a rank died while saving) is skipped
    as incomplete; a checkpoint whose files do not verify is skipped with the
    ``CheckpointError``'s reason. Checkpoints older than the one returned are not read.
    """
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(step_dirs(Path(root))):
        info = read_marker(path)
        if info is None:
            skipped.append((path, f"incomplete (no readable {MARKER})"))
            continue
        try:
            verify_files(path, info)
        except CheckpointError as e:
            skipped.append((path, e.reason))
            continue
        return path, skipped
    return None, skipped


def resolve_checkpoint(
    path: str | os.PathLike,
) -> tuple[Path | None, list[tuple[Path, str]], str | None]:
    """What a command's checkpoint argument names: a checkpoint itself (it holds the marker or
    DCP's ``.metadata``), or a root whose newest checkpoint that verifies is meant
    (``find_resumable``). Returns ``(checkpoint, newer ones skipped with why, None)``, or
    ``(None, skipped, why there is none)``."""
    path = Path(path)
    if (path / MARKER).exists() or (path / DCP_METADATA).exists():
        return path, [], None
    found, skipped = find_resumable(path)
    if found is None:
        what = "verifies" if skipped else "is there (no step-N directory)"
        return None, skipped, f"{path}: no checkpoint {what}"
    return found, skipped, None
