"""Multi-token labels and per-row choices on the torch engine.

Exactness: each option's total log-probability equals a plain transformers forward of prompt +
option (float32, |Δ log p| ≤ 1e-4, P within 1e-4) — on random tiny models over every engine path,
on the sample job with three multi-token labels, and on a per-row-choices job. Also: errors,
normalization, `plan --json`, `score_dataframe`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.engines.torch.engine import TorchEngine
from batchscore.output.layout import label_column, logp_column
from batchscore.plan.options import OptionTokens
from batchscore.plan.types import GroupMember, PrefixGroup
from tests.conftest import REPO, write_sample_subset
from tests.option_reference import reference_option_logps, row_choices
from tests.test_torch_engine import LABELS as LABEL_IDS, VOCAB, make_groups, tiny_model

TOLERANCE = 1e-4
SAMPLE_LABELS = ["Relevant", "Not relevant", "Somewhat relevant"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# ---------------------------------------------------------------------------- engine, tiny models


def groups_with_options(seed: int = 1) -> list[PrefixGroup]:
    """make_groups' groups (every engine path at budget 48) with 1-5 random options of 1-6 tokens
    per member, plus a member whose option is longer than the budget."""
    rng = np.random.default_rng(seed)

    def options():
        return OptionTokens.from_lists([rng.integers(0, VOCAB, int(rng.integers(1, 7)))
                                        for _ in range(int(rng.integers(1, 6)))])

    groups = [PrefixGroup(g.prefix, [GroupMember(m.row_id, m.suffix, options()) for m in g.members])
              for g in make_groups(0)]
    long_option = OptionTokens.from_lists([rng.integers(0, VOCAB, 70), [5], rng.integers(0, VOCAB, 3)])
    groups.append(PrefixGroup(rng.integers(0, VOCAB, 10, dtype=np.int32),
                              [GroupMember(90, rng.integers(0, VOCAB, 5, dtype=np.int32), long_option),
                               GroupMember(91, np.zeros(0, np.int32), options())]))
    return groups


@pytest.mark.parametrize("hybrid", [None, 16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_options_match_plain_forward_on_every_path(arch, hybrid):
    """Packed option rows, empty suffixes, members over the budget (suffix + options prefilled in
    chunks), an option longer than the budget, hybrid prefilling: all equal plain forwards."""
    model = tiny_model(arch)
    groups = groups_with_options()
    expected = {m.row_id: reference_option_logps(model, g.full_prompt(m), m.options) for g in groups for m in g.members}
    engine = TorchEngine(model, token_budget=48, hybrid_chunk=hybrid)
    results = list(engine.score(groups, None))
    assert [r.row_id for r in results] == [m.row_id for g in groups for m in g.members]
    worst = max(float(np.abs(r.logp - expected[r.row_id]).max()) for r in results)
    assert worst <= TOLERANCE, f"max |Δ log p| = {worst:.2e}"
    for r in results:
        assert r.logp.shape == (len(r.option_tokens),)
        assert list(r.option_tokens) == [len(o) for g in groups for m in g.members if m.row_id == r.row_id
                                         for o in m.options]


def test_one_token_options_need_no_extra_positions():
    """Per-row one-token options are read at the last position: the same passes and tokens as
    shared one-token labels, the same scores."""
    model = tiny_model("llama")
    groups = make_groups(0)
    shared = TorchEngine(model, token_budget=48)
    by_labels = {r.row_id: r for r in shared.score(groups, LABEL_IDS)}
    with_options = [PrefixGroup(g.prefix, [GroupMember(m.row_id, m.suffix, OptionTokens.from_lists([[t] for t in LABEL_IDS]))
                                           for m in g.members]) for g in groups]
    per_row = TorchEngine(model, token_budget=48)
    for r in per_row.score(with_options, None):
        np.testing.assert_allclose(r.logp, by_labels[r.row_id].logp, atol=1e-6)
    assert per_row.metrics.processed_tokens == shared.metrics.processed_tokens
    assert per_row.metrics.batches == shared.metrics.batches


# ---------------------------------------------------------------------------- jobs on the real model


def _prompt_texts(tokenizer, job_config, rows):
    from batchscore.prepare.prompts import PromptRenderer

    renderer = PromptRenderer(tokenizer, job_config.prompt.template, system=job_config.prompt.system,
                              chat=job_config.prompt.chat)
    return [renderer.text(row) for row in rows]


def _reference(model, tokenizer, text: str, options: list[str]) -> tuple[np.ndarray, list[int]]:
    """Reference totals of `options` after prompt `text` (chat prompt: no special tokens added),
    each option tokenized as the tokens that follow the prompt's when prompt + option are one text;
    also the option token counts."""
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    lists = [tokenizer(text + o, add_special_tokens=False)["input_ids"][len(prompt):] for o in options]
    return reference_option_logps(model, np.asarray(prompt), OptionTokens.from_lists(lists)), [len(t) for t in lists]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sample_labels_run(tmp_path_factory):
    """jobs/sample.yaml (200 rows) with three multi-token labels, torch engine in float32."""
    out = tmp_path_factory.mktemp("sample") / "scores.parquet"
    result = invoke("run", REPO / "jobs" / "sample.yaml", "-q", "-o", out, "--set", "engine.dtype=float32",
                    "--set", f"labels={json.dumps(SAMPLE_LABELS)}", "--set", "output.logprobs=true")
    assert result.exit_code == 0, result.output
    return pq.read_table(out).to_pandas()


@pytest.mark.slow  # 200 rows + 20 reference forwards
def test_sample_job_with_three_multi_token_labels_is_exact(sample_labels_run, hf_model, tokenizer):
    """Every 10th row (one per product) against a plain forward of prompt + label."""
    from batchscore.jobfile import load_job

    job = load_job(REPO / "jobs" / "sample.yaml")
    out = sample_labels_run
    assert len(out) == 200 and (out["status"] == "ok").all()
    assert list(out.columns[3:11]) == ["p_Relevant", "p_Not relevant", "p_Somewhat relevant", "label", "label_mass",
                                       "logp_Relevant", "logp_Not relevant", "logp_Somewhat relevant"]
    rows = pq.read_table(job.input.path).to_pylist()
    checked = list(range(0, 200, 10))
    texts = _prompt_texts(tokenizer, job, [rows[i] for i in checked])
    worst_logp = worst_p = 0.0
    for i, text in zip(checked, texts):
        want, lengths = _reference(hf_model, tokenizer, text, SAMPLE_LABELS)
        assert lengths == [2, 2, 3]
        got = out.loc[i, [logp_column(label) for label in SAMPLE_LABELS]].to_numpy(dtype=float)
        p = out.loc[i, [label_column(label) for label in SAMPLE_LABELS]].to_numpy(dtype=float)
        worst_logp = max(worst_logp, float(np.abs(got - want).max()))
        worst_p = max(worst_p, float(np.abs(p - np.exp(want - np.logaddexp.reduce(want))).max()))
        assert out.loc[i, "label"] == SAMPLE_LABELS[int(np.argmax(want))]
        assert math.isclose(out.loc[i, "label_mass"], float(np.exp(want).sum()), rel_tol=1e-3)
    assert worst_logp <= TOLERANCE and worst_p <= TOLERANCE, f"|Δ log p| {worst_logp:.2e}, |ΔP| {worst_p:.2e}"


@pytest.fixture(scope="module")
def choices_input(tmp_path_factory):
    """12 rows of the sample data (3 products x 4 queries) with 2-5 choices each."""
    folder = tmp_path_factory.mktemp("choices")
    path = write_sample_subset(folder / "base.parquet", queries=4, product_ids=("P001", "P002", "P004"))
    table = pq.read_table(path)
    table = table.append_column("choices", pa.array([row_choices(i) for i in range(table.num_rows)],
                                                    type=pa.list_(pa.string())))
    pq.write_table(table, folder / "input.parquet")
    return folder / "input.parquet"


def _choices_job(folder: Path, input_path: Path, **overrides) -> Path:
    from tests.conftest import write_job

    sections = {"input": {"path": str(input_path), "id_column": "pair_id", "choices_column": "choices"},
                "labels": [], "output": {"path": str(folder / "out.parquet"), "keep_columns": ["product_id"],
                                         "logprobs": True}}
    for key, value in overrides.items():
        sections[key] = {**sections.get(key, {}), **value} if isinstance(value, dict) else value
    return write_job(folder, input_path, **sections)


@pytest.fixture(scope="module")
def choices_reference(hf_model, tokenizer, choices_input, tmp_path_factory):
    """Per row of the choices input: (reference totals, option token counts, the choices)."""
    from batchscore.jobfile import load_job

    job = load_job(_choices_job(tmp_path_factory.mktemp("reference"), choices_input))
    rows = pq.read_table(choices_input).to_pylist()
    return [(*_reference(hf_model, tokenizer, text, row["choices"]), row["choices"])
            for text, row in zip(_prompt_texts(tokenizer, job, rows), rows)]


@pytest.mark.slow  # a reference forward per choice; make test keeps the tiny-model exactness tests
def test_per_row_choices_job_is_exact(tmp_path, choices_input, choices_reference):
    job = _choices_job(tmp_path, choices_input)
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pandas()
    assert list(out.columns) == ["pair_id", "product_id", "choice", "choice_index", "p_choices", "label_mass",
                                 "logp_choices", "status", "error"]
    worst_logp = worst_p = 0.0
    for i, (want, _, choices) in enumerate(choices_reference):
        got, p = np.asarray(out.loc[i, "logp_choices"]), np.asarray(out.loc[i, "p_choices"])
        assert len(got) == len(choices) == len(p)
        worst_logp = max(worst_logp, float(np.abs(got - want).max()))
        worst_p = max(worst_p, float(np.abs(p - np.exp(want - np.logaddexp.reduce(want))).max()))
        assert out.loc[i, "choice_index"] == int(np.argmax(want))
        assert out.loc[i, "choice"] == choices[int(np.argmax(want))]
    assert worst_logp <= TOLERANCE and worst_p <= TOLERANCE, f"|Δ log p| {worst_logp:.2e}, |ΔP| {worst_p:.2e}"


@pytest.mark.slow  # needs the choices reference forwards
@pytest.mark.parametrize("normalize", ["token", "byte"])
def test_normalize_per_token_and_per_byte(tmp_path, choices_input, choices_reference, normalize):
    job = _choices_job(tmp_path, choices_input, score={"normalize": normalize})
    assert invoke("run", job, "-q").exit_code == 0
    out = pq.read_table(tmp_path / "out.parquet").to_pandas()
    for i, (want, lengths, choices) in enumerate(choices_reference):
        divisors = np.array(lengths if normalize == "token" else [len(c.encode()) for c in choices], dtype=float)
        scaled = want / divisors
        np.testing.assert_allclose(out.loc[i, "p_choices"], np.exp(scaled - np.logaddexp.reduce(scaled)), atol=TOLERANCE)
        assert math.isclose(out.loc[i, "label_mass"], float(np.exp(want).sum()), rel_tol=1e-3)  # never normalized


def test_option_problems_are_row_errors_naming_row_and_option(tmp_path):
    lines = [
        {"query": "running shoes", "choices": ["Yes", "No"]},
        {"query": "a tent", "choices": ["Yes", ""]},
        {"query": "a lamp", "choices": "Yes"},
        {"query": "a desk", "choices": []},
        {"query": "a sofa", "choices": ["Yes", 3]},
        {"query": "a bike", "choices": None},
        {"query": "a kettle", "choices": ["Yes", "No " * 40]},
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = tmp_path / "job.yaml"
    job.write_text("input: {path: data.jsonl, choices_column: choices}\n"
                   "prompt: {template: 'Query: {query}\\nIs this about shoes? Answer:'}\n"
                   "engine: {dtype: float32, max_length: 40}\n"
                   "output: {path: out.parquet, max_error_rate: 1.0}\n")
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["status"] for r in out] == ["ok"] + ["error"] * 6
    errors = [r["error"] for r in out[1:]]
    assert "data.jsonl:2: field 'choices' option 1 is empty" in errors[0]
    assert "data.jsonl:3: field 'choices' must be a list of option strings, got the string 'Yes'" in errors[1]
    assert "data.jsonl:4: field 'choices' is an empty list" in errors[2]
    assert "data.jsonl:5: field 'choices' option 1 is int 3, not a string" in errors[3]
    assert "data.jsonl:6: field 'choices' is null" in errors[4]
    assert "data.jsonl:7: field 'choices' option 1 'No No No" in errors[5] and "longer than the maximum 40" in errors[5]
    assert out[0]["choice"] in ("Yes", "No") and out[1]["p_choices"] is None


def test_label_merging_into_the_prompt_is_a_row_error(tmp_path, caplog):
    """'Answer: ' + 'four' tokenizes as 'Answer', ':', ' four': nothing follows the prompt's tokens."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"q": "2+2"}) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text("input: {path: data.jsonl}\nprompt: {template: 'Question: {q}?\\nAnswer: '}\n"
                   "labels: [four, ' 4']\nengine: {dtype: float32}\noutput: {path: out.parquet, max_error_rate: 1.0}\n")
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    (row,) = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert row["status"] == "error"
    assert "data.jsonl:1: label 'four' adds no token after the prompt" in row["error"]


