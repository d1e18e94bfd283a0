"""What docs/operations.md and the shipped DAGs tell an operator to run: every cron line of a
nightly run writes its `--metrics` (the retry's too), and the sharded DAG runs one
`BatchscoreOperator` per static shard, all on one output. (`tests/test_airflow.py` runs the DAGs
under a real Airflow.)"""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO


def test_every_cron_line_writes_its_metrics():
    text = (REPO / "docs" / "operations.md").read_text()
    blocks = re.findall(r"```cron\n(.*?)```", text, flags=re.S)
    lines = [line for block in blocks for line in block.splitlines() if "batchscore run" in line]
    assert len(lines) >= 2  # the night's run and its retry
    for line in lines:
        assert re.search(r"--metrics \S[^>]*\.json", line), line


def test_the_sharded_dag_gives_each_task_its_own_shard_of_one_output():
    tree = ast.parse((REPO / "jobs" / "airflow_sharded_dag.py").read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "BatchscoreOperator"]
    assert len(calls) == 1 and isinstance(next(n for n in ast.walk(tree) if isinstance(n, ast.For)), ast.For)
    keywords = {k.arg: ast.unparse(k.value) for k in calls[0].keywords}
    assert keywords["shard"] == "f'{index}/{SHARDS}'"
    assert "{{ ds }}/scores.parquet" in keywords["output_path"] and "index" not in keywords["output_path"]
    assert "index" in keywords["metrics_path"] and "index" in keywords["task_id"]
