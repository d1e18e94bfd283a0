"""Airflow for real: the shipped DAG (jobs/airflow_dag.py) and `batchscore.airflow.BatchscoreOperator`
under `airflow dags test`, in a virtual environment of their own with apache-airflow from the
package index (built once, cached under $BATCHSCORE_HOME/airflow-venv/<version>).

Airflow's environment gets batchscore only on PYTHONPATH (the operator needs the standard library
and Airflow); the operator runs this checkout's `.venv/bin/batchscore` (BATCHSCORE_BIN).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, write_job, write_sample_subset

pytestmark = pytest.mark.slow

AIRFLOW_VERSION = os.environ.get("BATCHSCORE_AIRFLOW_VERSION", "3.3.2")
AIRFLOW_2_VERSION = "2.11.2"  # the DAG still imports under 2.x
BATCHSCORE_BIN = REPO / ".venv" / "bin" / "batchscore"
SHIPPED_DAG = REPO / "jobs" / "airflow_dag.py"
SHARDED_DAG = REPO / "jobs" / "airflow_sharded_dag.py"
LOGICAL_DATE = "2026-01-02"
# What pip says when it cannot reach the index (a version that does not exist fails the test instead).
UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
               "Network is unreachable", "Connection refused", "ProxyError", "Max retries exceeded")


def cache_root() -> Path:
    return Path(os.environ.get("BATCHSCORE_HOME", Path.home() / ".cache" / "batchscore")) / "airflow-venv"


def build_airflow_venv(version: str) -> Path:
    """apache-airflow==version in a venv of its own, built once and kept (`.installed` marks a
    complete one; a half-built one is started over). Skips the test only when the package index
    cannot be reached."""
    venv = cache_root() / version
    if (venv / ".installed").exists():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"apache-airflow=={version}"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        if any(sign in done.stderr for sign in UNREACHABLE):
            pytest.skip(f"the package index is unreachable, apache-airflow=={version} cannot be installed: "
                        f"{done.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"pip install apache-airflow=={version} failed:\n{done.stderr[-3000:]}")
    (venv / ".installed").touch()
    return venv


@pytest.fixture(scope="module")
def airflow_venv() -> Path:
    return build_airflow_venv(AIRFLOW_VERSION)


def airflow_env(home: Path, dags: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "BATCHSCORE_FAULT"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__DAGS_FOLDER=str(dags), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", BATCHSCORE_BIN=str(BATCHSCORE_BIN), **extra)
    return env


def migrated_home(venv: Path, home: Path, dags: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(venv / "bin" / "airflow"), "db", "migrate"], env=airflow_env(home, dags),
                   check=True, capture_output=True)
    return home


def task_tries(home: Path, dag_id: str) -> dict[str, dict]:
    """Per task: its final state and try number, the states of its earlier tries, its XCom rows."""
    with sqlite3.connect(home / "airflow.db") as db:
        tasks = {task: {"state": state, "try_number": tries, "earlier": [], "xcom": []}
                 for task, state, tries in db.execute(
                     "select task_id, state, try_number from task_instance where dag_id = ?", (dag_id,))}
        for task, state, number in db.execute(
                "select task_id, state, try_number from task_instance_history where dag_id = ? order by try_number",
                (dag_id,)):
            tasks[task]["earlier"].append((number, state))
        for task, key, value in db.execute("select task_id, key, value from xcom where dag_id = ?", (dag_id,)):
            tasks[task]["xcom"].append((key, value))
    return tasks


def our_warnings(log: str) -> list[str]:
    """Warning lines that point at batchscore's files (Airflow's own internals may warn about theirs)."""
    return [line for line in log.splitlines()
            if "warning" in line.lower() and ("_dag.py" in line or f"{REPO}/batchscore" in line)]


@pytest.mark.parametrize("version, dag_file, expected", [
    (AIRFLOW_VERSION, SHIPPED_DAG, "batchscore_nightly ['BatchscoreOperator'] 3"),
    (AIRFLOW_2_VERSION, SHIPPED_DAG, "batchscore_nightly ['BatchscoreOperator'] 3"),
    (AIRFLOW_VERSION, SHARDED_DAG, "batchscore_nightly_sharded ['BatchscoreOperator', 'BatchscoreOperator', "
                                   "'BatchscoreOperator'] 3"),
    (AIRFLOW_VERSION, REPO / "jobs" / "airflow_incremental_dag.py", "batchscore_incremental ['BatchscoreOperator'] 3"),
])
def test_the_shipped_dag_imports_without_a_warning(version, dag_file, expected):
    """Airflow 3 (the Task SDK) and 2.x load the DAG with its one BatchscoreOperator, and nothing
    in the DAG or the operator warns (Airflow 2.x's own modules may warn about themselves)."""
    venv = build_airflow_venv(version)
    code = ("import runpy, warnings\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            f"    dag = runpy.run_path({str(dag_file)!r})['dag']\n"
            "import json; print(json.dumps([[w.filename, f'{w.category.__name__}: {w.message}'] for w in seen]))\n"
            "print(dag.dag_id, [type(t).__name__ for t in dag.tasks], dag.tasks[0].retries)\n")
    with tempfile.TemporaryDirectory() as home:
        done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                              env=airflow_env(Path(home), dag_file.parent))
    assert done.returncode == 0, done.stderr[-3000:]
    seen, dag = done.stdout.splitlines()[-2:]
    seen = json.loads(seen)
    assert [w for w in seen if w[0].startswith(str(REPO))] == [], "the DAG or the operator warned"
    if version.startswith("3."):
        assert seen == [], "Airflow 3 warned while importing the DAG"
    assert dag == expected


