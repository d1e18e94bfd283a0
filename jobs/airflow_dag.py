"""Nightly batchscore job for Apache Airflow 3 (also 2.x): copy into your DAGs folder.

Airflow's environment needs the operator only: `pip install --no-deps /opt/batchscore` (the
checkout; no torch). The job runs in batchscore's own environment, named by BATCHSCORE_BIN. Paths below are
defaults; the environment variables override them (docs/operations.md, "Airflow").

Retries resume: `batchscore run` keeps the rows already scored next to the output, and a retry
of the same command scores only the rest; a retry after the output is complete does nothing.
The operator retries only the exit codes a retry can fix (75 another run holds the lock, 5, 130,
a kill by a signal) and fails the others at once (1, 2, 3, 4, 6, 7, 8: README, "Exit codes"); the
run's metrics are the task's XCom value (`return_value`, one dict). Several workers at once, one
static shard each: jobs/airflow_sharded_dag.py.
"""

import os
from datetime import datetime, timedelta

try:  # Airflow 3
    from airflow.sdk import DAG
except ImportError:  # Airflow 2.x
    from airflow import DAG

from batchscore.airflow import BatchscoreOperator

BATCHSCORE_BIN = os.environ.get("BATCHSCORE_BIN", "/opt/batchscore/.venv/bin/batchscore")
JOB = os.environ.get("BATCHSCORE_JOB", "/opt/batchscore/jobs/sample.yaml")
OUTPUT_ROOT = os.environ.get("BATCHSCORE_OUTPUT_ROOT", "/data/scores")
RETRY_DELAY = timedelta(seconds=float(os.environ.get("BATCHSCORE_RETRY_DELAY_S", 600)))

with DAG(dag_id="batchscore_nightly", schedule="0 2 * * *", start_date=datetime(2026, 1, 1), catchup=False,
         default_args={"retries": 3, "retry_delay": RETRY_DELAY}, tags=["batchscore"]) as dag:
    BatchscoreOperator(
        task_id="score",
        job=JOB,
        output_path=OUTPUT_ROOT + "/{{ ds }}/scores.parquet",
        metrics_path=OUTPUT_ROOT + "/{{ ds }}/metrics.json",
        batchscore_bin=BATCHSCORE_BIN,
        execution_timeout=timedelta(hours=8),
    )
