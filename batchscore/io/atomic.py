"""Atomic file writes: a file appears at its final path complete and on disk, or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from batchscore.faults import fault_point

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: the process's umask, restored at once


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call `write(tmp_path)`, fsync the file, rename it to `path`, fsync the folder.

    The temporary file lives in the same folder (so the rename is atomic) and is removed if
    anything fails. Creates the folder if needed. Returns `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; outputs follow the umask like any file
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        fault_point("atomic")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return path


def _fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
