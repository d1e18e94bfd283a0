"""Atomic file writes: a file appears at its final path complete and on disk, or not at all.

Locally: a temporary file in the same folder, fsynced, renamed. In an object store (io/storage.py)
there is no rename, and none is needed: the finished file is uploaded in one put, and the object
appears whole when the upload completes, or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from batchscore.faults import fault_point
from batchscore.io.storage import as_path, is_remote

UMASK = os.umask(0)
os.umask(UMASK)  # read once: the process's umask, restored at once


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]):
    """Call `write(tmp_path)`, fsync the file, rename it to `path`, fsync the folder.

    The temporary file lives in the same folder (so the rename is atomic) and is removed if
    anything fails. Creates the folder if needed. Returns `path` (as io/storage.as_path gives it;
    an object-store URL is written by one upload of the finished temporary file).
    """
    path = as_path(path)
    if is_remote(path):
        return _upload(path, write)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~UMASK)  # mkstemp makes 0600; outputs follow the umask like any file
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        fault_point("atomic")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)
    return path


def refuse_link(path, what: str) -> None:
    """Refuse a symbolic link planted where batchscore makes a file or folder of its own (an
    output's lock, its parts folder): opened or filled through the link, it would overwrite or
    fill whatever the link points to. Files written whole are safe without this: `atomic_write`
    renames over the link itself. Raises OutputError (exit 6); an object store has no links."""
    from batchscore.errors import OutputError

    if is_remote(path) or not os.path.islink(path):
        return
    raise OutputError(f"{what} {path} is a symbolic link (to {os.readlink(path)}); batchscore does not write "
                      "through a link at a path of its own: remove it and rerun")


def _upload(path, write: Callable[[str], object]):
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        fault_point("atomic")
        path.fs.put_file(tmp, path.path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def fsync_folder(folder: Path) -> None:
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
