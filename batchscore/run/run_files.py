"""A run's own files, written however it ends: the `--metrics` JSON, the `--metrics-prom`
Prometheus file and the HTML report. The CLI's `run` and the Python API (`run_job(...,
metrics=...)`, `score_dataframe(..., metrics=...)`) share this one implementation.

- Every exit writes the metrics: `status: ok` and the summary, or the error, its exit code and
  (after an error-rate or audit failure) the summary; the report of a written output.
- A run refused by another run's lock (exit 75) writes nothing: those paths belong to the run
  that holds the output.
- SIGTERM at any moment (reading, planning, assembling, the exactness audit) ends the run as an
  interruption (exit 130), so the metrics are still written.
- A path that may not be written (output/write_paths.py) is refused before the run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from batchscore.errors import (EXIT_CONFIG, EXIT_ENGINE, EXIT_ENVIRONMENT, EXIT_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED,
                               EXIT_OUTPUT, BatchscoreError, OutputLocked, Terminated, wrong_environment)

log = logging.getLogger("batchscore")

TERMINATED = "interrupted by SIGTERM; the rows scored so far are saved — rerun the same command to resume"

# Commands whose object-store and file errors are about what they read (exit 3), not what they write (6).
_READING_COMMANDS = ("plan", "report")


def exit_status(exc: BaseException, command: str | None = None) -> tuple[int, str]:
    """The documented exit code and the message for an exception that ended `command` (README,
    errors.py): the library's own errors carry theirs; a third-party error that escaped the
    library is mapped by kind (an object store that cannot be reached, a YAML error, a full
    disk); anything else is a bug, exit 1."""
    from batchscore.io.storage import store_error_types

    if isinstance(exc, BatchscoreError):
        return exc.exit_code, str(exc)
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (Terminated)
        return EXIT_INTERRUPTED, str(exc) or "interrupted"
    reading = command in _READING_COMMANDS
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, store_error_types()):
        return ((EXIT_INPUT, f"the input's object store cannot be reached or refused: {text}") if reading
                else (EXIT_OUTPUT, f"the output's object store cannot be reached or refused: {text}"))
    if _is_yaml_error(exc):
        return EXIT_CONFIG, f"malformed YAML: {text}"
    if isinstance(exc, OSError):
        return (EXIT_INPUT if reading else EXIT_OUTPUT), f"{type(exc).__name__}: {text}"
    if isinstance(exc, MemoryError):
        return EXIT_ENGINE, "out of memory"
    environment = wrong_environment(exc)
    if environment is not None:
        return EXIT_ENVIRONMENT, environment
    return EXIT_INTERNAL, (f"unexpected {type(exc).__name__}: {text} (a bug in batchscore; "
                           "`batchscore -v` shows where)")


def _is_yaml_error(exc: BaseException) -> bool:
    yaml = sys.modules.get("yaml")
    return yaml is not None and isinstance(exc, yaml.YAMLError)


@contextmanager
def interrupt_on_sigterm():
    """SIGTERM raises Terminated wherever the run is (as SIGINT raises KeyboardInterrupt),
    instead of killing the process with 143 and no metrics. The scoring loop installs its own,
    gentler handler (run/local.py: finish the batch, save it) for its duration. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(TERMINATED)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class RunFiles:
    """The metrics, Prometheus file and report of one run (each optional; `report`: True for
    `_<output>.report.html`, or the report's path). `job`: the job file, when there is one (its
    stem labels the Prometheus metrics; the paths are checked against it); `warn`: where a file
    that is not written is said (default: the log)."""

    def __init__(self, metrics: str | None = None, metrics_prom: str | None = None, report: bool | str = False,
                 job: str | None = None, warn: Callable[[str], None] | None = None):
        self.metrics, self.metrics_prom, self.report, self.job = metrics, metrics_prom, report, job
        self.warn = warn or log.warning
        self.refused = False
        self.summary = None  # set once the run ended well and `ok` recorded it
        self.locked = False  # another run holds the output: its files are not ours to write
        self.checked = False  # against the job's input and output (the job file could be read)

    @property
    def any(self) -> bool:
        return bool(self.metrics or self.metrics_prom or self.report)

    def check(self, config=None) -> None:
        """Refuse the paths before any work: against the job file alone, or against `config`'s
        input and output. Raises WritePathError; afterwards nothing is written."""
        from batchscore.errors import OutputError, WritePathError
        from batchscore.output.write_paths import Protected, check_run_files

        try:
            if config is None:
                protected = Protected(inputs=(self.job,) if self.job else ())
                protected.check("--metrics", self.metrics)
                protected.check("--metrics-prom", self.metrics_prom)
            else:
                from batchscore.formats import suffix_formats
                from batchscore.run.open import output_files

                check_run_files(config, read_suffixes=tuple(suffix_formats()), metrics=self.metrics,
                                metrics_prom=self.metrics_prom, output=output_files(config))
                self.checked = True
            if self.report:
                from batchscore.report import require_matplotlib

                require_matplotlib()  # before the run, not after hours of scoring
                if isinstance(self.report, str) and config is not None:
                    from batchscore.output.write_paths import check_report_path

                    check_report_path("report", self.report, config.output.path)
        except (WritePathError, OutputError):  # a path it may not, or cannot, write
            self.refused = True
            raise

    def write(self, data: dict) -> None:
        from batchscore.io.atomic import atomic_write
        from batchscore.output.write_paths import METRICS_MARK, PROM_MARK

        if self.refused:
            return
        if self.metrics and self._may_write(self.metrics, METRICS_MARK):
            atomic_write(self.metrics, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2)))
        if self.metrics_prom and self._may_write(self.metrics_prom, PROM_MARK):
            from batchscore.output.prometheus import write_prometheus

            write_prometheus(data, self.metrics_prom, job=Path(self.job).stem if self.job else "batchscore")

    def live_writer(self) -> Callable[[dict], None] | None:
        """Where the run's in-progress figures go while it scores (run/live_figures.py): the
        Prometheus file, refreshed; None without one (the JSON is written once, at the end)."""
        from batchscore.output.write_paths import PROM_MARK

        if self.refused or not self.metrics_prom or not self._may_write(self.metrics_prom, PROM_MARK):
            return None
        from batchscore.output.prometheus import write_prometheus

        job = Path(self.job).stem if self.job else "batchscore"
        return lambda data: write_prometheus(data, self.metrics_prom, job=job)

    def _may_write(self, path: str, mark: bytes) -> bool:
        """A path checked against the job's files, or (the job file could not be read, so its
        input and output are unknown) one that is new or holds an earlier run's metrics."""
        from batchscore.output.write_paths import replaceable

        if self.checked or replaceable(path, mark):
            return True
        self.warn(f"{path} not written: it holds something else, and without a readable job file its input "
                  "and output are unknown")
        return False

    def write_report(self, summary) -> Path | None:
        if not (self.report and summary is not None and summary.complete):
            return None
        from batchscore.report import write_report as write_html

        html_path = self.report if isinstance(self.report, str) else None  # True: _<output>.report.html
        return write_html(summary.output_path, metrics=summary.to_dict(), html_path=html_path)

    def ok(self, summary) -> Path | None:
        """Record a run that ended well; returns the report's path (None without a report)."""
        path = self.write_report(summary)  # a report that cannot be written fails the run, recorded below
        self.write({"status": "ok", "exit_code": 0, **summary.to_dict()})
        self.summary = summary
        return path

    def exit_on_sigterm(self):
        """Outside the run's block (`on_every_exit`: before it, and after it while the command
        prints), a SIGTERM still ends the run as an interruption (exit 130) recorded in the
        metrics (with the finished run's summary), never as a 143 that leaves metrics saying ok.
        Installed before the block, which restores it when it ends; returns the handler it
        replaced, for the command to restore as it returns. Main thread only."""
        def handler(signum, frame):
            self.failed(Terminated(TERMINATED))
            print(f"error: {TERMINATED}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_INTERRUPTED)

        if threading.current_thread() is not threading.main_thread():
            return None
        return signal.signal(signal.SIGTERM, handler)

    def failed(self, exc: BaseException) -> Path | None:
        """Record a run that ended with `exc`; returns the report's path when one was written.
        Never raises: the run's own error is the one to exit with."""
        if isinstance(exc, OutputLocked) or self.locked:  # the holder's files, not ours
            self.locked = True
            if self.any:
                self.warn("metrics and report not written: another run holds this output and writes them")
            return None
        code, message = exit_status(exc, "run")
        summary = getattr(exc, "summary", None) or self.summary  # a SIGTERM after a finished run
        try:
            self.write({"status": "failed", "exit_code": code, "error": message,
                        **(summary.to_dict() if summary is not None else {})})
        except Exception as write_exc:  # noqa: BLE001
            self.warn(f"no metrics written: {exit_status(write_exc, 'run')[1]}")
        if self.summary is not None:  # its report is written already
            return None
        try:  # the output was written (error rate, audit): its report matters most now
            return self.write_report(summary)
        except Exception as report_exc:  # noqa: BLE001
            self.warn(f"no report: {exit_status(report_exc, 'run')[1]}")
            return None

    @contextmanager
    def on_every_exit(self, report_written: Callable[[Path], None] | None = None):
        """Write the files however the block ends (SIGTERM included: exit 130), then re-raise."""
        with interrupt_on_sigterm():
            try:
                yield self
            except (Exception, KeyboardInterrupt) as exc:
                path = self.failed(exc)
                if path and report_written:
                    report_written(path)
                raise
