"""The worker: runs queued batches one at a time, each through `batchscore run` in a child process.

A child process is the same path as the command line (plan, resume from parts, audit, metrics)
and can be stopped for a cancel: SIGTERM saves its parts. It also dies with the server
(PR_SET_PDEATHSIG), so a killed server leaves no run behind; the restarted worker starts the
`in_progress` batch again and `batchscore run` resumes it from its parts. A batch's jobs, their
inputs and outputs live in `<state-dir>/batches/<id>/`; the results become File objects only
once every job has finished, with fixed ids, so finishing twice replaces rather than doubles."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from batchscore.errors import EXIT_LOCKED
from batchscore.serve.requests import metadata_labels, sort_lines, write_job_input
from batchscore.serve.store import Store, now
from batchscore.serve.token_labels import TokenLabels

log = logging.getLogger(__name__)

LOCK_RETRY_S = 2.0  # a run still saving (a server killed a moment ago) holds the output's lock


@dataclass
class WorkerSettings:
    model: str
    sets: list[str] = field(default_factory=list)  # `--set KEY=VALUE` for every job, as `batchscore run` takes them
    max_requests: int = 50_000
    poll_s: float = 0.5


class Worker:
    def __init__(self, store: Store, settings: WorkerSettings):
        self.store, self.settings = store, settings
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._child: subprocess.Popen | None = None
        self._token_labels = TokenLabels(settings.model)
        self._thread = threading.Thread(target=self._loop, name="batchscore-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """A batch was created or cancelled: look at the queue now."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)  # saves its parts; the next start resumes
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self._next()
                if batch is not None:
                    self._process(batch)
                    continue
            except Exception:  # a bug in one batch must not stop the queue; the batch stays where it was
                log.exception("worker: unexpected error")
                self._stop.wait(5)
            self._wake.wait(self.settings.poll_s)
            self._wake.clear()

    def _next(self) -> dict | None:
        """Settle what needs no run (cancels of queued batches, expiries), then the batch to run:
        one already started first (a restart), else the oldest queued."""
        for batch in self.store.batches_in(("cancelling",)):
            self.store.update_batch(batch["id"], only_from=("cancelling",), status="cancelled")
        for batch in self.store.batches_in(("validating",)):
            if batch["expires_at"] is not None and now() >= batch["expires_at"]:
                self.store.update_batch(batch["id"], only_from=("validating",), status="expired")
        started = self.store.batches_in(("in_progress", "finalizing"))
        queued = self.store.batches_in(("validating",))
        return (started or queued or [None])[0]

    def _process(self, batch: dict) -> None:
        batch_id = batch["id"]
        work = self.store.work / batch_id
        source = work / "input.jsonl"
        shown_as = (work / "filename").read_text(encoding="utf-8")
        sorted_input = sort_lines(source, shown_as, batch["endpoint"], self.settings.model,
                                  metadata_labels(batch.get("metadata")), self.settings.max_requests,
                                  self._token_labels)
        counts = {"total": sorted_input.total, "completed": 0, "failed": 0}
        if sorted_input.problems:
            self.store.update_batch(batch_id, only_from=("validating",), status="failed", request_counts=counts,
                                    errors={"object": "list", "data": sorted_input.problems})
            return
        if batch["status"] == "validating":
            if self.store.update_batch(batch_id, only_from=("validating",), status="in_progress",
                                       request_counts=counts) is None:
                return  # cancelled meanwhile
        outputs = []
        for k, job in enumerate(sorted_input.jobs):
            folder = work / f"job{k}"
            result = self._run_job(batch_id, folder, source, shown_as, job)
            if result != "done":
                return
            outputs.append((folder / "output.jsonl", str(folder / "input" / shown_as)))
        self._finish(batch_id, work, outputs, sorted_input, shown_as)

    def _run_job(self, batch_id: str, folder: Path, source: Path, shown_as: str, job) -> str:
        """Run one job to its end: "done", "cancelled", "failed" or "stopped" (server shutting down)."""
        job_input = folder / "input" / shown_as  # named as uploaded: messages name that file
        if not job_input.exists():  # written once: a resume checks the input is unchanged
            write_job_input(source, folder / "input.tmp", job.lines)
            job_input.parent.mkdir(exist_ok=True)
            os.replace(folder / "input.tmp", job_input)
        config = {"input": {"path": str(job_input), "format": "openai_batch"}, "model": self.settings.model,
                  "output": {"path": str(folder / "output.jsonl"), "format": "openai_batch", "max_error_rate": 1.0}}
        if job.labels is not None:
            config["labels"] = job.labels
        (folder / "job.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        command = [sys.executable, "-m", "batchscore.cli", "run", str(folder / "job.yaml"), "-q",
                   "--metrics", str(folder / "metrics.json")]
        for item in self.settings.sets:
            command += ["--set", item]
        while True:
            with (folder / "run.log").open("ab") as logfile:
                logged = logfile.tell()  # this run's lines start here
                self._child = subprocess.Popen(command, stdout=logfile, stderr=subprocess.STDOUT,
                                               env={**os.environ, "TQDM_DISABLE": "1"}, preexec_fn=_die_with_parent)
                code = self._wait(batch_id)
                self._child = None
            if code == "cancelled":
                self.store.update_batch(batch_id, status="cancelled")
                return "cancelled"
            if self._stop.is_set():
                return "stopped"
            if code == EXIT_LOCKED:  # the run of a server killed a moment ago is still saving
                time.sleep(LOCK_RETRY_S)
                continue
            if code != 0:
                with (folder / "run.log").open("rb") as logfile:
                    logfile.seek(logged)
                    lines = logfile.read().decode("utf-8", "replace").strip().splitlines() or ["(no output)"]
                at = max([i for i, line in enumerate(lines) if line.startswith("error:")] or [len(lines) - 1])
                said = " ".join(line.strip() for line in lines[at:])  # the CLI's error and its listed problems
                message = f"batchscore run exited {code}: {said[:1000]}"
                self.store.update_batch(batch_id, status="failed", errors={"object": "list", "data": [
                    {"code": "run_failed", "message": message, "param": None, "line": None}]})
                return "failed"
            return "done"

    def _wait(self, batch_id: str):
        """The child's exit code, or "cancelled" after stopping it for a cancel."""
        child = self._child
        while True:
            try:
                return child.wait(timeout=self.settings.poll_s)
            except subprocess.TimeoutExpired:
                pass
            if self._stop.is_set():
                child.send_signal(signal.SIGTERM)
                return child.wait()
            if self.store.batch(batch_id)["status"] == "cancelling":
                child.send_signal(signal.SIGTERM)  # saves its parts and exits
                child.wait()
                return "cancelled"

    def _finish(self, batch_id: str, work: Path, outputs: list[tuple[Path, str]], sorted_input, shown_as: str) -> None:
        """Gather every job's output and error lines into the batch's two files, check each
        custom_id is in exactly one of them once, and complete the batch. Messages name the
        uploaded file as the user named it, not the job's copy inside the state folder."""
        if self.store.update_batch(batch_id, only_from=("in_progress", "finalizing"), status="finalizing") is None:
            return
        ok_lines, error_lines = [], list(sorted_input.answered)
        for output, job_input in outputs:
            ok_lines += _lines(output)
            copy_name = json.dumps(job_input)[1:-1]  # as it is written inside a JSON string
            error_lines += [line.replace(copy_name, shown_as) for line in _lines(output.with_name("output.errors.jsonl"))]
        seen = Counter(json.loads(line)["custom_id"] for line in ok_lines + error_lines)
        doubled = [custom_id for custom_id, n in seen.items() if n > 1 and custom_id is not None]
        if len(ok_lines) + len(error_lines) != sorted_input.total or doubled:
            self.store.update_batch(batch_id, status="failed", errors={"object": "list", "data": [
                {"code": "internal_error", "param": None, "line": None,
                 "message": f"results do not match the requests ({len(ok_lines)} + {len(error_lines)} lines for "
                            f"{sorted_input.total} requests; doubled: {doubled[:3]})"}]})
            return
        stem = batch_id.removeprefix("batch_")
        output_id = self._result_file(work / "output.part", ok_lines, f"{batch_id}_output.jsonl", f"file-{stem}-output")
        error_id = (self._result_file(work / "errors.part", error_lines, f"{batch_id}_error.jsonl", f"file-{stem}-error")
                    if error_lines else None)
        counts = {"total": sorted_input.total, "completed": len(ok_lines), "failed": len(error_lines)}
        self.store.update_batch(batch_id, status="completed", output_file_id=output_id, error_file_id=error_id,
                                request_counts=counts)

    def _result_file(self, path: Path, lines: list[str], filename: str, file_id: str) -> str:
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return self.store.add_file(path, filename, "batch_output", file_id=file_id)["id"]


def stage_input(store: Store, batch_id: str, file_id: str) -> None:
    """Keep the batch's own copy of its input (a hard link where it can): deleting the uploaded
    file must not break a queued or running batch."""
    from batchscore.serve.requests import safe_name

    work = store.work / batch_id
    work.mkdir(parents=True, exist_ok=True)
    source = store.file_path(file_id)
    try:
        os.link(source, work / "input.jsonl")
    except OSError:
        shutil.copyfile(source, work / "input.jsonl")
    (work / "filename").write_text(safe_name(store.file(file_id)["filename"]), encoding="utf-8")


def _lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the server dies (Linux), so it saves its parts
    instead of running on unseen and holding the output's lock."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
