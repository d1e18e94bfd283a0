"""The worker: runs queued batches one at a time, each through `batchscore run` in a child process.

A child process is the same path as the command line (plan, resume from parts, audit, metrics)
and can be stopped for a cancel: SIGTERM saves its parts. It also dies with the server
(PR_SET_PDEATHSIG), so a killed server leaves no run behind; the restarted worker starts the
`in_progress` batch again and `batchscore run` resumes it from its parts. A batch's jobs, their
inputs and outputs live in `<state-dir>/batches/<id>/`; the results become File objects only
once every job has finished (or the batch is cancelled), with fixed ids, so finishing twice
replaces rather than doubles.

While a job runs, its request counts grow from the parts it saves (serve/progress.py). A
cancelled batch keeps what was done: the finished jobs' lines, the stopped job's output
assembled from its parts (serve/partial.py), and every request that never ran in the error file
as `batch_cancelled`, as the Batch API answers them."""

from __future__ import annotations

import json
import logging
import os
import re
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

from batchscore.errors import EXIT_AUDIT, EXIT_ERROR_RATE, EXIT_LOCKED, NOT_RETRYABLE
from batchscore.formats.openai_batch import line_request_id
from batchscore.output.layout import OutputFiles
from batchscore.serve.progress import JobProgress, RecordProgress
from batchscore.serve.results import (batch_usage, cancelled_if_not_run, cancelled_line, custom_ids, job_lines, lines,
                                      uploaded_name)
from batchscore.serve.requests import (calibration_set, metadata_calibration, metadata_labels, sort_lines,
                                       write_job_input)
from batchscore.serve.store import Store, now
from batchscore.serve.token_labels import TokenLabels

log = logging.getLogger(__name__)

PROGRESS_PART_S = 5.0  # a running job saves a part at least this often: the counts polled move (--set wins)
RUN_ATTEMPTS = 3  # a job's run that exits retryably (killed, stopped, out of memory) runs again, from its parts
LOCK_RETRY_S = 2.0  # a run still saving (a server killed a moment ago) holds the output's lock
OUTPUT_WRITTEN = (EXIT_ERROR_RATE, EXIT_AUDIT)  # a run that exits so has written its output whole
MAX_ATTEMPTS = 3  # a batch the worker fails on this often (an unexpected error, restarts included) is failed


@dataclass
class WorkerSettings:
    model: str
    sets: list[str] = field(default_factory=list)  # `--set KEY=VALUE` for every job, as `batchscore run` takes them
    max_requests: int = 50_000
    poll_s: float = 0.5
    served_names: list[str] = field(default_factory=list)  # names requests may give the model; [] : its own

    @property
    def names(self) -> list[str]:
        """The names a request's `body.model` may give (the first is shown on batches and answers)."""
        return self.served_names or [self.model]
    retry_s: float = 5.0  # the pause after an unexpected error in a batch, before its next attempt


