"""Exit codes: the README's table, errors.py and the Airflow operator's retry rule say the same
for every code, and a `batchscore` run by a Python that lacks a package it needs exits 8 (wrong
environment, not retried), naming the package and the Python."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from batchscore import errors
from batchscore.run.run_files import exit_status

from tests.conftest import REPO

BATCHSCORE = REPO / ".venv" / "bin" / "batchscore"


def readme_exit_codes() -> dict[int, str]:
    """code -> its retry cell, from README's "Exit codes" table."""
    text = (REPO / "README.md").read_text()
    table = text.split("## Exit codes", 1)[1].split("\n\n", 2)[1]
    rows = [line.split("|") for line in table.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    return {int(cells[1]): cells[-2].strip() for cells in rows}


def test_every_exit_code_is_in_the_readme_and_its_retry_cell_matches_the_operator():
    documented = readme_exit_codes()
    constants = {value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert constants <= set(documented), sorted(constants - set(documented))
    for code, cell in documented.items():
        if code == 0:
            continue
        # the operator (batchscore/airflow.py) fails the task at once on exactly NOT_RETRYABLE
        assert cell.startswith("no") == (code in errors.NOT_RETRYABLE), (code, cell)
    assert errors.EXIT_INTERNAL in errors.NOT_RETRYABLE and errors.EXIT_ENVIRONMENT in errors.NOT_RETRYABLE
    assert len(set(documented)) == len(documented) and errors.EXIT_ENVIRONMENT == 8


def test_the_operator_module_reads_its_retry_rule_from_errors():
    source = (REPO / "batchscore" / "airflow.py").read_text()
    assert "from batchscore.errors import NOT_RETRYABLE" in source and "NOT_RETRYABLE = {" not in source


@pytest.mark.parametrize("exc, code", [
    (ModuleNotFoundError("No module named 'numpy'", name="numpy"), errors.EXIT_ENVIRONMENT),
    (ImportError("cannot import name 'chunked' from 'pyarrow.compute'", name="pyarrow.compute"),
     errors.EXIT_ENVIRONMENT),  # a dependency too old to hold a name
    (ModuleNotFoundError("No module named 'batchscore.nothing'", name="batchscore.nothing"), errors.EXIT_INTERNAL),
    (ImportError("cannot import name 'x' from 'batchscore.scores'", name="batchscore.scores"), errors.EXIT_INTERNAL),
    (KeyError("x"), errors.EXIT_INTERNAL),
])
def test_an_import_error_of_a_dependency_is_the_wrong_environment_one_of_batchscore_a_bug(exc, code):
    got, message = exit_status(exc, "run")
    assert got == code
    if code == errors.EXIT_ENVIRONMENT:
        assert "wrong environment" in message and sys.executable in message and repr(exc.name.split(".")[0]) in message
    else:
        assert "a bug in batchscore" in message


def test_batchscore_without_numpy_exits_8_naming_numpy(tmp_path):
    """The documented `pip install --no-deps` into Airflow's environment: a `batchscore` whose Python
    has no numpy. Here numpy is hidden by a module that fails as a missing one does."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "numpy.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = {**os.environ, "PYTHONPATH": str(hide), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(BATCHSCORE), "run", str(REPO / "jobs" / "sample.yaml"), "-q", "-o",
                           str(tmp_path / "out.parquet")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == errors.EXIT_ENVIRONMENT, done.stderr
    assert "wrong environment" in done.stderr and "'numpy'" in done.stderr and "Traceback" not in done.stderr
    assert "a bug in batchscore" not in done.stderr and not (tmp_path / "out.parquet").exists()


@pytest.mark.slow  # two subprocess runs
def test_a_finished_run_with_a_full_or_closed_stdout_exits_0_as_its_metrics_say(tmp_path):
    """The run's output and metrics are written; a summary that cannot be printed (stdout full, or
    a reader that went away) does not turn the finished run into exit 6."""
    import json

    from tests.test_hardening import token_job

    data, out, job = token_job(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for target in ("/dev/full", "closed"):
        metrics = tmp_path / f"m-{target.strip('/').replace('/', '-')}.json"
        args = [sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "--fresh", "--metrics", str(metrics)]
        if target == "closed":
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            proc.stdout.close()  # the reader is gone before the summary is printed
            code = proc.wait(timeout=600)
            stderr = proc.stderr.read().decode()
        else:
            with open(target, "w") as full:
                done = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, env=env, timeout=600)
            code, stderr = done.returncode, done.stderr.decode()
        assert code == 0, (target, stderr)
        assert json.loads(metrics.read_text())["status"] == "ok" and out.exists()


@pytest.mark.slow  # two subprocess plans
def test_plan_into_a_full_stdout_is_an_output_error_and_into_a_closed_pipe_ends_quietly():
    """`plan > /dev/full` is exit 6 saying so (it was 3, "unreadable input"); `plan | head -1` ends
    as a Unix tool on SIGPIPE, 141, without an `error: BrokenPipeError` line."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = [sys.executable, "-m", "batchscore.cli", "plan", str(REPO / "jobs" / "sample.yaml")]
    with open("/dev/full", "w") as full:
        done = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, env=env, timeout=600)
    assert done.returncode == errors.EXIT_OUTPUT
    assert "cannot write to standard output (No space left on device)" in done.stderr.decode()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the plan is printed (`| head` that stopped reading)
    assert proc.wait(timeout=600) == 141
    assert "error" not in proc.stderr.read().decode()
