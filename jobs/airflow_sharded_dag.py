"""Nightly batchscore job split over static shards, one Airflow task each: copy into your DAGs folder.

The same job as jobs/airflow_dag.py, scored by SHARDS tasks at once (on as many workers or
machines): task `score_shard_I` runs `batchscore run JOB --shard I/N`, which plans the whole
batch, places its prefix groups on N workers and scores only worker I's share (a document's
questions stay in one shard). Every shard writes its parts beside the same output; the shard
that finishes the set writes the output and its completion marker, so no merge task is needed
(`batchscore merge JOB --shards N` does it by hand after a shard was lost for good). Each shard
retries on its own and resumes its own parts; its metrics are its task's XCom value.

Airflow's environment needs the operator only (`pip install --no-deps /opt/batchscore`); the
shards run in batchscore's own environment, named by BATCHSCORE_BIN (docs/operations.md).
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
SHARDS = int(os.environ.get("BATCHSCORE_SHARDS", 3))
RETRY_DELAY = timedelta(seconds=float(os.environ.get("BATCHSCORE_RETRY_DELAY_S", 600)))

with DAG(dag_id="batchscore_nightly_sharded", schedule="0 2 * * *", start_date=datetime(2026, 1, 1),
         catchup=False, default_args={"retries": 3, "retry_delay": RETRY_DELAY}, tags=["batchscore"]) as dag:
    for index in range(SHARDS):
        BatchscoreOperator(
            task_id=f"score_shard_{index}",
            job=JOB,
            shard=f"{index}/{SHARDS}",
            output_path=OUTPUT_ROOT + "/{{ ds }}/scores.parquet",  # one output: the shards share it
            metrics_path=OUTPUT_ROOT + f"/{{{{ ds }}}}/metrics-shard-{index}.json",
            batchscore_bin=BATCHSCORE_BIN,
            execution_timeout=timedelta(hours=8),
        )
