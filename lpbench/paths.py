"""Output paths: checked before any work starts, and files written whole or not at all.

``check_dir``/``check_file`` refuse (UsageError: one line, exit 2) a path that cannot be used
as asked: an empty path, a file where a folder is meant or the reverse, a symlink that leads
nowhere (dangling or a loop), a file that holds results (a SQLite database such as
``results.db``, or a checkpoint's file), a folder that holds a Hugging Face checkpoint
(``check_export_dir``), and a place where nothing can be written. Writability is
probed, not guessed from permission bits (which say nothing about /proc, /sys, read-only mounts
or root): a file is created and removed where the output will go, in the folder itself or in its
nearest existing ancestor, so a rejected command leaves the disk as it was. ``write_file``
writes through a temporary file in the same folder and renames it into place, removing it on
any failure.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lpbench.errors import UsageError

SQLITE_HEADER = b"SQLite format 3\x00"
CHECKPOINT_META = "lpbench.json"  # train/checkpoint.py's META_FILE: a folder holding it is a checkpoint


def _probe(folder: Path) -> str | None:
    """Why nothing can be written in the existing folder ``folder`` (a file created there and removed), or None."""
    try:
        fd, name = tempfile.mkstemp(prefix=".lpbench-probe-", dir=folder)
    except OSError as exc:
        return f"nothing can be written in {folder} ({exc.strerror or exc})"
    os.close(fd)
    os.unlink(name)
    return None


def _where_to_write(path: Path) -> str | None:
    """Why ``path`` (file or folder, existing or not) cannot be written, or None."""
    if os.path.lexists(path) and not path.exists():
        return "a symlink that leads nowhere (dangling, or a loop)"
    if path.is_dir():
        return _probe(path)
    for parent in path.absolute().parents:
        if os.path.lexists(parent) and not parent.exists():
            return f"cannot create it ({parent} is a symlink that leads nowhere)"
        if parent.exists():
            if not parent.is_dir():
                return f"cannot create it ({parent} is a file, not a folder)"
            why = _probe(parent)
            return f"cannot create it ({why})" if why and not path.parent.exists() else why
    return None


def _holds_results(path: Path) -> str | None:
    """What results the existing file ``path`` holds (a SQLite database, a checkpoint's file), or None."""
    try:
        with open(path, "rb") as f:
            if f.read(len(SQLITE_HEADER)) == SQLITE_HEADER:
                return "a results database"
    except OSError:
        return None
    if path.name == CHECKPOINT_META or (path.parent / CHECKPOINT_META).is_file() or path.suffix == ".distcp":
        return "a file of a checkpoint"
    return None


def _non_empty(path: str | os.PathLike, flag: str) -> str:
    text = os.fspath(path)
    if not text.strip():
        raise UsageError(f"{flag} {text!r}: an empty path")
    return text


def check_dir(path: str | os.PathLike, flag: str) -> Path:
    """``path`` is a writable folder, or one that can be created; nothing is left on disk."""
    path = Path(_non_empty(path, flag))
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: a file is there, not a folder")
    if why := _where_to_write(path):
        raise UsageError(f"{flag} {path}: {'the folder is not writable: ' if path.is_dir() else ''}{why}")
    return path


def check_export_dir(path: str | os.PathLike, flag: str) -> Path:
    """``check_dir``, and the folder holds no Hugging Face checkpoint (``config.json``, ``*.safetensors``)
    that an export would overwrite or mix its files with."""
    path = check_dir(path, flag)
    if path.is_dir() and ((path / "config.json").exists() or any(path.glob("*.safetensors"))):
        raise UsageError(
            f"{flag} {path}: a Hugging Face checkpoint is there; lpbench does not overwrite results "
            "(choose another folder)"
        )
    return path


def check_file(path: str | os.PathLike, flag: str) -> Path:
    """``path`` can be written as a file (its folder exists or can be created) and holds no results that
    writing would destroy; nothing is left on disk."""
    text = _non_empty(path, flag)
    path = Path(text)
    if text.endswith(os.sep) or path.is_dir():
        raise UsageError(f"{flag} {text}: a folder, not a file")
    if path.exists():
        if held := _holds_results(path):
            raise UsageError(
                f"{flag} {path}: {held} is there; lpbench does not overwrite results (choose another file)"
            )
        if not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: not writable")
        if why := _probe(path.parent):
            raise UsageError(f"{flag} {path}: not writable ({why})")
    elif why := _where_to_write(path):
        raise UsageError(f"{flag} {path}: {why}")
    return path


def write_file(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically: the complete new file or the old one, no temporary left."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write {path} ({exc.strerror or exc})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
