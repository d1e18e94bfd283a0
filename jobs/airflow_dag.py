"""Nightly batchscore job for Apache Airflow (2.x): copy into your DAGs folder and adjust paths.

Retries resume: `batchscore run` keeps finished parts next to the output and a retry of the same
command skips the prefix groups already scored. Exit codes (README): 0 done, 2 invalid job,
3 unreadable input, 4 error rate exceeded (output written), 5 engine unavailable, 130 interrupted.
Only 130 and crashes are worth retrying; Airflow retries every failure, which is harmless here.
"""

from datetime import datetime, timedelta

from airflow import DAG
from airflow.operators.bash import BashOperator

BATCHSCORE = "/opt/batchscore/.venv/bin/batchscore"
JOB = "/opt/batchscore/jobs/sample.yaml"

with DAG(
    dag_id="batchscore_nightly",
    schedule="0 2 * * *",  # 02:00 every night
    start_date=datetime(2026, 1, 1),
    catchup=False,
    default_args={"retries": 3, "retry_delay": timedelta(minutes=5)},
    tags=["batchscore"],
) as dag:
    score = BashOperator(
        task_id="score",
        bash_command=(
            f"{BATCHSCORE} run {JOB} --quiet "
            "--output /data/scores/{{ ds }}/scores.parquet "
            "--metrics /data/scores/{{ ds }}/metrics.json "
            "&& cat /data/scores/{{ ds }}/metrics.json"
        ),
        # the last line printed (the metrics JSON) becomes the task's XCom value
        do_xcom_push=True,
        env={"HF_HUB_OFFLINE": "1", "BATCHSCORE_HOME": "/opt/batchscore/cache"},
        append_env=True,
        execution_timeout=timedelta(hours=8),
    )
