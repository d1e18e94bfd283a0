"""The server's durable state: File and Batch objects in SQLite, file contents as blobs, all
under `--state-dir`. A row is written only after its blob is on disk, so a restart never sees a
file it cannot read; batches keep their whole OpenAI object as JSON beside the columns queried."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path

from batchscore.errors import APIError, OutputLocked, StateError
from batchscore.io.atomic import refuse_link

log = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class Store:
    """Files and batches of one server; safe to use from the HTTP threads and the worker."""

    def __init__(self, state_dir: str | os.PathLike):
        self.root = Path(state_dir).resolve()  # job files and messages name absolute paths
        self.blobs = self.root / "files"
        self.incoming = self.root / "incoming"  # uploads being received; emptied at start
        self.work = self.root / "batches"  # each batch's job files, parts and outputs
        self.root.mkdir(parents=True, exist_ok=True)
        self._held = _hold(self.root / "serve.lock")  # before anything is touched: one server per state dir
        try:
            for folder in (self.blobs, self.incoming, self.work):
                folder.mkdir(parents=True, exist_ok=True)
            for stale in self.incoming.iterdir():
                stale.unlink(missing_ok=True)
            self._lock = threading.Lock()
            self._db = _open_db(self.root / "state.db")
        except BaseException:
            os.close(self._held)
            raise

    # --- files ------------------------------------------------------------------------------

    def incoming_path(self) -> Path:
        return self.incoming / uuid.uuid4().hex

    def add_file(self, received: Path, filename: str, purpose: str, file_id: str | None = None) -> dict:
        """Keep `received` (a finished upload or a batch result) as a File object. A fixed
        `file_id` replaces an earlier file of that id (a result written again after a restart)."""
        file_id = file_id or new_id("file-")
        with open(received, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(received, self.blobs / file_id)
        _fsync_dir(self.blobs)
        obj = {"id": file_id, "object": "file", "bytes": (self.blobs / file_id).stat().st_size,
               "created_at": now(), "filename": filename, "purpose": purpose, "status": "processed",
               "expires_at": None, "status_details": None}
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO files (id, object) VALUES (?, ?)", (file_id, json.dumps(obj)))
        return obj

    def file(self, file_id: str) -> dict:
        with self._lock:
            row = self._db.execute("SELECT object FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise APIError(404, f"No such File object: {file_id}", param="file_id", code="not_found")
        return json.loads(row[0])

    def file_path(self, file_id: str) -> Path:
        self.file(file_id)
        return self.blobs / file_id

    def list_files(self, limit: int, after: str | None, purpose: str | None, newest_first: bool
                   ) -> tuple[list[dict], bool]:
        """A page of files (of one `purpose`, when given); `after`: the last id of the previous page."""
        with self._lock:
            seq = None
            if after is not None:
                cursor = self._db.execute("SELECT seq FROM files WHERE id = ?", (after,)).fetchone()
                if cursor is None:
                    raise APIError(400, f"after: no such file {after!r}", param="after", code="invalid_value")
                seq = cursor[0]
            order, beyond = ("DESC", "<") if newest_first else ("ASC", ">")
            where = "" if seq is None else f"WHERE seq {beyond} {int(seq)}"
            rows = self._db.execute(f"SELECT object FROM files {where} ORDER BY seq {order}").fetchall()
        items = [obj for obj in (json.loads(r[0]) for r in rows) if purpose is None or obj["purpose"] == purpose]
        return items[:limit], len(items) > limit

    def delete_file(self, file_id: str) -> dict:
        self.file(file_id)
        with self._lock:
            self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        (self.blobs / file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    # --- batches ----------------------------------------------------------------------------

    def add_batch(self, obj: dict) -> dict:
        with self._lock:
            self._db.execute("INSERT INTO batches (id, status, object) VALUES (?, ?, ?)",
                             (obj["id"], obj["status"], json.dumps(obj)))
        log.info("batch %s: %s (%s, input %s)", obj["id"], obj["status"], obj.get("endpoint"), obj.get("input_file_id"))
        return obj

    def batch(self, batch_id: str) -> dict:
        with self._lock:
            row = self._db.execute("SELECT object FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
        return json.loads(row[0])

    def update_batch(self, batch_id: str, only_from: tuple[str, ...] | None = None, **fields) -> dict | None:
        """Set `fields` on a batch (a new `status` stamps its `<status>_at`) and return it; with
        `only_from`, only while its status is one of those (else None: someone moved it first)."""
        with self._lock:
            row = self._db.execute("SELECT object FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
            obj = json.loads(row[0])
            if only_from is not None and obj["status"] not in only_from:
                return None
            status = fields.get("status")
            if status is not None and status != obj["status"] and f"{status}_at" in obj:
                obj[f"{status}_at"] = now()
            before = obj["status"]
            obj.update(fields)
            self._db.execute("UPDATE batches SET status = ?, object = ? WHERE id = ?",
                             (obj["status"], json.dumps(obj), batch_id))
        if obj["status"] != before:  # one log line per state change, with what an operator asks next
            log.info("batch %s: %s -> %s%s", batch_id, before, obj["status"], _state_details(obj))
        return obj

    def list_batches(self, limit: int, after: str | None) -> tuple[list[dict], bool]:
        """Newest first; `after`: the id of the last batch of the previous page."""
        with self._lock:
            if after is None:
                rows = self._db.execute("SELECT object FROM batches ORDER BY seq DESC LIMIT ?", (limit + 1,)).fetchall()
            else:
                cursor = self._db.execute("SELECT seq FROM batches WHERE id = ?", (after,)).fetchone()
                if cursor is None:
                    raise APIError(400, f"after: no such batch {after!r}", param="after", code="invalid_value")
                rows = self._db.execute("SELECT object FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                                        (cursor[0], limit + 1)).fetchall()
        items = [json.loads(r[0]) for r in rows]
        return items[:limit], len(items) > limit

    def count_failure(self, batch_id: str) -> int:
        """Record one more unexpected failure of the worker on a batch; returns how many so far."""
        with self._lock:
            self._db.execute("INSERT INTO failures (id, attempts) VALUES (?, 1) "
                             "ON CONFLICT(id) DO UPDATE SET attempts = attempts + 1", (batch_id,))
            return self._db.execute("SELECT attempts FROM failures WHERE id = ?", (batch_id,)).fetchone()[0]

    def batches_in(self, statuses: tuple[str, ...]) -> list[dict]:
        """Batches in any of `statuses`, oldest first (the queue's order)."""
        marks = ",".join("?" * len(statuses))
        with self._lock:
            rows = self._db.execute(f"SELECT object FROM batches WHERE status IN ({marks}) ORDER BY seq",
                                    statuses).fetchall()
        return [json.loads(r[0]) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._held is not None:
            os.close(self._held)  # releases the state dir for the next server
            self._held = None


def _hold(path: Path) -> int:
    """An flock on `path` for as long as this server runs (the kernel drops it when the process
    dies, however); OutputLocked (exit 75) when another server holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            refuse_link(path, "the server's lock file")
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputLocked(f"another batchscore serve is using the state dir {path.parent}; two servers on "
                           "one state would run its batches twice. Stop it first, or give another --state-dir") from None
    return fd


def _open_db(path: Path) -> sqlite3.Connection:
    """The server's database, its tables made and checked; StateError naming the file when it is
    not a database of this shape (damaged, truncated, another program's)."""
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE IF NOT EXISTS files (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                   "id TEXT UNIQUE NOT NULL, object TEXT NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                   "id TEXT UNIQUE NOT NULL, status TEXT NOT NULL, object TEXT NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS failures (id TEXT PRIMARY KEY, attempts INTEGER NOT NULL)")
        problems = [row[0] for row in db.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError("; ".join(problems[:3]))
        db.execute("SELECT seq, id, object FROM files LIMIT 1").fetchall()
        db.execute("SELECT seq, id, status, object FROM batches LIMIT 1").fetchall()
        db.execute("SELECT id, attempts FROM failures LIMIT 1").fetchall()
    except sqlite3.DatabaseError as exc:  # OperationalError (a missing column) included
        db.close()
        raise StateError(f"{path}: the server's state cannot be read ({exc}). Restore it from a backup, or move "
                         "it away to start with no files and batches") from None
    return db


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state_details(batch: dict) -> str:
    """The request counts of a batch that has them, and the first error of a failed one."""
    counts = batch.get("request_counts") or {}
    said = f" (requests: {counts.get('total', 0)} total, {counts.get('completed', 0)} completed, " \
           f"{counts.get('failed', 0)} failed)" if counts.get("total") else ""
    errors = (batch.get("errors") or {}).get("data") or []
    if batch.get("status") == "failed" and errors:
        said += f": {errors[0].get('code')}: {str(errors[0].get('message'))[:300]}"
    return said
