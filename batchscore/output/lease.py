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
for longer than FENCE (0.6) of the lease — before anyone else may take it over —, the lease is
*lost*: `check()` then raises OutputLocked, and the run calls it before every part and manifest
write and before the output, so a run that lost its lease stops writing (its saved parts stay
valid; the holder resumes from them). A write that the store reports as conflicting is read back
first: a retried request that conflicts with its own earlier attempt is not a loss.

A run killed without releasing its lease blocks the next run until the lease ends (90 s,
`BATCHSCORE_LEASE_SECONDS`): that run exits 75, which a scheduler retries.
"""

from __future__ import annotations

import functools
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
MIN_LEASE_SECONDS = 5.0  # the first renewal (settle + a third of the lease) must come before the fence
FENCE = 0.6  # a holder stops writing once this share of the lease passed since its last renewal
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict"}  # S3's answers to a lost condition


class LeaseLock:
    """Context manager: holds the lease `path` (a UPath from io/storage.py); see the module docstring."""

    def __init__(self, path, lease_seconds: float | None = None):
        self.path = path
        seconds = lease_seconds or float(os.environ.get("BATCHSCORE_LEASE_SECONDS", LEASE_SECONDS))
        self.lease_seconds = max(seconds, MIN_LEASE_SECONDS)
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
        """Raise OutputLocked when the lease was lost, or not renewed for FENCE of its length
        (see the module docstring)."""
        if self.lost is None and self._token is not None and self._stale():
            self.lost = f"not renewed for {time.monotonic() - self._renewed:.0f} s"
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
        try:  # ours while renewed recently: nobody may take it over before it ends
            held, _ = self._read()
            if self.lost is None and not self._stale() and held is not None and held.get("token") == self._token:
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
        self._renewed = time.monotonic()
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
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="batchscore-lease", daemon=True)
        self._renewer.start()

    def _create(self) -> bool:
        """Write our lease only if no object is there; False when another run's is."""
        try:
            self._put(mode="create")
        except (TypeError, ValueError, NotImplementedError):  # a store without exclusive create: the read-back decides
            self._put()
        except OSError as exc:
            if not _conflict(exc):
                raise
            return self._ours_after_conflict()
        return True

    def _replace(self, etag: str | None) -> bool:
        """Replace the ended lease we read (tag `etag`) with ours; False when it changed since."""
        if _conditional_replace(self.path) and etag:
            try:
                self._put(IfMatch=etag)
            except OSError as exc:
                if not _conflict(exc):
                    raise
                return self._ours_after_conflict()
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
            if self.lost is None and self._stale():
                self.lost = f"not renewed for {time.monotonic() - self._renewed:.0f} s"
            if self.lost is not None:
                log.error("lost the lease %s: %s", self.path, self.lost)
                return

    def _renew(self) -> None:
        started = time.monotonic()  # the record's end time is computed from about now
        if _conditional_replace(self.path) and self._etag:
            try:
                self._put(IfMatch=self._etag)
            except OSError as exc:
                if not _conflict(exc):
                    raise
                if not self._ours_after_conflict():
                    held, _ = self._read()
                    self.lost = f"taken by {_describe(held or {})}" if held else "its object was removed"
                    return
        else:
            held, _ = self._read()
            if held is None or held.get("token") != self._token:
                self.lost = f"taken by {_describe(held or {})}" if held else "its object was removed"
                return
            self._put()
        self._renewed = started

    def _stale(self) -> bool:
        return time.monotonic() - self._renewed > FENCE * self.lease_seconds

    # -- the object

    def _put(self, **conditions) -> None:
        """Write our record; remember the tag the store gave it (from the reply where there is one)."""
        reply = self.path.fs.pipe_file(self.path.path, self._record(), **conditions)
        tag = reply.get("ETag") if isinstance(reply, dict) else None
        self._etag = tag or self._current_etag()

    def _ours_after_conflict(self) -> bool:
        """After a write the store refused as conflicting: True when the object is ours anyway (a
        retried request that conflicted with its own first attempt), keeping its tag."""
        held, tag = self._read()
        if held is not None and held.get("token") == self._token:
            self._etag = tag
            return True
        return False

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


def _conflict(exc: OSError) -> bool:
    """True when the store refused a conditional write because its condition did not hold."""
    code = getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code")
    return isinstance(exc, FileExistsError) or code in _CONFLICT_CODES or "pre-condition" in str(exc).lower()


def _conditional_replace(path) -> bool:
    """True when `path`'s store replaces an object only if its ETag matches (S3's If-Match, which
    s3fs passes on only when the installed botocore knows it; otherwise s3fs drops it silently)."""
    return path.protocol in ("s3", "s3a") and _botocore_knows_if_match()


@functools.lru_cache(maxsize=1)
def _botocore_knows_if_match() -> bool:
    try:
        import botocore.session

        model = botocore.session.get_session().get_service_model("s3").operation_model("PutObject")
        return "IfMatch" in model.input_shape.members
    except Exception:  # noqa: BLE001 - no botocore: not S3 through s3fs
        return False


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
