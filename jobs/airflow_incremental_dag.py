"""The nightly warehouse job for Apache Airflow 3 (also 2.x): each night scores only the rows that
changed or are new since the night before and publishes the night's output to a Delta Lake table,
merged by id (docs/operations.md, "Only what changed" and "Into a Delta Lake table").

Each night writes its own output (`<root>/<ds>/scores.parquet`), carrying the rows whose content
the previous night scored (`output.previous`: the night before's output, whose `_scores.parquet.rows`
it reads; a night without one scores every row). The finished output is then merged into the table
exactly once: a retry resumes from the night's parts and commits once, a retry after the commit
commits nothing more. The operator retries only the exit codes a retry can fix (jobs/airflow_dag.py).
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
TABLE = os.environ.get("BATCHSCORE_TABLE", "/data/tables/relevance")
RETRY_DELAY = timedelta(seconds=float(os.environ.get("BATCHSCORE_RETRY_DELAY_S", 600)))

with DAG(dag_id="batchscore_incremental", schedule="0 2 * * *", start_date=datetime(2026, 1, 1), catchup=False,
         default_args={"retries": 3, "retry_delay": RETRY_DELAY}, tags=["batchscore"]) as dag:
    BatchscoreOperator(
        task_id="score_and_publish",
        job=JOB,
        output_path=OUTPUT_ROOT + "/{{ ds }}/scores.parquet",
        metrics_path=OUTPUT_ROOT + "/{{ ds }}/metrics.json",
        sets=["output.mode=incremental",
              "output.previous=" + OUTPUT_ROOT + "/{{ macros.ds_add(ds, -1) }}/scores.parquet",
              "output.table.path=" + TABLE, "output.table.mode=merge"],
        batchscore_bin=BATCHSCORE_BIN,
        execution_timeout=timedelta(hours=8),
    )