class Worker:
    def __init__(self, store: Store, settings: WorkerSettings):
        self.store, self.settings = store, settings
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._child: subprocess.Popen | None = None
        self._shown: dict[str, dict] = {}  # batch id -> the request counts last stored
        self._run_errors: dict[str, list[dict]] = {}  # batch id -> errors of runs that wrote their output
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
            except Exception:  # the store itself failed: wait, then look again
                log.exception("worker: reading the queue")
                self._stop.wait(self.settings.retry_s)
                continue
            if batch is not None:
                self._guarded(batch, self._process)
                continue
            self._wake.wait(self.settings.poll_s)
            self._wake.clear()

    def _guarded(self, batch: dict, step) -> None:
        """`step(batch)`, where an unexpected error (a bug, something a client sent that nothing
        foresaw) costs that batch one of its MAX_ATTEMPTS, counted in the store across restarts:
        then the batch is failed, so one batch can never hold the queue."""
        try:
            step(batch)
        except Exception as exc:
            log.exception("worker: batch %s: unexpected error", batch["id"])
            attempts = self.store.count_failure(batch["id"])
            if attempts < MAX_ATTEMPTS:
                self._stop.wait(self.settings.retry_s)
                return
            message = (f"the server failed on this batch {attempts} times ({type(exc).__name__}; its log says "
                       "where); it is not retried")
            self.store.update_batch(batch["id"], only_from=("validating", "in_progress", "finalizing", "cancelling"),
                                    status="failed", errors={"object": "list", "data": [
                                        {"code": "internal_error", "message": message, "param": None,
                                         "line": None}]})

    def _next(self) -> dict | None:
        """Settle what needs no run (cancels of batches not running, expiries), then the batch to
        run: one already started first (a restart), else the oldest queued."""
        for batch in self.store.batches_in(("cancelling",)):
            self._guarded(batch, self._cancel)
        for batch in self.store.batches_in(("validating",)):
            if batch["expires_at"] is not None and now() >= batch["expires_at"]:
                self.store.update_batch(batch["id"], only_from=("validating",), status="expired")
        started = self.store.batches_in(("in_progress", "finalizing"))
        queued = self.store.batches_in(("validating",))
        return (started or queued or [None])[0]

    @property
    def _shown_model(self) -> str | None:
        """The model answers show when it is served under other names (vLLM: the first name)."""
        return self.settings.served_names[0] if self.settings.served_names else None

    def _sorted(self, batch: dict):
        work = self.store.work / batch["id"]
        return sort_lines(work / "input.jsonl", uploaded_name(work), batch["endpoint"], self.settings.names,
                          metadata_labels(batch.get("metadata")), self.settings.max_requests, self._token_labels)

    def _process(self, batch: dict) -> None:
        batch_id = batch["id"]
        work = self.store.work / batch_id
        source, shown_as = work / "input.jsonl", uploaded_name(work)
        sorted_input = self._sorted(batch)
        if sorted_input.problems:
            self.store.update_batch(batch_id, only_from=("validating",), status="failed",
                                    request_counts={"total": sorted_input.total, "completed": 0, "failed": 0},
                                    errors={"object": "list", "data": sorted_input.problems})
            return
        done = Counter(failed=len(sorted_input.answered))  # requests of finished jobs, and the server's own answers
        if batch["status"] == "validating":
            if self.store.update_batch(batch_id, only_from=("validating",), status="in_progress",
                                       request_counts=_counts(sorted_input.total, done)) is None:
                return  # cancelled meanwhile
        for k, job in enumerate(sorted_input.jobs):
            folder = work / f"job{k}"
            # a decision job's parts hold reads (one per question): a request counts once all of its are saved
            progress = JobProgress(folder / "output.jsonl") if job.labels is not None else \
                RecordProgress(folder / "output.jsonl", folder / "job.yaml")
            result = self._run_job(batch_id, folder, source, shown_as, job,
                                   lambda progress=progress: self._show(batch_id, sorted_input.total, done, progress))
            if result == "cancelled":
                self._cancel(self.store.batch(batch_id))
            if result != "done":
                return
            done.update(completed=len(lines(folder / "output.jsonl")),
                        failed=len(lines(folder / "output.errors.jsonl")))
            self._show(batch_id, sorted_input.total, done)
        self._finish(batch_id, sorted_input)

    def _show(self, batch_id: str, total: int, done: Counter, progress: JobProgress | None = None) -> None:
        """The batch's request counts: the finished jobs' plus what the running job has saved."""
        counts = done.copy()
        if progress is not None:
            completed, failed = progress.counts()
            counts.update(completed=completed, failed=failed)
        shown = _counts(total, counts)
        if shown != self._shown.get(batch_id):
            self.store.update_batch(batch_id, only_from=("in_progress",), request_counts=shown)
            self._shown = {batch_id: shown}  # one batch runs at a time

    def _run_job(self, batch_id: str, folder: Path, source: Path, shown_as: str, job, on_poll=None) -> str:
        """Run one job to its end: "done", "cancelled", "failed" or "stopped" (server shutting down).
        `on_poll` is called while it runs, every `poll_s`."""
        job_input = folder / "input" / shown_as  # named as uploaded: messages name that file
        if not job_input.exists():  # written once: a resume checks the input is unchanged
            write_job_input(source, folder / "input.tmp", job.lines)
            job_input.parent.mkdir(exist_ok=True)
            os.replace(folder / "input.tmp", job_input)
        config = {"input": {"path": str(job_input), "format": "openai_batch"}, "model": self.settings.model,
                  "output": {"path": str(folder / "output.jsonl"), "format": "openai_batch", "max_error_rate": 1.0,
                             "part_seconds": PROGRESS_PART_S}}
        if job.labels is not None:
            config["labels"] = job.labels
        (folder / "job.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        # -v: the run's own INFO log (plan, resume, audit) is kept in the job's run.log
        command = [sys.executable, "-m", "batchscore.cli", "-v", "run", str(folder / "job.yaml"), "-q",
                   "--metrics", str(folder / "metrics.json")]
        for item in self._job_sets(batch_id, job):
            command += ["--set", item]
        retries = 0  # reruns after a retryable exit (a lock still held is waited for, not counted)
        while True:
            with (folder / "run.log").open("ab") as logfile:
                logged = logfile.tell()  # this run's lines start here
                self._child = subprocess.Popen(command, stdout=logfile, stderr=subprocess.STDOUT,
                                               env={**os.environ, "TQDM_DISABLE": "1"}, preexec_fn=_die_with_parent)
                code = self._wait(batch_id, on_poll)
                self._child = None
            if code == "cancelled":
                return "cancelled"
            if self._stop.is_set():
                return "stopped"
            if code == EXIT_LOCKED:  # the run of a server killed a moment ago is still saving
                time.sleep(LOCK_RETRY_S)
                continue
            if code != 0 and _retryable(code) and retries < RUN_ATTEMPTS - 1:
                retries += 1
                log.warning("batch %s: its run exited %s (%s); running it again, resuming from its saved parts "
                            "(attempt %d of %d)", batch_id, code, _exit_name(code), retries + 1, RUN_ATTEMPTS)
                continue
            if code != 0:
                with (folder / "run.log").open("rb") as logfile:
                    logfile.seek(logged)
                    lines = logfile.read().decode("utf-8", "replace").strip().splitlines() or ["(no output)"]
                at = max([i for i, line in enumerate(lines) if line.startswith("error:")] or [len(lines) - 1])
                said = " ".join(line.strip() for line in lines[at:])  # the CLI's error and its listed problems
                message = self._for_client(f"batchscore run exited {code}: {said[:1000]}", job_input, shown_as)
                error = {"code": "run_failed", "message": message, "param": None, "line": None}
                if code in OUTPUT_WRITTEN and OutputFiles(str(folder / "output.jsonl")).marker.exists():
                    self._run_errors.setdefault(batch_id, []).append(error)  # its lines stay the batch's
                    return "done"
                self._end_early(self.store.batch(batch_id), "failed", ("in_progress",), [error])
                return "failed"
            return "done"

    def _for_client(self, message: str, job_input: Path, shown_as: str) -> str:
        """A run's message as a client may read it: the job's copy of the input named as uploaded,
        any other path of the server's by its file name alone."""
        message = message.replace(str(job_input), shown_as)
        return re.sub(re.escape(str(self.store.root)) + r"[^\s'\",;:)]*", lambda m: Path(m.group()).name, message)

    def _wait(self, batch_id: str, on_poll=None):
        """The child's exit code, or "cancelled" after stopping it for a cancel."""
        child = self._child
        while True:
            try:
                return child.wait(timeout=self.settings.poll_s)
            except subprocess.TimeoutExpired:
                pass
            if on_poll is not None:
                try:
                    on_poll()
                except Exception:  # the counts shown are a courtesy: never a reason to stop the run
                    log.exception("worker: reading the progress of %s", batch_id)
            if self._stop.is_set():
                child.send_signal(signal.SIGTERM)
                return child.wait()
            if self.store.batch(batch_id)["status"] == "cancelling":
                child.send_signal(signal.SIGTERM)  # saves its parts and exits
                child.wait()
                return "cancelled"

    def _finish(self, batch_id: str, sorted_input) -> None:
        """Gather every job's output and error lines into the batch's two files, check each
        custom_id is in exactly one of them once, and complete the batch with its usage."""
        if self.store.update_batch(batch_id, only_from=("in_progress", "finalizing"), status="finalizing") is None:
            return
        work = self.store.work / batch_id
        ok_lines, error_lines = job_lines(work, len(sorted_input.jobs), shown_model=self._shown_model)
        error_lines = sorted_input.answered + error_lines
        if not self._checked(batch_id, ok_lines, error_lines, sorted_input.total):
            return
        usage = batch_usage(ok_lines)
        files = self._result_files(batch_id, ok_lines, error_lines)
        counts = {"total": sorted_input.total, "completed": len(ok_lines), "failed": len(error_lines)}
        run_errors = self._run_errors.pop(batch_id, None)
        if run_errors:  # a run wrote its output and failed after (its audit): failed, its lines kept
            self.store.update_batch(batch_id, only_from=("finalizing",), status="failed", request_counts=counts,
                                    usage=usage, errors={"object": "list", "data": run_errors}, **files)
            return
        if self.store.update_batch(batch_id, only_from=("finalizing",), status="completed", request_counts=counts,
                                   usage=usage, **files) is None:  # cancelled while finalizing: all of it ran
            self.store.update_batch(batch_id, only_from=("cancelling",), status="cancelled", request_counts=counts,
                                    **files)

    def _cancel(self, batch: dict) -> None:
        """End a cancelling batch (its run stopped, or none running) with what was done (`_end_early`)."""
        self._end_early(batch, "cancelled", ("cancelling",))

    def _end_early(self, batch: dict, status: str, only_from: tuple[str, ...], errors: list | None = None) -> None:
        """End a batch before all of its jobs ran — cancelled, or failed (a run that failed for good) —
        with what was done: the finished jobs' lines, a stopped job's lines assembled from its parts,
        and each request that never ran as a `batch_cancelled` line in the error file. A batch that
        never started has no files. `errors`: the batch's own (a failed run's message)."""
        batch_id = batch["id"]
        listed = {"errors": {"object": "list", "data": errors}} if errors else {}
        if batch.get("in_progress_at") is None:
            self.store.update_batch(batch_id, only_from=only_from, status=status, **listed)
            return
        work = self.store.work / batch_id
        sorted_input = self._sorted(batch)
        ok_lines, error_lines = [], list(sorted_input.answered)
        for k, job in enumerate(sorted_input.jobs):
            folder = work / f"job{k}"
            finished = OutputFiles(str(folder / "output.jsonl")).marker.exists()
            if finished or self._partial_output(batch_id, folder, job):
                ok, failed = job_lines(work, 1, folder, shown_model=self._shown_model)
                ok_lines += ok
                error_lines += [cancelled_if_not_run(line) for line in failed]
            else:  # nothing of it was saved
                error_lines += [cancelled_line(custom_id, number)
                                for number, custom_id in custom_ids(work / "input.jsonl", job.lines)]
        if not self._checked(batch_id, ok_lines, error_lines, sorted_input.total):
            return
        files = self._result_files(batch_id, ok_lines, error_lines)
        counts = {"total": sorted_input.total, "completed": len(ok_lines), "failed": len(error_lines)}
        self.store.update_batch(batch_id, only_from=only_from, status=status, request_counts=counts, **files, **listed)

    def _job_sets(self, batch_id: str, job) -> list[str]:
        """The `--set`s of one job: the server's, calibration's only for chat/completions lines
        (decision lines calibrate per question, in a questions job), then the batch's own
        `calibrate` (its metadata) last, so it wins."""
        if job.labels is None:
            return [item for item in self.settings.sets if not calibration_set(item)]
        method = metadata_calibration(self.store.batch(batch_id).get("metadata"), self.settings.sets)
        return list(self.settings.sets) + ([f"score.calibrate={method}"] if method else [])

    def _partial_output(self, batch_id: str, folder: Path, job) -> bool:
        """Write a stopped job's output from its parts (serve/partial.py, a child process as
        its run was); False when nothing of it was saved."""
        if not (folder / "job.yaml").exists() or not OutputFiles(str(folder / "output.jsonl")).parts.exists():
            return False
        command = [sys.executable, "-m", "batchscore.serve.partial", str(folder / "job.yaml")]
        for item in self._job_sets(batch_id, job):
            command += ["--set", item]
        for _ in range(30):  # the stopped run may still be releasing the output's lock
            with (folder / "run.log").open("ab") as logfile:
                code = subprocess.run(command, stdout=logfile, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                                      env={**os.environ, "TQDM_DISABLE": "1"}).returncode
            if code != EXIT_LOCKED:
                break
            time.sleep(LOCK_RETRY_S)
        if code not in (0, 1):
            log.error("batch job %s: writing its partial output exited %s (see %s); its requests are cancelled",
                      folder, code, folder / "run.log")
        return code == 0

    def _checked(self, batch_id: str, ok_lines: list[str], error_lines: list[str], total: int) -> bool:
        """Every request once across the two files, else the batch fails (a bug, said as one)."""
        seen = Counter(line_request_id(json.loads(line)) for line in ok_lines + error_lines)
        doubled = [custom_id for custom_id, n in seen.items() if n > 1 and custom_id is not None]
        if len(ok_lines) + len(error_lines) == total and not doubled:
            return True
        self.store.update_batch(batch_id, status="failed", errors={"object": "list", "data": [
            {"code": "internal_error", "param": None, "line": None,
             "message": f"results do not match the requests ({len(ok_lines)} + {len(error_lines)} lines for "
                        f"{total} requests; doubled: {doubled[:3]})"}]})
        return False

    def _result_files(self, batch_id: str, ok_lines: list[str], error_lines: list[str]) -> dict:
        """The batch's output and error files as File objects, with fixed ids (written again after
        a restart, they replace); as the Batch API, no output file when no request succeeded
        (`output_file_id` null) and no error file when none failed."""
        work, stem = self.store.work / batch_id, batch_id.removeprefix("batch_")
        output_id = error_id = None
        if ok_lines:
            output_id = self._result_file(work / "output.part", ok_lines, f"{batch_id}_output.jsonl",
                                          f"file-{stem}-output")
        if error_lines:
            error_id = self._result_file(work / "errors.part", error_lines, f"{batch_id}_error.jsonl",
                                         f"file-{stem}-error")
        return {"output_file_id": output_id, "error_file_id": error_id}

    def _result_file(self, path: Path, lines: list[str], filename: str, file_id: str) -> str:
        path.write_text("".join(_encodable(line) + "\n" for line in lines), encoding="utf-8")
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


def _encodable(line: str) -> str:
    """A result line as UTF-8 can write it: as it is, or (a lone surrogate a client sent) as
    ASCII JSON, the same value with its non-ASCII characters escaped."""
    try:
        line.encode("utf-8")
        return line
    except UnicodeEncodeError:
        return json.dumps(json.loads(line))


def _counts(total: int, done: Counter) -> dict:
    return {"total": total, "completed": done["completed"], "failed": done["failed"]}


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the server dies (Linux), so it saves its parts
    instead of running on unseen and holding the output's lock."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _retryable(code: int) -> bool:
    """A run's exit that a rerun may end otherwise (README's exit codes): killed by a signal (the
    OOM killer's SIGKILL), interrupted (130), the engine or a lock (5, 75), never a bad job, input,
    output or a bug."""
    return code < 0 or code not in NOT_RETRYABLE


def _exit_name(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "retryable"
