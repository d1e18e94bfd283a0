"""One run per output at a time: an exclusive lock held for the whole run.

`flock` on `<output>.lock`: the kernel drops the lock when its process dies, even by SIGKILL,
so a crash never leaves a stale lock; a second run (a cron retry while the first is still
going, an Airflow zombie) fails at once with OutputLocked and touches nothing.

An object store has no flock: there the lock is a lease (`LeaseLock`), an object naming its
holder and when the lease ends, renewed by a background thread while the run lives. A run killed
without releasing it blocks the next one until the lease ends (LEASE_SECONDS; the next run exits
75, which a scheduler retries). The store gives no atomic create-if-absent through fsspec, so two
runs starting within the same second are told apart by writing, waiting and reading back: the
later writer wins, the other one stops before it touches anything.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from batchscore.errors import OutputError, OutputLocked
from batchscore.io.atomic import atomic_write
from batchscore.io.storage import is_remote, remove_file, sibling

log = logging.getLogger("batchscore")


LEASE_SECONDS = 90.0  # an object-store lock not renewed for this long is free (env BATCHSCORE_LEASE_SECONDS)
_SETTLE_SECONDS = 1.0  # wait before reading a lease back (a concurrent writer's put lands)


def lock_path(output_path: str | os.PathLike, writer: str = "run"):
    return sibling(output_path, ".lock" if writer == "run" else f".{writer}.lock")


def OutputLock(output_path: str | os.PathLike, writer: str = "run"):
    """The exclusive lock of one writer of an output (`run` or a shard): a flock on a local
    disk, a lease in an object store. A context manager with `acquire` and `release(remove)`."""
    return LeaseLock(output_path, writer) if is_remote(output_path) else FileLock(output_path, writer)


class FileLock:
    """Context manager: holds the exclusive flock of one writer of a local output."""

    def __init__(self, output_path: str | os.PathLike, writer: str = "run"):
        self.path = lock_path(output_path, writer)
        self._fd: int | None = None

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
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
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

    def release(self, remove: bool = False) -> None:
        """Release the lock; with `remove`, delete the lock file first (a finished run)."""
        if self._fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


class LeaseLock:
    """Context manager: holds the lease of one writer of an object-store output (module docstring)."""

    def __init__(self, output_path: str | os.PathLike, writer: str = "run", lease_seconds: float | None = None):
        self.path = lock_path(output_path, writer)
        self.lease_seconds = lease_seconds or float(os.environ.get("BATCHSCORE_LEASE_SECONDS", LEASE_SECONDS))
        self._token: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> LeaseLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lease or raise OutputLocked naming the holder; OutputError when the store
        refuses the write (a missing bucket, no permission)."""
        held = self._read()
        if held is not None and held.get("expires", 0) > time.time():
            raise OutputLocked(f"another batchscore run is writing this output ({_describe(held)}); lease "
                               f"{self.path} ends {_when(held['expires'])}. Nothing was changed — wait for it, "
                               "or stop it first") from None
        self._token = uuid.uuid4().hex
        self._write()
        time.sleep(_SETTLE_SECONDS)
        held = self._read()
        if held is None or held.get("token") != self._token:
            self._token = None
            raise OutputLocked(f"another batchscore run took this output's lease at the same time "
                               f"({_describe(held or {})}); lease {self.path}. Nothing was changed")
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, name="batchscore-lease", daemon=True)
        self._renewer.start()

    def release(self, remove: bool = False) -> None:
        """Stop renewing; delete the lease (always: a lease left behind would block the next run
        until it ends). `remove` is accepted for the FileLock interface."""
        if self._token is None:
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        held = self._read()
        if held is not None and held.get("token") == self._token:
            remove_file(self.path)
        self._token = None

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_seconds / 3):
            try:
                self._write()
            except OSError as exc:  # the store is unreachable for a while: the next renewal retries
                log.warning("could not renew the lease %s: %s", self.path, exc)

    def _write(self) -> None:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "token": self._token,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "expires": time.time() + self.lease_seconds}
        try:
            atomic_write(self.path, lambda tmp: Path(tmp).write_text(json.dumps(record)))
        except (OSError, ValueError) as exc:
            raise OutputError(f"cannot write the lease {self.path}: {exc}") from None

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            return {}  # unreadable: treat as expired


def _describe(held: dict) -> str:
    try:
        return f"pid {held['pid']} on {held['host']}, started {held['started']}"
    except KeyError:
        return "holder unknown"


def _when(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch)) + f" (in {max(0, epoch - time.time()):.0f} s)"


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"
