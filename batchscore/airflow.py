"""Apache Airflow: `BatchscoreOperator` runs a job as a task (Airflow 3's Task SDK or Airflow 2.x).

The operator runs `batchscore run` as a subprocess from batchscore's own environment
(`batchscore_bin`, else `$BATCHSCORE_BIN`, else `batchscore` on PATH), so Airflow's environment
needs only this module: the standard library, Airflow and `batchscore.errors` (pure Python), no
torch. Put it there with `pip install --no-deps /opt/batchscore` (the checkout), or put the
checkout on PYTHONPATH.
Nothing else in batchscore imports this module, so batchscore does not depend on Airflow.

Exit codes (README, "Exit codes") decide what Airflow does with a failed try:

    retried (AirflowException):     75 another run holds the output's lock, 5 engine did not start,
                                    130 interrupted (preemption, SIGTERM), killed by a signal (the OOM killer)
    failed now (AirflowFailException): 1 a bug, 2 invalid job, 3 unreadable input, 4 too many row errors,
                                    6 output not writable, 7 exactness audit failed,
                                    8 wrong environment (a package batchscore needs is missing where it runs)

`NOT_RETRYABLE` (errors.py) is that table; the README's exit-code table says the same (tests/test_exit_codes.py).

A retry resumes: the rows already scored are kept beside the output. The task's return value,
pushed to XCom as one value (`return_value`), is the run's `--metrics` JSON as a dict.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import tempfile

from batchscore.errors import NOT_RETRYABLE  # exit code -> why a retry would fail the same way

try:  # Airflow 3: the Task SDK (the airflow.models / airflow.exceptions names are deprecated there)
    from airflow.sdk import BaseOperator
except ImportError:
    try:  # Airflow 2.x
        from airflow.models import BaseOperator
    except ImportError:
        raise ImportError("batchscore.airflow needs Apache Airflow (pip install apache-airflow) in the "
                          "environment that imports it") from None
try:
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
except ImportError:  # Airflow 2.x and 3.0
    from airflow.exceptions import AirflowException, AirflowFailException

TAIL_LINES = 20  # of batchscore's output, quoted in a failed task's exception


class BatchscoreOperator(BaseOperator):
    """Run `batchscore run JOB` and return its metrics (one XCom value).

    :param job: the job file (YAML), as the batchscore environment sees it.
    :param output_path: `--output`, the output path (templated: `/data/scores/{{ ds }}/scores.parquet`);
        None keeps the job's own `output.path`.
    :param metrics_path: where the `--metrics` JSON is kept (templated); None: a temporary file,
        read and removed (the metrics still go to XCom).
    :param sets: `--set key=value` overrides (templated).
    :param shard: `--shard I/N` (templated): score only static shard I of N, one task per shard; the
        task that finishes the set writes the output (`jobs/airflow_sharded_dag.py`).
    :param batchscore_bin: the `batchscore` executable of batchscore's environment; default
        `$BATCHSCORE_BIN`, else `batchscore` on PATH.
    :param env: extra environment variables for batchscore (templated); the worker's environment
        is passed on, with HF_HUB_OFFLINE=1.
    :param extra_args: more `batchscore run` arguments (`--fresh`, `--report`, ...).
    """

    template_fields = ("job", "output_path", "metrics_path", "sets", "env", "shard")
    ui_color = "#e8f0fe"

    def __init__(self, *, job: str, output_path: str | None = None, metrics_path: str | None = None,
                 sets: list[str] | None = None, batchscore_bin: str | None = None,
                 env: dict[str, str] | None = None, extra_args: list[str] | None = None,
                 shard: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.job = job
        self.output_path = output_path
        self.metrics_path = metrics_path
        self.sets = list(sets or [])
        self.batchscore_bin = batchscore_bin
        self.env = dict(env or {})
        self.extra_args = list(extra_args or [])
        self.shard = shard
        self._process: subprocess.Popen | None = None

    def command(self, metrics_path: str) -> list[str]:
        """The `batchscore run` command line of this task."""
        command = [self._executable(), "run", str(self.job), "--quiet", "--metrics", metrics_path]
        if self.output_path:
            command += ["--output", str(self.output_path)]
        for item in self.sets:
            command += ["--set", str(item)]
        if self.shard:
            command += ["--shard", str(self.shard)]
        return command + [str(arg) for arg in self.extra_args]

    def execute(self, context) -> dict:
        with tempfile.TemporaryDirectory(prefix="batchscore-airflow-") as scratch:
            metrics_path = str(self.metrics_path or os.path.join(scratch, "metrics.json"))
            code, tail = self._run(self.command(metrics_path))
            if code in NOT_RETRYABLE:
                raise AirflowFailException(f"batchscore exited {code}, {NOT_RETRYABLE[code]}; not retried:\n{tail}")
            if code != 0:
                raise AirflowException(f"batchscore exited {code}; retried (a retry resumes):\n{tail}")
            try:
                with open(metrics_path, encoding="utf-8") as handle:
                    return json.load(handle)
            except (OSError, ValueError) as exc:
                raise AirflowException(f"batchscore succeeded but its metrics {metrics_path} cannot be read: {exc}")

    def on_kill(self) -> None:
        """Airflow stops the task: SIGTERM lets batchscore save what is scored (it exits 130)."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)

    def _executable(self) -> str:
        name = self.batchscore_bin or os.environ.get("BATCHSCORE_BIN") or "batchscore"
        found = shutil.which(name)
        if found is None:
            raise AirflowFailException(f"batchscore executable {name!r} not found: pass batchscore_bin= or set "
                                       "BATCHSCORE_BIN to batchscore's environment (e.g. /opt/batchscore/.venv/bin/batchscore)")
        return found

    def _run(self, command: list[str]) -> tuple[int, str]:
        """Run batchscore, its output lines into the task log; (exit code, last lines)."""
        self.log.info("running %s", " ".join(command))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **{k: str(v) for k, v in self.env.items()}}
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                         text=True, errors="replace")
        try:
            for line in self._process.stdout:
                line = line.rstrip()
                tail.append(line)
                self.log.info("%s", line)
            code = self._process.wait()
        finally:
            self._process.stdout.close()
        self.log.info("batchscore exited %d", code)
        return code, "\n".join(tail)


__all__ = ["BatchscoreOperator", "NOT_RETRYABLE"]
