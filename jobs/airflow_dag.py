"""Nightly batchscore job for Apache Airflow (2.x): copy into your DAGs folder and adjust paths.

Retries resume: `batchscore run` keeps the rows already scored next to the output, and a retry
of the same command scores only the rest; a retry after the output is complete does nothing.
The task retries only the exit codes a retry can fix (README, "Exit codes"):

    retried:     5 engine did not start, 75 another run still holds the output's lock,
                 130 interrupted (preemption, SIGTERM), and crashes (1, signals)
    not retried: 2 invalid job / model / resume of another job, 3 unreadable input,
                 4 too many row errors (the output is written), 6 output not writable,
                 7 scores differ from a plain float32 forward (the exactness audit; the output is written)
"""

import json
import subprocess
from datetime import datetime, timedelta

from airflow.decorators import dag, task
from airflow.exceptions import AirflowException, AirflowFailException

BATCHSCORE = "/opt/batchscore/.venv/bin/batchscore"
JOB = "/opt/batchscore/jobs/sample.yaml"
NOT_RETRYABLE = {2: "invalid job", 3: "unreadable input", 4: "error rate exceeded", 6: "output not writable",
                 7: "exactness audit failed"}


@dag(dag_id="batchscore_nightly", schedule="0 2 * * *", start_date=datetime(2026, 1, 1), catchup=False,
     default_args={"retries": 3, "retry_delay": timedelta(minutes=10)}, tags=["batchscore"])
def batchscore_nightly():
    @task(execution_timeout=timedelta(hours=8))
    def score(ds=None) -> dict:
        """Run the job for the logical date; returns the run's metrics (pushed to XCom)."""
        out = f"/data/scores/{ds}"
        done = subprocess.run(
            [BATCHSCORE, "run", JOB, "--quiet", "--output", f"{out}/scores.parquet", "--metrics", f"{out}/metrics.json"],
            env={"HF_HUB_OFFLINE": "1", "BATCHSCORE_HOME": "/opt/batchscore/cache", "PATH": "/usr/bin:/bin"},
            capture_output=True, text=True)
        print(done.stdout, done.stderr)
        if done.returncode in NOT_RETRYABLE:  # the same command would fail the same way
            raise AirflowFailException(f"batchscore: {NOT_RETRYABLE[done.returncode]}: {done.stderr.strip()}")
        if done.returncode != 0:
            raise AirflowException(f"batchscore exited {done.returncode} (retried; it resumes): {done.stderr.strip()}")
        with open(f"{out}/metrics.json") as handle:
            return json.load(handle)

    score()


batchscore_nightly()
