"""Every error batchscore raises on purpose, under one base that carries the CLI's exit code.

The CLI maps any `BatchscoreError` to `error: <message>` and its `exit_code`; anything else is a
bug and keeps its traceback. Pure Python: every module (the planner too) may import this one.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CONFIG = 2  # the job file, its labels, template, model or resume state
EXIT_INPUT = 3  # input files that cannot be read at all
EXIT_ERROR_RATE = 4  # more row errors than output.max_error_rate (the output is written)
EXIT_ENGINE = 5  # the engine cannot be started or cannot run this job
EXIT_OUTPUT = 6  # the output cannot be written (a folder, no permission, disk full): rerun resumes
EXIT_ENVIRONMENT = 8  # the Python running `batchscore` lacks a package it needs (or has one too old): fix the install
EXIT_LOCKED = 75  # another run holds this output's lock; nothing was touched (EX_TEMPFAIL)
EXIT_INTERRUPTED = 130  # SIGTERM/SIGINT: progress saved, rerun to resume


class BatchscoreError(Exception):
    """A problem the user can fix; `exit_code` is what `batchscore` exits with."""

    exit_code = 1


class JobConfigError(BatchscoreError, ValueError):
    """The job file is invalid; `problems` lists every problem found."""

    exit_code = EXIT_CONFIG

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid job configuration{where}:\n{lines}")


class PromptTemplateError(BatchscoreError, ValueError):
    """The template itself is malformed or unsafe."""

    exit_code = EXIT_CONFIG


class RowRenderError(BatchscoreError, ValueError):
    """A (jinja) template cannot render one row: that row gets the message as its error; the run
    goes on. Never ends a run itself."""

    exit_code = EXIT_INPUT


class NullFieldError(RowRenderError, KeyError):
    """A jinja template printed or looped over a null or missing column; `args[0]` is the column
    (a KeyError like the format engine's, so both engines report it the same way)."""


class DuplicateKeyError(BatchscoreError, ValueError):
    """A JSON object holds one key twice (`args[0]`: the key). JSON readers keep only the last, so
    the line or value that holds it is its row's error; never ends a run itself."""

    exit_code = EXIT_INPUT


class LabelError(BatchscoreError, ValueError):
    """Labels that cannot be scored as the job asks (e.g. per-row options with speculative prefill)."""

    exit_code = EXIT_CONFIG


class ModelError(BatchscoreError, ValueError):
    """A model name or path that cannot be resolved to local weights."""

    exit_code = EXIT_CONFIG


class ResumeMismatch(BatchscoreError, RuntimeError):
    """A staging folder exists but belongs to a different job configuration or input."""

    exit_code = EXIT_CONFIG


class InputError(BatchscoreError, ValueError):
    """Input files that cannot be read at all (missing, empty, unreadable)."""

    exit_code = EXIT_INPUT


class PlanInputError(BatchscoreError, ValueError):
    """A request the planner cannot plan: empty prompt, non-integer or negative token ids."""

    exit_code = EXIT_INPUT


class ErrorRateExceeded(BatchscoreError, RuntimeError):
    """More rows failed than `output.max_error_rate` allows (the output is still written);
    `summary` is the run's RunSummary."""

    exit_code = EXIT_ERROR_RATE

    def __init__(self, message: str, summary=None):
        super().__init__(message)
        self.summary = summary


class CalibrationError(BatchscoreError, ValueError):
    """score.calibrate / output.review cannot be done with this job's rows: no labeled row, a true
    label that is not one of the labels, or `calibrate.from` without values to reuse. Raised when
    the output is assembled (the rows scored are kept: fix the cause and rerun)."""

    exit_code = EXIT_CONFIG


class OutputError(BatchscoreError, OSError):
    """The output (or its parts) cannot be written: a folder in the way, no permission, disk full."""

    exit_code = EXIT_OUTPUT


class OutputLocked(BatchscoreError, RuntimeError):
    """Another run of the same output holds its lock (a cron retry or an Airflow zombie)."""

    exit_code = EXIT_LOCKED


class ShardsUnfinished(BatchscoreError, RuntimeError):
    """`batchscore merge` before every shard of the set has finished: `retry` lists the shard
    indexes to run (again); exit 75, as a job array retries a task later."""

    exit_code = EXIT_LOCKED

    def __init__(self, message: str, retry: list[int]):
        super().__init__(message)
        self.retry = list(retry)


class ReportError(BatchscoreError, ValueError):
    """`batchscore report`: the output (or a file given with it) cannot be reported on."""

    exit_code = EXIT_INPUT


class ReportUnavailable(BatchscoreError, RuntimeError):
    """matplotlib, which draws the report's plots, is not installed."""

    exit_code = EXIT_ENGINE


class EngineUnavailable(BatchscoreError, RuntimeError):
    """The requested engine cannot be used: packages missing, no GPU, an unsupported model."""

    exit_code = EXIT_ENGINE


class HybridUnsupported(EngineUnavailable, NotImplementedError):
    """Hybrid prefilling was asked for on a model whose layers it cannot run."""


class KernelFailed(BatchscoreError, RuntimeError):
    """An optional kernel (engines/fallback.py) failed inside a pass; the engine replaces it with its
    plain path and runs the pass again, so this never reaches the user."""

    def __init__(self, path: str, error: BaseException) -> None:
        super().__init__(f"{path}: {type(error).__name__}: {error}")
        self.path = path
        self.error = error


class MemoryBudgetError(BatchscoreError, ValueError):
    """One request needs more memory than `memory_budget` even when scored alone (a row error)."""

    exit_code = EXIT_ENGINE

    def __init__(self, row_id: int, needed_bytes: int, budget_bytes: int) -> None:
        self.row_id = row_id
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes
        super().__init__(f"row {row_id}: {self.reason}")

    @property
    def reason(self) -> str:
        """The message without the row's name (the caller may know its file:line)."""
        return (f"needs about {self.needed_bytes / 2**20:.1f} MiB beyond the weights when scored alone, over "
                f"engine.memory_budget {self.budget_bytes / 2**20:.1f} MiB ({self.budget_bytes} bytes); raise the "
                "budget, set engine.hybrid_chunk, or shorten the prompt")


class RunInterrupted(BatchscoreError, RuntimeError):
    """SIGTERM/SIGINT: the current part was finished and recorded; rerun to resume."""

    exit_code = EXIT_INTERRUPTED


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised wherever the run is (run/run_files.py): like Ctrl-C's KeyboardInterrupt a
    BaseException, so no library's `except Exception` (an import probing for optional packages)
    swallows it and lets the run finish with exit 0; it ends the run with exit 130."""


class DecisionRequestError(InputError):
    """A System One / OpenAI Decisions request body that cannot be read as asked: the request's
    answer is this message with `status` 400 (a bad request never gets a 5xx); `question` is the
    question's id or index when one question is at fault, else None."""

    status = 400

    def __init__(self, message: str, question: str | int | None = None):
        super().__init__(message)
        self.question = question


EXIT_INTERNAL = 1  # an unexpected error (a bug): one line, the traceback under `batchscore -v`


class WritePathError(BatchscoreError, ValueError):
    """A path batchscore was asked to write (--metrics, --metrics-prom, report --html,
    output.error_path) is an input, the output, or a file the output owns: refused before any work."""

    exit_code = EXIT_CONFIG


EXIT_AUDIT = 7  # the exactness audit found rows whose scores differ from a plain float32 forward


class AuditFailed(BatchscoreError, RuntimeError):
    """The exactness audit (run/audit.py) re-scored rows through a plain float32 forward and found
    a max |ΔP| above `output.audit_max_dp`; the output is still written. `summary` is the run's
    RunSummary (its `audit_differing` names the rows)."""

    exit_code = EXIT_AUDIT

    def __init__(self, message: str, summary=None):
        super().__init__(message)
        self.summary = summary


class APIError(BatchscoreError):
    """A request `batchscore serve` refuses, answered as the OpenAI API shapes its errors:
    `{"error": {message, type, param, code}}` with the HTTP `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def wrong_environment(exc: BaseException) -> str | None:
    """Why `exc` (an ImportError that escaped a command) means the Python running batchscore is not
    batchscore's environment — a dependency missing (numpy in an Airflow worker's Python after
    `pip install --no-deps`) or too old to hold a name — or None when it is not one (a module of
    batchscore's own that does not import is a bug). A retry cannot fix it: exit EXIT_ENVIRONMENT."""
    import sys

    if not isinstance(exc, ImportError):
        return None
    name = exc.name or ""
    if name == "batchscore" or name.startswith("batchscore."):
        return None
    what = f"the package {name.split('.')[0]!r}" if name else "a package"
    return (f"wrong environment: the Python that runs batchscore ({sys.executable}) lacks {what} it needs "
            f"({type(exc).__name__}: {exc}); install batchscore with its dependencies there "
            "(pip install -e '.[...]' in its checkout), or run the batchscore of the environment that has them "
            "(Airflow: batchscore_bin= or $BATCHSCORE_BIN)")


# The exits a retry would end the same way (the Airflow operator fails the task at once; README's
# exit-code table says "no" for exactly these). Every other non-zero exit is retried: 5, 75, 130, signals.
NOT_RETRYABLE = {
    EXIT_INTERNAL: "a bug in batchscore (the same run fails the same way; run it with -v for the traceback)",
    EXIT_CONFIG: "invalid job (job file, model, or a resume of another job)",
    EXIT_INPUT: "unreadable input",
    EXIT_ERROR_RATE: "too many row errors (the output is written)",
    EXIT_OUTPUT: "output not writable",
    EXIT_AUDIT: "exactness audit failed (the output is written)",
    EXIT_ENVIRONMENT: "wrong environment: the Python running batchscore lacks a package it needs (set batchscore_bin "
                      "or $BATCHSCORE_BIN to batchscore's own environment)",
}


class StateError(BatchscoreError):
    """`serve`'s state dir database cannot be read (damaged, or not batchscore's): the server does not start."""

    exit_code = EXIT_CONFIG