def test_plan_json_counts_option_tokens(job_factory, small_input):
    plain = json.loads(invoke("plan", job_factory(small_input), "--json").output)
    job = job_factory(small_input, labels=SAMPLE_LABELS)
    stats = json.loads(invoke("plan", job, "--json").output)
    rows = stats["num_requests"]
    assert plain["option_tokens"] == 0
    assert stats["option_tokens"] == rows * (1 + 1 + 2)  # Rele|vant, Not| relevant, Some|what| relevant
    assert stats["processed_tokens"] == plain["processed_tokens"] + stats["option_tokens"]
    # without sharing every option is its own prompt: 3 prompts + their option tokens but the last
    assert stats["logical_tokens"] == 3 * plain["logical_tokens"] + stats["option_tokens"]


def test_score_dataframe_with_a_choices_column():
    import pandas as pd

    import batchscore

    df = pd.DataFrame({"q": ["Capital of France?", "2 + 2 ="],
                       "options": [["Paris", "Lyon", "Marseille"], ["4", "five", "22"]]}, index=[10, 20])
    scores = batchscore.score_dataframe(df, template="Question: {q}\nAnswer:", choices_column="options",
                                        engine={"dtype": "float32"}, logprobs=True)
    assert list(scores.index) == [10, 20]
    assert list(scores.columns) == ["choice", "choice_index", "p_choices", "label_mass", "logp_choices",
                                    "status", "error"]
    assert (scores["status"] == "ok").all()
    assert all(abs(sum(p) - 1) < 1e-9 for p in scores["p_choices"])
    assert scores.loc[10, "choice"] in df.loc[10, "options"]


def test_speculative_prefill_refuses_multi_token_labels(job_factory, small_input):
    from batchscore.errors import EXIT_CONFIG

    job = job_factory(small_input, labels=SAMPLE_LABELS, engine={"speculative": {"keep": 0.5}})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_CONFIG
    assert "speculative prefill scores one-token labels shared by every row" in result.output
