"""One run per output at a time: an exclusive lock held for the whole run.

`flock` on `<output>.lock` (named in output/layout.py): the kernel drops the lock when its
process dies, even by SIGKILL, so a crash never leaves a stale lock; a second run (a cron retry
while the first is still going, an Airflow zombie) fails at once with OutputLocked and touches
nothing.

An object store has no flock: there the lock is a lease (io/lease.py). `OutputLock` gives the
one that fits the output; both have `check()` (a lease can be lost; a flock cannot).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from batchscore.errors import OutputError, OutputLocked
from batchscore.output.layout import RUN_WRITER, OutputFiles
from batchscore.io.atomic import refuse_link
from batchscore.output.lease import LeaseLock

_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)


def OutputLock(files: OutputFiles, writer: str = RUN_WRITER):
    """The exclusive lock of one writer of an output (`run`, a shard, or `merge`) at
    `files.lock(writer)`: a flock on a local disk, a lease in an object store. A context manager
    with `acquire` and `release(remove)`."""
    return LeaseLock(files.lock(writer)) if files.remote else FileLock(files.lock(writer))


class FileLock:
    """Context manager: holds the exclusive flock at `path` (a local output's lock file)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self.created = False  # this run made the lock file (none was left by an earlier run)

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock or raise OutputLocked naming the holder; OutputError when it cannot be
        created at all (a read-only folder)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create the output folder {self.path.parent}: {exc.strerror}") from None
        while True:
            try:
                try:  # O_NOFOLLOW: a link planted at the lock's path is refused, never written through
                    fd, self.created = os.open(self.path, _FLAGS | os.O_EXCL, 0o666), True
                except FileExistsError:
                    fd, self.created = os.open(self.path, _FLAGS, 0o666), False
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    refuse_link(self.path, "the lock file")
                raise OutputError(f"cannot create the lock file {self.path}: {exc.strerror} "
                                  "(is the output folder writable?)") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise OutputLocked(f"another batchscore run is writing this output ({holder}); lock "
                                   f"{self.path}. Nothing was changed — wait for it, or stop it first") from None
            # The file may have been removed (by a run that finished) between open and flock:
            # then this lock guards nothing; take the lock of the file now at the path.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
        self._fd = fd

    def check(self) -> None:
        """A flock is held until released or its process dies: nothing to check."""

    def release(self, remove: bool = False) -> None:
        """Release the lock; with `remove`, delete the lock file first (a finished run)."""
        if self._fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"
