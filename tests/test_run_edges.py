"""Run-level edges: SIGTERM while the command is still importing exits 130 like any later one;
numbers written as YAML 1.2 writes them (1e-12) are numbers, in `--set` and in job files; a
`calibrate.from` output whose marker cannot vouch for it is refused saying why; a vLLM
`engine.memory_budget` too small to hold one KV block is refused as the job's (exit 2), not as an
engine failure a retry could fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import EXIT_CONFIG, EXIT_INTERRUPTED
from tests.conftest import REPO, write_job

# Sends SIGTERM to the process the moment it starts importing the module named in TERM_AT_IMPORT.
TERM_AT_IMPORT = '''import os, signal, sys
class _Hook:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("TERM_AT_IMPORT"):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), getattr(signal, os.environ.get("SIGNAL_AT_IMPORT", "SIGTERM")))
        return None
sys.meta_path.insert(0, _Hook())
'''


@pytest.mark.parametrize("module", ["click", "batchscore.run.runner"])
def test_sigterm_while_the_command_imports_exits_130(tmp_path, small_input, module):
    """The window before `run` installs its handler: click's import (the first ~0.3 s) and the
    runner's (numpy, pyarrow, torch: seconds). Exit 130 and one line, never killed by the signal."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(TERM_AT_IMPORT)
    job = write_job(tmp_path, small_input)
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{REPO}", TERM_AT_IMPORT=module)
    proc = subprocess.run([sys.executable, "-m", "batchscore.cli", "run", str(job), "-q"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_INTERRUPTED, (proc.returncode, proc.stderr[-2000:])
    assert "interrupted by SIGTERM" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out.parquet").exists()


@pytest.mark.parametrize("module", ["click", "batchscore.run.runner"])
def test_ctrl_c_while_the_command_imports_exits_130_and_writes_the_metrics(tmp_path, small_input, module):
    """SIGINT in the same window (it left no `--metrics`, and a traceback while click loaded): exit
    130 with the metrics recording the interruption, as a SIGTERM there does."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(TERM_AT_IMPORT)
    job = write_job(tmp_path, small_input)
    metrics = tmp_path / "m.json"
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{REPO}", TERM_AT_IMPORT=module, SIGNAL_AT_IMPORT="SIGINT")
    proc = subprocess.run([sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "--metrics", str(metrics)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_INTERRUPTED, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    recorded = json.loads(metrics.read_text())
    assert recorded["status"] == "failed" and recorded["exit_code"] == EXIT_INTERRUPTED
    assert not (tmp_path / "out.parquet").exists()


def test_sigterm_to_a_planning_plan_unwinds_it_with_130_and_removes_its_temporary_store(tmp_path, small_input):
    """SIGTERM after the imports, while `plan` holds its temporary token store: exit 130 saying so
    (it said "before the command started"), and the store removed (it was left in the temp folder)."""
    job = write_job(tmp_path, small_input)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(temp), BATCHSCORE_FAULT="plan:1:TERM")
    proc = subprocess.run([sys.executable, "-m", "batchscore.cli", "plan", str(job)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_INTERRUPTED, (proc.returncode, proc.stderr[-2000:])
    assert "interrupted by SIGTERM" in proc.stderr and "before the command started" not in proc.stderr
    assert "Traceback" not in proc.stderr and not list(temp.glob("batchscore-plan-*"))


def test_sigterm_from_the_commands_first_line_exits_130():
    """The window before any batchscore code runs is the interpreter's own start (README: ~40 ms);
    from the command module's first line on, SIGTERM is 130. Sent at import time of the module."""
    code = ("import os, signal, sys; sys.argv = ['batchscore', 'plan', 'no-such-job.yaml']; "
            "import batchscore.cli; os.kill(os.getpid(), signal.SIGTERM); batchscore.cli.main()")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, (proc.returncode, proc.stderr[-2000:])


def test_importing_the_cli_leaves_sigterm_alone():
    """A library caller (or a test) importing batchscore.cli keeps its own SIGTERM handling."""
    code = "import signal; import batchscore.cli; print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)"
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]


# ---------------------------------------------------------------------------- numbers in --set and job files


@pytest.mark.parametrize("text, value", [("1e-12", 1e-12), ("5E-3", 5e-3), (".5", 0.5), ("+1e-1", 0.1)])
def test_a_number_with_an_exponent_is_a_number(tmp_path, small_input, text, value):
    from batchscore.jobfile import load_job

    job = write_job(tmp_path, small_input)
    assert load_job(job, {"output.audit_max_dp": text}).output.audit_max_dp == value  # --set
    raw = job.read_text().replace("audit_rows: 0", f"audit_rows: 0\n  audit_max_dp: {text}")
    job.write_text(raw)
    assert load_job(job).output.audit_max_dp == value  # the job file


def test_set_with_a_number_through_the_cli_and_text_stays_text(tmp_path, small_input):
    from batchscore.jobfile import load_job

    job = write_job(tmp_path, small_input)
    result = CliRunner().invoke(main, ["plan", str(job), "--set", "output.audit_max_dp=1e-12"])
    assert result.exit_code == 0 and "audit_max_dp" not in result.output, result.output
    config = load_job(job, {"labels": "[1e5, 2e5]", "prompt.system": "1e-12"})
    assert config.labels == ["1e5", "2e5"] and config.prompt.system == "1e-12"  # strings stay as written
    with pytest.raises(Exception, match="output.audit_max_dp: expected a number"):
        load_job(job, {"output.audit_max_dp": "1e-12x"})


# ---------------------------------------------------------------------------- calibrate.from of another output


@pytest.fixture(scope="module")
def finished_output(tmp_path_factory):
    """A finished labels run (every row too long to score: no model loaded) and its marker."""
    from tests.conftest import write_sample_subset

    folder = tmp_path_factory.mktemp("finished")
    data = write_sample_subset(folder / "input.parquet", queries=4, product_ids=("P001", "P002"))
    job = write_job(folder, data, engine={"max_length": 8}, output={"max_error_rate": 1.0})
    result = CliRunner().invoke(main, ["run", str(job), "-q"])
    assert result.exit_code == 0, result.output
    return folder / "out.parquet"


def _older(marker: dict) -> dict:
    marker.pop("output_sha256")  # markers before the output was named by content
    return marker


@pytest.mark.parametrize("damage, said", [
    (_older, "written by an older batchscore"),
    (None, "has no completion marker"),
    ("not json", "not JSON"),
    ("output", "changed since its completion marker was written"),
])
def test_calibrate_from_says_what_is_wrong_with_the_previous_output(tmp_path, finished_output, damage, said):
    import shutil

    previous = tmp_path / "previous.parquet"
    shutil.copy(finished_output, previous)
    marker = previous.with_name(f"_{previous.name}.complete.json")
    recorded = json.loads(finished_output.with_name(f"_{finished_output.name}.complete.json").read_text())
    if callable(damage):
        marker.write_text(json.dumps(damage(recorded)))
    elif damage == "not json":
        marker.write_text("{")
    elif damage == "output":
        marker.write_text(json.dumps(recorded))
        shutil.copy(finished_output.parent / "input.parquet", previous)  # another file
    shutil.copy(finished_output.parent / "input.parquet", tmp_path / "input.parquet")
    job = write_job(tmp_path, tmp_path / "input.parquet", score={"calibrate": "temperature"},
                    calibrate={"from": str(previous)})
    result = CliRunner().invoke(main, ["run", str(job), "-q"])
    assert result.exit_code == EXIT_CONFIG, result.output
    assert said in result.output and "calibrate.from" in result.output
    assert "no completion marker" not in result.output or damage is None


# ---------------------------------------------------------------------------- vLLM's KV cache from engine.memory_budget


@pytest.mark.parametrize("budget, refused", [(1 << 20, True), (2 << 20, False)])
def test_a_vllm_memory_budget_under_one_kv_block_is_the_jobs_error(budget, refused):
    """1 MiB holds 22 tokens of the built-in model's float32 KV, less than the one 32-token block vLLM
    needs to start: on 051b98a vLLM was started anyway and failed (exit 5, retried by the operator
    for nothing); now the job's number is refused before vLLM starts (exit 2, not retried)."""
    import numpy as np

    from batchscore.engines.shape import read_model_config
    from batchscore.engines.vllm.settings import derive_settings
    from batchscore.errors import JobConfigError
    from batchscore.models import resolve_model
    from batchscore.plan.types import GroupMember, PrefixGroup

    config = read_model_config(resolve_model("smollm2-135m-instruct"))
    groups = [PrefixGroup(np.zeros(0, np.int32), [GroupMember(0, np.arange(15, dtype=np.int32))])]

    def settings():
        return derive_settings(groups, config, dtype="float32", token_budget=256, max_length=None,
                               vllm_args={"kv_cache_memory_bytes": budget, "block_size": 32})

    if not refused:
        assert settings().kv_capacity_tokens >= 32
        return
    with pytest.raises(JobConfigError, match="engine.memory_budget") as error:
        settings()
    assert "one KV block of 32 tokens" in str(error.value) and error.value.exit_code == EXIT_CONFIG  # not retried