def test_shipped_dag_retries_a_held_lock_resumes_and_pushes_the_metrics_once(airflow_venv, tmp_path):
    """The sample job, partly scored by an earlier run; the first try meets the output's lock held
    (exit 75) and is retried; the retry resumes, the task succeeds, and XCom holds the metrics as
    one value."""
    out_root = tmp_path / "scores"
    output = out_root / LOGICAL_DATE / "scores.parquet"
    output.parent.mkdir(parents=True)
    # An earlier run stopped (SIGTERM at its 60th scored row) after saving some groups; Airflow's
    # database is made meanwhile.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    earlier = subprocess.Popen([str(BATCHSCORE_BIN), "run", str(REPO / "jobs" / "sample.yaml"), "-q", "-o", str(output)],
                               env={**env, "BATCHSCORE_FAULT": "result:60:TERM"}, stderr=subprocess.PIPE, text=True)
    home = migrated_home(airflow_venv, tmp_path / "airflow", SHIPPED_DAG.parent)
    assert earlier.wait(timeout=300) == 130, earlier.stderr.read()
    assert not output.exists()

    lock = open(output.with_name(f"_{output.name}.lock"), "a")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run holds the output
    process = subprocess.Popen(
        [str(airflow_venv / "bin" / "airflow"), "dags", "test", "batchscore_nightly", LOGICAL_DATE],
        env=airflow_env(home, SHIPPED_DAG.parent, BATCHSCORE_JOB=str(REPO / "jobs" / "sample.yaml"),
                        BATCHSCORE_OUTPUT_ROOT=str(out_root), BATCHSCORE_RETRY_DELAY_S="3"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if "batchscore exited 75" in line and not lock.closed:
                lock.close()  # the other run ends: the retry gets the lock

    reader = threading.Thread(target=read)
    reader.start()
    try:
        process.wait(timeout=480)
    finally:
        process.kill()
        reader.join()
        lock.close()
    log = "".join(lines)
    assert process.returncode == 0, log[-5000:]
    assert our_warnings(log) == []

    score = task_tries(home, "batchscore_nightly")["score"]
    assert score["state"] == "success" and score["try_number"] >= 2, score
    assert score["earlier"][0] == (1, "failed"), score  # the try that met the lock, then retried
    assert "batchscore exited 75" in log and "lock" in log
    (key, value), = score["xcom"]  # one XCom row: the metrics as one value
    metrics = json.loads(value)
    assert key == "return_value" and isinstance(metrics, dict)
    assert metrics["rows"] == metrics["rows_ok"] == 200 and metrics["status"] == "ok"
    assert 0 < metrics["resumed_rows"] < 200  # the retry scored only what the earlier run left
    assert json.loads((out_root / LOGICAL_DATE / "metrics.json").read_text()) == metrics
    assert pq.read_table(output).num_rows == 200


def test_sharded_dag_scores_one_shard_per_task_into_one_output(airflow_venv, tmp_path):
    """jobs/airflow_sharded_dag.py with 2 shards: each task runs `--shard I/2` (the operator's
    shard=), the second to finish writes the output; no lock file or parts folder is left."""
    out_root = tmp_path / "scores"
    data = write_sample_subset(tmp_path / "rows.parquet", queries=2, products=4)
    job = write_job(tmp_path, data)
    home = migrated_home(airflow_venv, tmp_path / "airflow", SHARDED_DAG.parent)
    done = subprocess.run([str(airflow_venv / "bin" / "airflow"), "dags", "test", "batchscore_nightly_sharded",
                           LOGICAL_DATE],
                          env=airflow_env(home, SHARDED_DAG.parent, BATCHSCORE_JOB=str(job), BATCHSCORE_SHARDS="2",
                                          BATCHSCORE_OUTPUT_ROOT=str(out_root)),
                          capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-5000:]
    tasks = task_tries(home, "batchscore_nightly_sharded")
    assert {name: task["state"] for name, task in tasks.items()} == {"score_shard_0": "success",
                                                                     "score_shard_1": "success"}
    assert "--shard 0/2" in log and "--shard 1/2" in log
    folder = out_root / LOGICAL_DATE
    assert pq.read_table(folder / "scores.parquet").num_rows == 8
    assert not list(folder.glob("*.lock")) and not (folder / "_scores.parquet.parts").exists()
    assert {json.loads((folder / f"metrics-shard-{i}.json").read_text())["status"] for i in range(2)} == {"ok"}
    assert our_warnings(log) == []


def failing_jobs(folder: Path) -> dict[int, Path]:
    """A small job for each exit code a retry cannot fix."""
    rows = write_sample_subset(folder / "rows.parquet", queries=2, product_ids=("P001",))
    null_query = pq.read_table(rows).to_pylist()
    null_query[0]["query"] = None
    pq.write_table(pa.Table.from_pylist(null_query), folder / "null_query.parquet")
    (folder / "a_file").write_text("not a folder")

    def job(name: str, input_path: Path, **overrides) -> Path:
        (folder / name).mkdir()
        return write_job(folder / name, input_path, **overrides)

    return {
        2: folder / "no_such_job.yaml",
        3: job("missing_input", folder / "missing.parquet"),
        4: job("error_rate", folder / "null_query.parquet", output={"max_error_rate": 0.0}),
        6: job("unwritable", rows, output={"path": str(folder / "a_file" / "out.parquet")}),
        # bfloat16 scores against the audit's float32 forward, with a bound nothing meets
        7: job("audit", rows, engine={"dtype": "bfloat16"}, output={"audit_rows": 2, "audit_max_dp": 1e-9}),
        8: job("no_numpy", rows),  # run by a Python without numpy (ENVS below): the wrong environment
    }


def hidden_numpy(folder: Path) -> dict[int, dict[str, str]]:
    """Per exit code, the environment its task's batchscore runs with: for 8, numpy hidden by a
    module that fails as a missing one does (the `pip install --no-deps` Python of the README)."""
    hide = folder / "hide_numpy"
    hide.mkdir()
    (hide / "numpy.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    return {8: {"PYTHONPATH": str(hide)}}


FAILING_DAG = '''
from datetime import datetime, timedelta

try:
    from airflow.sdk import DAG
except ImportError:
    from airflow import DAG

from batchscore.airflow import BatchscoreOperator

JOBS = {jobs!r}
ENVS = {envs!r}

with DAG(dag_id="batchscore_failures", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         default_args={{"retries": 3, "retry_delay": timedelta(seconds=1)}}):
    for code, job in JOBS.items():
        BatchscoreOperator(task_id=f"exit_{{code}}", job=job, env=ENVS.get(code, {{}}))
'''


def test_exits_a_retry_cannot_fix_fail_the_task_without_a_retry(airflow_venv, tmp_path):
    jobs = failing_jobs(tmp_path)
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "failures.py").write_text(FAILING_DAG.format(jobs={code: str(path) for code, path in jobs.items()},
                                                         envs=hidden_numpy(tmp_path)))
    home = migrated_home(airflow_venv, tmp_path / "airflow", dags)
    done = subprocess.run([str(airflow_venv / "bin" / "airflow"), "dags", "test", "batchscore_failures"],
                          env=airflow_env(home, dags), capture_output=True, text=True, timeout=480)
    log = done.stdout + done.stderr
    tasks = task_tries(home, "batchscore_failures")
    for code in jobs:
        task = tasks[f"exit_{code}"]
        assert f"batchscore exited {code}" in log, log[-5000:]
        assert (task["state"], task["try_number"], task["earlier"]) == ("failed", 1, []), (code, task)
    assert our_warnings(log) == []
