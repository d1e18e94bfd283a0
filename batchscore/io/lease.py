"""The lock of an output in an object store: a lease, since a store has no flock.

The lease is an object (`<output>.lock`) naming its holder and when it ends. It is taken with an
exclusive create (fsspec's `pipe_file(mode="create")`: S3's `If-None-Match: *`, GCS's
`ifGenerationMatch=0`), so of two runs starting together exactly one gets it; a lease that ended
(its holder died without releasing it) is taken over by replacing exactly the object that was
read (S3: `If-Match` on its ETag; elsewhere: removed only if still unchanged, then created
exclusively). After taking it, the run waits a moment and reads it back, which also catches a
takeover race on stores without conditional replace.

A background thread renews the lease every third of its length, replacing only its own object
(S3: `If-Match`; elsewhere: read, compare, write). If the lease was taken by another run (after
this one failed to renew for a whole lease, say the store was unreachable), or renewing failed
for longer than the lease, the lease is *lost*: `check()` then raises OutputLocked, and the run
calls it before every manifest write and before the output, so a run that lost its lease stops
writing (its saved parts stay valid; the holder resumes from them).

A run killed without releasing its lease blocks the next run until the lease ends (90 s,
`BATCHSCORE_LEASE_SECONDS`): that run exits 75, which a scheduler retries.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from batchscore.errors import OutputError, OutputLocked

log = logging.getLogger("batchscore")

LEASE_SECONDS = 90.0  # a lease not renewed for this long has ended (env BATCHSCORE_LEASE_SECONDS)
SETTLE_SECONDS = 1.0  # wait before reading a new lease back
_CONDITIONAL_REPLACE = ("s3", "s3a")  # stores whose fsspec put takes If-Match (replace exactly this object)


class LeaseLock:
    """Context manager: holds the lease `path` (a UPath from io/storage.py); see the module docstring."""

    def __init__(self, path, lease_seconds: float | None = None):
        self.path = path
        self.lease_seconds = lease_seconds or float(os.environ.get("BATCHSCORE_LEASE_SECONDS", LEASE_SECONDS))
        self.lost: str | None = None  # why the lease was lost, once it was
        self._token: str | None = None
        self._etag: str | None = None  # of our lease object, as last written
        self._renewed = 0.0
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> LeaseLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lease, or raise OutputLocked naming the holder (nothing touched); OutputError
        when the store refuses (a missing bucket, no permission)."""
        try:
            self._acquire()
        except OSError as exc:
            self._token = None
            raise OutputError(f"cannot take the lease {self.path}: {exc}") from None

    def check(self) -> None:
        """Raise OutputLocked when the lease was lost (see the module docstring)."""
        if self.lost is not None:
            raise OutputLocked(f"this run lost its lease {self.path} ({self.lost}); it stopped writing — the rows "
                               "scored so far are saved, and a rerun resumes from them")

    def release(self, remove: bool = False) -> None:
        """Stop renewing and delete the lease if it is still ours (always: a lease left behind
        would block the next run until it ends; `remove` is the FileLock interface). Never raises:
        a store error here is logged, and the lease then ends by itself."""
        if self._token is None:
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        try:
            held, _ = self._read()
            if held is not None and held.get("token") == self._token:
                self.path.fs.rm_file(self.path.path)
        except Exception as exc:  # noqa: BLE001 - releasing must not hide the run's own outcome
            log.warning("could not remove the lease %s (%s); it ends by itself in %.0f s",
                        self.path, exc, self.lease_seconds)
        self._token = None

    # -- taking the lease

    def _acquire(self) -> None:
        held, etag = self._read()
        if held is not None and held.get("expires", 0) > time.time():
            raise OutputLocked(f"another batchscore run is writing this output ({_describe(held)}); lease "
                               f"{self.path} ends {_when(held['expires'])}. Nothing was changed — wait for it, "
                               "or stop it first")
        self._token = uuid.uuid4().hex
        if held is None:
            taken = self._create()
        else:
            log.warning("the lease %s of %s ended %s; taking it over", self.path, _describe(held),
                        _when(held.get("expires", 0)))
            taken = self._replace(etag)
        time.sleep(SETTLE_SECONDS)
        now, _ = self._read() if taken else (None, None)
        if not taken or now is None or now.get("token") != self._token:
            self._token = None
            raise OutputLocked(f"another batchscore run took this output's lease at the same time "
                               f"({_describe(now or {})}); lease {self.path}. Nothing was changed")
        self._renewed = time.monotonic()
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="batchscore-lease", daemon=True)
        self._renewer.start()

    def _create(self) -> bool:
        """Write our lease only if no object is there; False when another run's is."""
        try:
            self.path.fs.pipe_file(self.path.path, self._record(), mode="create")
        except FileExistsError:
            return False
        except (TypeError, ValueError, NotImplementedError):  # a store without exclusive create: the read-back decides
            self.path.fs.pipe_file(self.path.path, self._record())
        self._etag = self._current_etag()
        return True

    def _replace(self, etag: str | None) -> bool:
        """Replace the ended lease we read (tag `etag`) with ours; False when it changed since."""
        if self.path.protocol in _CONDITIONAL_REPLACE and etag:
            try:
                self.path.fs.pipe_file(self.path.path, self._record(), IfMatch=etag)
            except OSError as exc:
                if _precondition_failed(exc):
                    return False
                raise
            self._etag = self._current_etag()
            return True
        _, now = self._read()
        if now != etag:
            return False
        self.path.fs.rm_file(self.path.path)
        return self._create()

    # -- keeping it

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_seconds / 3):
            try:
                self._renew()
            except Exception as exc:  # noqa: BLE001 - the store may be unreachable for a while: retry
                log.warning("could not renew the lease %s: %s", self.path, exc)
            if self.lost is None and time.monotonic() - self._renewed > self.lease_seconds:
                self.lost = f"not renewed for {self.lease_seconds:.0f} s"
            if self.lost is not None:
                log.error("lost the lease %s: %s", self.path, self.lost)
                return

    def _renew(self) -> None:
        if self.path.protocol in _CONDITIONAL_REPLACE and self._etag:
            try:
                self.path.fs.pipe_file(self.path.path, self._record(), IfMatch=self._etag)
            except OSError as exc:
                if not _precondition_failed(exc):
                    raise
                held, _ = self._read()
                self.lost = f"taken by {_describe(held or {})}"
                return
        else:
            held, _ = self._read()
            if held is None or held.get("token") != self._token:
                self.lost = f"taken by {_describe(held or {})}" if held else "its object was removed"
                return
            self.path.fs.pipe_file(self.path.path, self._record())
        self._etag = self._current_etag()
        self._renewed = time.monotonic()

    # -- the object

    def _record(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": self._token,
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "expires": time.time() + self.lease_seconds}).encode()

    def _read(self) -> tuple[dict | None, str | None]:
        """(the lease's record, its tag) — (None, None) when there is none; an unreadable record
        counts as ended."""
        self.path.fs.invalidate_cache(self.path.path)
        try:  # the tag first: if the object changes before it is read, a replace matching this tag fails
            tag = self._current_etag()
            data = self.path.fs.cat_file(self.path.path)
        except FileNotFoundError:
            return None, None
        try:
            record = json.loads(data)
        except ValueError:
            record = {}
        return (record if isinstance(record, dict) else {}), tag

    def _current_etag(self) -> str | None:
        info = self.path.fs.info(self.path.path)
        return next((str(info[k]) for k in ("ETag", "etag", "generation", "md5Hash") if info.get(k)), None)


def _precondition_failed(exc: OSError) -> bool:
    return isinstance(exc, FileExistsError) or "pre-condition" in str(exc).lower() or "412" in str(exc)


def _describe(held: dict) -> str:
    try:
        return f"pid {held['pid']} on {held['host']}, renewed {held['started']}"
    except KeyError:
        return "holder unknown"


def _when(epoch: float) -> str:
    left = epoch - time.time()
    clock = time.strftime("%H:%M:%S", time.localtime(epoch))
    return f"{clock} (in {left:.0f} s)" if left >= 0 else f"at {clock} ({-left:.0f} s ago)"


__all__ = ["LEASE_SECONDS", "LeaseLock"]
