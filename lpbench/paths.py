"""Output paths: checked before any work starts, and files written whole or not at all.

``check_dir``/``check_file`` refuse (UsageError: one line, exit 2) a path that cannot be used
as asked: a file where a folder is meant or the reverse, an unwritable place. They create
nothing, so a rejected command leaves the disk as it was. ``write_file`` writes through a
temporary file in the same folder and renames it into place, removing it on any failure.
"""

from __future__ import annotations

import os
from pathlib import Path

from lpbench.errors import UsageError


def _cannot_create(path: Path) -> str | None:
    """Why ``path`` (which does not exist) cannot be created, or None."""
    parent = next((p for p in path.absolute().parents if p.exists()), Path("/"))
    if not parent.is_dir():
        return f"cannot create it ({parent} is a file, not a folder)"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create it ({parent} is not writable)"
    return None


def check_dir(path: str | os.PathLike, flag: str) -> Path:
    """``path`` is a writable folder, or one that can be created; nothing is created."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"{flag} {path}: a file is there, not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: the folder is not writable")
    elif why := _cannot_create(path):
        raise UsageError(f"{flag} {path}: {why}")
    return path


def check_file(path: str | os.PathLike, flag: str) -> Path:
    """``path`` can be written as a file (its folder exists or can be created); nothing is created."""
    text = os.fspath(path)
    path = Path(text)
    if text.endswith(os.sep) or path.is_dir():
        raise UsageError(f"{flag} {text}: a folder, not a file")
    if path.exists():
        if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: not writable")
    elif why := _cannot_create(path):
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
