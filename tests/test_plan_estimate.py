"""`batchscore plan --estimate`: the sample it scores, what it prints, and its prediction against a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.run.estimate import fit_pass_cost, pick_sample, spread_order

from .conftest import write_sample_subset


def test_spread_order_is_every_index_once_spread_from_the_first():
    for count in (1, 2, 5, 8, 13, 100):
        order = spread_order(count)
        assert sorted(order.tolist()) == list(range(count))
    order = spread_order(100)
    assert order[0] == 50 and sorted(order[:4].tolist()) == [12, 25, 50, 75]  # halves, then quarters
    assert max(order[:8]) - min(order[:8]) > 70  # any prefix covers the range


def test_pick_sample_takes_whole_groups_spread_after_the_warm_up():
    costs = np.full(40, 100, dtype=np.int64)
    warm, sample = pick_sample(costs, sample_tokens=1000, warmup_tokens=250)
    assert warm.tolist() == [0, 1, 2]  # the plan's first groups, up to the warm-up's tokens
    assert not set(warm.tolist()) & set(sample.tolist())
    assert costs[sample].sum() >= 1000 and costs[sample[:-1]].sum() < 1000  # stops once it has the tokens
    assert sample.max() - sample.min() > 25  # spread over the plan, not its first groups
    warm, sample = pick_sample(np.array([5000]), sample_tokens=1000)  # one group: no warm-up, the group itself
    assert warm.tolist() == [] and sample.tolist() == [0]


def test_fit_pass_cost_separates_a_pass_from_its_tokens():
    stretches = [(1, 454, 1.5 + 454 * 0.004), (1, 4086, 1.5 + 4086 * 0.004), (2, 5000, 3.0 + 5000 * 0.004)]
    per_pass, per_token = fit_pass_cost(stretches)
    assert per_pass == pytest.approx(1.5) and per_token == pytest.approx(0.004)
    # a small pass timed slower than a full one (noise): no negative cost, tokens alone
    per_pass, per_token = fit_pass_cost([(1, 454, 9.0), (1, 4086, 8.0)])
    assert per_pass == 0 and per_token == pytest.approx(17.0 / 4540)
    assert fit_pass_cost([(1, 4086, 8.0)]) == (0.0, pytest.approx(8.0 / 4086))  # one stretch: tokens alone


def _gpu_file(path: Path, model: str) -> Path:
    """A `batchscore bench gpu --json-out` file (its keys as gpu_command.py writes them) for `model`."""
    path.write_text(json.dumps({"device": "NVIDIA H200", "torch": "2.13.0", "dtype": "bfloat16",
                                "throughput": [{"model": model, "requests": 128, "processed_tokens": 256_000,
                                                "engine_req_s": 64.0}]}))
    return path


@pytest.fixture(scope="module")
def small_job(tmp_path_factory) -> Path:
    """3 products x 4 queries (3 prefix groups), the audit on by default."""
    from .conftest import write_job

    folder = tmp_path_factory.mktemp("estimate")
    data = write_sample_subset(folder / "input.parquet", queries=4, product_ids=("P001", "P002", "P004"))
    return write_job(folder, data, output={"audit_rows": None})


def test_estimate_json_shape_shards_and_gpu_figures(small_job, tmp_path):
    mine = _gpu_file(tmp_path / "gpu.json", "smollm2-135m-instruct")
    other = _gpu_file(tmp_path / "other.json", "llama-3.1-8b")
    result = CliRunner().invoke(main, ["plan", str(small_job), "--estimate", "--json", "--shard", "1/2",
                                       "--gpu-result", str(mine), "--gpu-result", str(other)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["num_requests"] == 12 and data["num_groups"] == 3  # the plan's figures stay
    est = data["estimate"]
    sample = est["sample"]
    assert sample["processed_tokens"] > 0 and sample["seconds"] > 0 and sample["passes"] >= 1
    assert sample["processed_tokens_per_second"] == pytest.approx(sample["processed_tokens"] / sample["seconds"])
    assert est["engine"]["kind"] == "torch" and est["engine"]["dtype"] == "float32" and est["engine"]["threads"] >= 1
    assert est["processed_tokens"] >= data["processed_tokens"]
    workers = est["workers"]
    assert [w["index"] for w in workers] == [0, 1] and est["shard_index"] == 1
    assert sum(w["rows"] for w in workers) == 12
    assert sum(w["processed_tokens"] for w in workers) >= data["processed_tokens"]
    assert est["score_seconds"] == pytest.approx(max(w["score_seconds"] for w in workers))
    per_pass, per_token, budget = sample["seconds_per_pass"], sample["seconds_per_token"], est["engine"]["token_budget"]
    for w in workers:  # each share's passes and tokens at the fitted costs (no fail-fast probe in so small a share)
        passes = -(-w["processed_tokens"] // budget)
        assert w["score_seconds"] == pytest.approx(passes * per_pass + w["processed_tokens"] * per_token)
    assert per_token > 0 and per_pass >= 0 and len(sample["stretches"]) >= 2  # the warm small pass, the sample's
    assert est["audit_rows"] >= 1 and est["audit_tokens"] > 0 and est["audit_seconds"] > 0
    assert est["total_seconds"] == pytest.approx(est["tokenize_seconds"] + est["startup_seconds"]
                                                 + est["score_seconds"] + est["audit_seconds"])
    ours, theirs = est["elsewhere"]
    assert ours["device"] == "NVIDIA H200" and ours["processed_tokens_per_second"] == pytest.approx(128_000)
    assert ours["score_seconds"] == pytest.approx(est["processed_tokens"] / 128_000)
    assert theirs["model"] is None and "llama-3.1-8b" in theirs["note"]
    assert "estimate: scoring a sample" in result.stderr  # progress while it measures, even with --json


def test_estimate_human_lines(small_job):
    result = CliRunner().invoke(main, ["plan", str(small_job), "--estimate", "--quiet", "--set", "output.audit_rows=0"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("num_requests")
    head = next(i for i, line in enumerate(lines) if line.startswith("estimate: torch engine on cpu"))
    assert "torch threads" in lines[head] and "measured on this machine" in lines[head]
    parts = [line.split()[0] for line in lines[head + 1:]]
    assert parts == ["sample", "tokenize", "start-up", "score", "audit", "total"]
    assert "processed tokens/s" in lines[head + 1] and "0 rows" in lines[head + 5]
    assert "estimate:" not in result.stderr  # --quiet: no progress


def test_estimate_refusals_name_the_problem(small_job, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = CliRunner().invoke(main, ["plan", str(small_job), "--estimate", "--quiet", "--gpu-result", str(bad)])
    assert result.exit_code == 3 and str(bad) in result.stderr and "bench gpu" in result.stderr
    result = CliRunner().invoke(main, ["plan", str(small_job), "--shard", "0/2"])
    assert result.exit_code == 2 and "--estimate" in result.stderr
    result = CliRunner().invoke(main, ["plan", str(small_job), "--estimate", "--shard", "2/2"])
    assert result.exit_code == 2 and "--shard '2/2'" in result.stderr


@pytest.mark.slow
def test_estimate_predicts_a_real_run(tmp_path):
    """The estimate's total against the run's own time (its `time:` line, metrics `seconds`) of the
    same 300-row job, run next to each other: within a factor of 2 either way (a shared machine's
    load moves the two apart; docs/operations.md has the 2,000-row pairs)."""
    from batchscore.bench.scale_bench import write_text_input

    write_text_input(tmp_path / "input.parquet", rows=300, group_size=10, words=60, seed=0)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "input": {"path": str(tmp_path / "input.parquet"), "id_column": "id"},
        "prompt": {"chat": True, "system": "You answer each question about an article with Yes or No.",
                   "template": "Article: {document}\n\nQuestion: {question} Answer Yes or No."},
        "labels": ["Yes", "No"], "model": "smollm2-135m-instruct", "engine": {"kind": "torch", "dtype": "float32"},
        "output": {"path": str(tmp_path / "out.parquet")}}))
    command = [str(Path(sys.executable).with_name("batchscore"))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    planned = subprocess.run([*command, "plan", str(job), "--estimate", "--json", "-q"], capture_output=True,
                             text=True, env=env, timeout=600)
    assert planned.returncode == 0, planned.stderr
    estimate = json.loads(planned.stdout)["estimate"]
    ran = subprocess.run([*command, "run", str(job), "-q", "--metrics", str(tmp_path / "metrics.json")],
                         capture_output=True, text=True, env=env, timeout=900)
    assert ran.returncode == 0, ran.stderr
    seconds = json.loads((tmp_path / "metrics.json").read_text())["seconds"]
    assert 1 / 2 <= estimate["total_seconds"] / seconds <= 2, (estimate, seconds)
