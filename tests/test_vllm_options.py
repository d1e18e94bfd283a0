"""The vLLM engine scores multi-token labels and per-row choices exactly, sharing the prompt's cache.

Skipped when vLLM is not installed. One engine (one vLLM process, small KV cache) for the module;
float32. The prompts are jobs/sample.yaml's first ROWS rows; each option's total log-probability
is compared with a plain transformers forward of prompt + option (|Δ log p| ≤ 1e-4).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

# vLLM is imported by the tests that use it, not at collection (seconds in every test worker)
if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM", allow_module_level=True)
# A second vLLM start and a reference forward per option (~3 min): make test keeps one vLLM
# test (test_vllm_engine) and the tiny-model option exactness tests (test_options_torch).
pytestmark = pytest.mark.slow

from batchscore.engines.vllm.options import option_requests  # noqa: E402
from batchscore.scores.normalize import normalize_totals  # noqa: E402
from batchscore.plan import PlanOptions, build_plan  # noqa: E402
from batchscore.plan.options import OptionTokens  # noqa: E402
from batchscore.plan.types import GroupMember, PrefixGroup, Request  # noqa: E402
from tests.option_reference import reference_option_logps, row_choices  # noqa: E402

ROWS = int(os.environ.get("BATCHSCORE_VLLM_TEST_ROWS", "20"))
LABELS = ["Relevant", "Not relevant", "Somewhat relevant"]
TOLERANCE = 1e-4  # |Δ log p| and |ΔP| against transformers, float32


@pytest.fixture(scope="module")
def prompts(model_dir, tokenizer):
    """(prompt texts, prompt token ids) of jobs/sample.yaml's first ROWS rows."""
    import pyarrow.parquet as pq

    from batchscore.jobfile import load_job
    from batchscore.prepare.prompts import PromptRenderer

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = load_job(os.path.join(repo, "jobs", "sample.yaml"))
    renderer = PromptRenderer(tokenizer, job.prompt.template, system=job.prompt.system, chat=job.prompt.chat)
    texts = [renderer.text(row) for row in pq.read_table(job.input.path).to_pylist()[:ROWS]]
    return texts, renderer.encode(texts)


def _requests(tokenizer, prompts, options_per_row):
    from batchscore.prepare.options import OptionEncoder

    texts, tokens = prompts
    encoder = OptionEncoder(tokenizer)
    encoded = encoder.after_prompts(texts, tokens, options_per_row, [str(i) for i in range(len(texts))],
                                    chat=[True] * len(texts))  # the sample job's prompts use the chat template
    return [Request(i, t, OptionTokens.from_lists(lists)) for i, (t, (lists, _)) in enumerate(zip(tokens, encoded))]


@pytest.fixture(scope="module")
def label_requests(tokenizer, prompts):
    return _requests(tokenizer, prompts, [LABELS] * len(prompts[0]))


@pytest.fixture(scope="module")
def choice_requests(tokenizer, prompts):
    return _requests(tokenizer, prompts, [row_choices(i) for i in range(len(prompts[0]))])


@pytest.fixture(scope="module")
def reference(model_dir, label_requests, choice_requests):
    """row -> reference totals, for the labels and for the choices (one forward per row of all
    its label and choice sequences)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = {"labels": {}, "choices": {}}
    for labels, choices in zip(label_requests, choice_requests):
        both = OptionTokens.from_lists(list(labels.options) + list(choices.options))
        totals = reference_option_logps(model, labels.token_ids, both)
        out["labels"][labels.row_id] = totals[: labels.options.count]
        out["choices"][choices.row_id] = totals[labels.options.count :]
    del model
    return out


def _plan(requests):
    return build_plan(requests, PlanOptions(block_size=32)).groups


@pytest.fixture(scope="module")
def engine(model_dir, label_requests, choice_requests):
    from batchscore.engines.vllm.engine import VllmEngine

    eng = VllmEngine(model_dir, dtype="float32", token_budget=2048, vllm_args={"kv_cache_memory_bytes": 256 << 20})
    eng.start(_plan(label_requests) + _plan(choice_requests))  # sized for both (max_model_len: longest option)
    yield eng
    eng.close()


def _score(engine, requests):
    groups = _plan(requests)
    results = list(engine.score(groups, None))
    assert [r.row_id for r in results] == [m.row_id for g in groups for m in g.members]
    return {r.row_id: r for r in results}, groups


def _check_exact(results, expected):
    worst_logp = worst_p = 0.0
    for row, want in expected.items():
        got = results[row]
        assert got.error is None, got.error
        worst_logp = max(worst_logp, float(np.abs(got.logp - want).max()))
        p_want = np.exp(want - np.logaddexp.reduce(want))
        worst_p = max(worst_p, float(np.abs(np.exp(normalize_totals(got.logp)[0][0]) - p_want).max()))
    assert worst_logp <= TOLERANCE and worst_p <= TOLERANCE, f"max |Δ log p| {worst_logp:.2e}, |ΔP| {worst_p:.2e}"


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_multi_token_labels_are_exact_and_share_the_prompt_cache(engine, label_requests, reference, mode):
    """decode: one request per option (Rele|vant, Not| relevant, Some|what| relevant), its tokens
    forced; prefill: one per node of the option trie (the prompt, + 'Rele', + 'Not', + 'Some',
    + 'Some' 'what'). Both exact, both reading the prompt's blocks from vLLM's prefix cache."""
    engine.option_mode = mode
    try:
        results, groups = _score(engine, label_requests)
    finally:
        engine.option_mode = "decode"
    _check_exact(results, reference["labels"])
    requests = sum(len(option_requests(m.options, mode)) for g in groups for m in g.members)
    assert requests == len(label_requests) * {"decode": 3, "prefill": 5}[mode]
    stats = engine.cache_stats
    assert stats.hits > 0.7 * stats.queries, f"hit rate {stats.hit_rate:.2f}"


def test_per_row_choices_are_exact(engine, choice_requests, reference):
    """One-token choices ('Yes', 'No', 'Maybe') read together, the others decoded, per row."""
    results, _ = _score(engine, choice_requests)
    _check_exact(results, reference["choices"])
    assert {len(r.logp) for r in results.values()} == {2, 3, 4, 5}


def test_option_longer_than_the_model_len_is_an_error_row(engine, label_requests):
    first, second = label_requests[:2]
    limit = engine.settings.max_model_len
    too_long = OptionTokens.from_lists([[5], np.full(limit, 7)])
    group = PrefixGroup(np.zeros(0, np.int32), [GroupMember(1, first.token_ids, first.options),
                                                GroupMember(2, second.token_ids, too_long)])
    results = list(engine.score([group], None))
    assert [r.row_id for r in results] == [1, 2]
    assert results[0].error is None
    assert "longer than" in results[1].error and np.isnan(results[1].logp).all()
