"""Speculative prefill: kept-token sets, original position ids, the group union, token importance
against eager attention, and keep 1.0 reproducing the exact scores (tiny random models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchscore.engines.speculative.kept_tokens import (
    DISTINCT,
    EXACT,
    SHARED,
    SINK_TOKENS,
    GroupDecision,
    PrunedGroup,
    SpecPrefillOptions,
    decide,
    drop_stats,
    forced_mask,
    kept_count,
    prune_group,
    select_kept,
    speculator_shape,
)
from batchscore.engines.shape import ModelShape
from batchscore.engines.torch.engine import TorchEngine
from batchscore.scores.normalize import normalize_totals
from batchscore.plan.types import GroupMember, PrefixGroup
from tests.test_hybrid_prefill import max_dp
from tests.test_torch_engine import LABELS, VOCAB, make_groups, tiny_model

EXACT_TOLERANCE = 1e-5  # keep 1.0 against the exact engine, float32
POSITION_TOLERANCE = 1e-4  # pruned groups against a plain forward of the kept tokens, float32
NO_SPECIALS = np.zeros(0, np.int64)


def tokens(rng, n: int) -> np.ndarray:
    return rng.integers(20, VOCAB, n, dtype=np.int32)  # ids < 20 are free for "special" tokens


# ------------------------------------------------------------------------------ kept-token sets


def test_forced_tokens_are_sink_specials_and_last_chunk():
    prompt = np.array([1, 50, 51, 52, 53, 54, 7, 55, 56, 57, 58, 59, 60, 61, 62, 63], np.int32)
    forced = forced_mask(prompt, np.array([7]), chunk=3)
    assert np.flatnonzero(forced).tolist() == [*range(SINK_TOKENS), 6, 13, 14, 15]
    # a shared prefix keeps the tail before each member's end that falls inside it
    forced = forced_mask(prompt[:12], NO_SPECIALS, chunk=3, ends=[13, 20])
    assert np.flatnonzero(forced).tolist() == [0, 1, 2, 3, 10, 11]


def test_select_kept_takes_top_chunks_to_the_exact_budget():
    n, chunk = 40, 4
    importance = np.zeros(n)
    importance[16:20] = 1.0  # chunk 4: the most important
    importance[28:32] = 0.5  # chunk 7: second
    importance[9] = 0.3  # chunk 2: third (mean 0.075)
    forced = forced_mask(np.full(n, 99, np.int32), NO_SPECIALS, chunk)  # sink 0..3, last chunk 36..39
    kept = select_kept(importance, forced, keep=0.3, chunk=chunk)  # budget ceil(12) = 12 = 8 forced + 4
    assert kept.tolist() == [0, 1, 2, 3, 16, 17, 18, 19, 36, 37, 38, 39]
    kept = select_kept(importance, forced, keep=0.45, chunk=chunk)  # 18 = 8 + chunk 4 + chunk 7 + 2 of chunk 2
    assert kept.tolist() == [0, 1, 2, 3, 8, 9, 16, 17, 18, 19, 28, 29, 30, 31, 36, 37, 38, 39]
    assert len(kept) == kept_count(n, int(forced.sum()), 0.45)
    # forced tokens over the budget: exactly the forced ones
    assert select_kept(importance, forced, keep=0.1, chunk=chunk).tolist() == np.flatnonzero(forced).tolist()
    assert select_kept(importance, forced, keep=1.0, chunk=chunk).tolist() == list(range(n))


def test_group_union_keeps_what_any_member_needs():
    rng = np.random.default_rng(0)
    group = PrefixGroup(tokens(rng, 64), [GroupMember(0, tokens(rng, 5)), GroupMember(1, tokens(rng, 7))])
    options = SpecPrefillOptions(keep=0.25, chunk=8, pool=1)  # prefix budget 16 = sink 4 + 12
    decision = decide(group, options, NO_SPECIALS, speculator_cost=0.0)
    assert decision.mode == SHARED
    first, second = np.zeros(69), np.zeros(71)
    first[16:24] = 1.0  # member 0 reads prefix chunk 2
    second[40:48] = 0.9  # member 1 reads prefix chunk 5
    second[16:24] = 0.1
    pruned = prune_group(group, decision, [first, second], options)
    # sink, the prefix tail before member 0's end (its suffix is shorter than a chunk), then the
    # union's top chunks: all of member 0's chunk 2, and the one token left of member 1's chunk 5
    assert pruned.prefix_positions.tolist() == [0, 1, 2, 3, *range(16, 24), 40, 61, 62, 63]
    assert len(pruned.prefix_positions) == kept_count(64, int(decision.prefix_forced.sum()), 0.25) == 16
    assert np.array_equal(pruned.prefix, group.prefix[pruned.prefix_positions])
    # suffixes are whole, at their original positions after the full prefix
    assert [m.suffix.tolist() for m in pruned.members] == [m.suffix.tolist() for m in group.members]
    assert pruned.member_positions[0].tolist() == list(range(64, 69))
    assert pruned.member_positions[1].tolist() == list(range(64, 71))


def test_decide_picks_the_cheaper_mode():
    rng = np.random.default_rng(1)
    options = SpecPrefillOptions(keep=0.3, chunk=8)
    long_prefix = PrefixGroup(tokens(rng, 400), [GroupMember(i, tokens(rng, 10)) for i in range(4)])
    short_prefix = PrefixGroup(tokens(rng, 20), [GroupMember(i, tokens(rng, 300)) for i in range(4)])
    plain = PrefixGroup(np.zeros(0, np.int32), [GroupMember(i, tokens(rng, 200)) for i in range(3)])
    tiny = PrefixGroup(np.zeros(0, np.int32), [GroupMember(0, tokens(rng, 10))])
    assert decide(long_prefix, options, NO_SPECIALS, 0.25).mode == SHARED
    assert decide(short_prefix, options, NO_SPECIALS, 0.25).mode == DISTINCT
    assert decide(plain, options, NO_SPECIALS, 0.25).mode == DISTINCT
    assert decide(tiny, options, NO_SPECIALS, 0.25).mode == EXACT  # all forced: nothing to drop
    assert decide(plain, SpecPrefillOptions(keep=1.0), NO_SPECIALS, 0.25).mode == EXACT
    assert decide(plain, SpecPrefillOptions(keep=0.9, chunk=8), NO_SPECIALS, 0.5).mode == EXACT  # speculator costs more


# ------------------------------------------------------------------------------ original positions


@torch.inference_mode()
def reference_on_kept(model, pruned: PrunedGroup, labels) -> dict[int, np.ndarray]:
    """log P(label) of a plain forward of each member's kept tokens at their original positions."""
    out = {}
    for index, member in enumerate(pruned.members):
        ids = np.concatenate([pruned.prefix, member.suffix]).astype(np.int64)
        positions = np.concatenate([pruned.prefix_positions, pruned.member_positions[index]])
        logits = model(input_ids=torch.from_numpy(ids)[None], position_ids=torch.from_numpy(positions)[None]).logits
        out[member.row_id] = torch.log_softmax(logits[0, -1].float(), dim=-1)[labels].numpy()
    return out


def random_pruned_groups(seed: int = 3) -> list[PrunedGroup]:
    """Shared and distinct pruned groups with random kept sets (positions with gaps)."""
    rng = np.random.default_rng(seed)

    def kept(n: int, fraction: float) -> np.ndarray:
        chosen = rng.random(n) < fraction
        chosen[-1] = True
        return np.flatnonzero(chosen)

    groups = []
    for prefix_len, suffixes in [(90, [6, 0, 30, 1, 12]), (70, [60, 3])]:  # a long suffix (> budget 48) too
        prefix = tokens(rng, prefix_len)
        members = [GroupMember(10 * len(groups) + i, tokens(rng, n)) for i, n in enumerate(suffixes)]
        positions = kept(prefix_len, 0.4)
        groups.append(PrunedGroup(prefix[positions], members, prefix_positions=positions,
                                  member_positions=[np.arange(prefix_len, prefix_len + n) for n in suffixes],
                                  mode=SHARED))
    members, member_positions = [], []
    for i, n in enumerate([50, 80, 9, 120]):
        positions = kept(n, 0.5)
        members.append(GroupMember(100 + i, tokens(rng, n)[positions]))
        member_positions.append(positions)
    groups.append(PrunedGroup(np.zeros(0, np.int32), members, member_positions=member_positions, mode=DISTINCT))
    return groups


@pytest.mark.parametrize("budget, hybrid", [(48, None), (48, 7), (4096, None)])
def test_pruned_groups_run_at_their_original_positions(budget, hybrid):
    """Kept tokens at their original position ids: a pruned prefix in chunks, suffixes starting at
    the original prefix length, pruned whole prompts, long suffixes, ride-along prefixes (budget
    4096) and hybrid prefilling all equal a plain forward of the kept tokens with those ids."""
    groups = random_pruned_groups()
    reference = {}
    for group in groups:
        reference.update(reference_on_kept(tiny_model("llama"), group, LABELS))
    engine = TorchEngine(tiny_model("llama"), token_budget=budget, hybrid_chunk=hybrid)
    results = list(engine.score(groups, LABELS))
    assert [r.row_id for r in results] == [m.row_id for g in groups for m in g.members]
    worst = max(np.abs(np.exp(normalize_totals(r.logp)[0]) - np.exp(normalize_totals(reference[r.row_id])[0])).max()
                for r in results)
    assert worst <= POSITION_TOLERANCE
    assert engine.metrics.processed_tokens == sum(g.processed_tokens for g in groups)
    # the positions matter: the same kept tokens renumbered from 0 score differently
    group = groups[-1]
    shifted = PrunedGroup(group.prefix, group.members, member_positions=[np.arange(len(m.suffix)) for m in group.members])
    moved = list(TorchEngine(tiny_model("llama"), token_budget=budget).score([shifted], LABELS))
    assert max_dp(moved, results[-len(moved):]) > 1e-3


# ------------------------------------------------------------------------------ keep 1.0 and importance


def exact_and_speculative(groups, keep: float, **engine_options):
    exact = list(TorchEngine(tiny_model("llama"), token_budget=48, **engine_options).score(groups, LABELS))
    options = SpecPrefillOptions(keep=keep, speculator="layers:1", chunk=4, pool=3)
    engine = TorchEngine(tiny_model("llama"), token_budget=48, speculative=options, **engine_options)
    return exact, list(engine.score(groups, LABELS)), engine


def test_keep_one_reproduces_exact_scores():
    groups = make_groups()
    exact, approx, engine = exact_and_speculative(groups, keep=1.0)
    assert max_dp(approx, exact) <= EXACT_TOLERANCE
    assert engine.speculator.metrics.groups == {EXACT: len(groups)}  # nothing to drop: no speculator pass
    # the pruned path itself, with every token kept, equals the exact engine too
    options = SpecPrefillOptions(keep=1.0, chunk=4)
    full = []
    for group in groups:
        ones = [np.ones(group.prefix_len + len(m.suffix)) for m in group.members]
        for mode in (SHARED, DISTINCT) if group.prefix_len else (DISTINCT,):
            forced = forced_mask(group.prefix, NO_SPECIALS, 4, [group.prefix_len + len(m.suffix) for m in group.members])
            member_forced = tuple(forced_mask(group.full_prompt(m), NO_SPECIALS, 4) for m in group.members)
            decision = GroupDecision(mode, 0, 0, 0, prefix_forced=forced, member_forced=member_forced)
            full.append(prune_group(group, decision, ones, options))
    by_row = {r.row_id: r for r in exact}
    results = list(TorchEngine(tiny_model("llama"), token_budget=48).score(full, LABELS))
    assert max_dp(results, [by_row[r.row_id] for r in results]) <= EXACT_TOLERANCE


def test_dropping_changes_scores_and_counts_what_the_plan_predicts():
    groups = make_groups()
    exact, approx, engine = exact_and_speculative(groups, keep=0.3)
    assert [r.row_id for r in approx] == [r.row_id for r in exact]
    assert max_dp(approx, exact) > 1e-3  # approximate (random weights)
    shape = ModelShape.from_config(engine.model.config)
    options = engine.speculator.options
    stats = drop_stats(groups, options, shape, NO_SPECIALS, len(LABELS), speculator_shape(shape, options))
    assert engine.metrics.processed_tokens == stats.main_tokens < stats.main_tokens_exact
    assert engine.speculator.metrics.context_tokens <= stats.speculator_tokens


@pytest.mark.parametrize("hybrid, memory", [(7, None), (None, 64 * 2**20)])
def test_speculative_composes_with_hybrid_prefilling_and_memory_batching(hybrid, memory):
    groups = make_groups(seed=4)
    _, plain, _ = exact_and_speculative(groups, keep=0.3)
    _, composed, engine = exact_and_speculative(groups, keep=0.3, hybrid_chunk=hybrid, memory_budget=memory)
    assert max_dp(composed, plain) <= EXACT_TOLERANCE  # same kept tokens, same scores


@torch.inference_mode()
def reference_importance(model, prompt: np.ndarray, labels: list[int], layers: int, pool: int) -> np.ndarray:
    """Token importance from eager attention probabilities of full forwards (the definition)."""
    n = len(prompt)
    rows = []  # [Q] of [layers, H, n]
    out = model(input_ids=torch.from_numpy(prompt.astype(np.int64))[None], output_attentions=True)
    rows.append(torch.stack([a[0, :, n - 1, :n] for a in out.attentions[:layers]]))
    for label in labels:
        ids = np.append(prompt, label).astype(np.int64)
        out = model(input_ids=torch.from_numpy(ids)[None], output_attentions=True)
        probs = torch.stack([a[0, :, n, :n] for a in out.attentions[:layers]])
        rows.append(probs / probs.sum(-1, keepdim=True))  # softmax over the prompt only
    probs = torch.stack(rows)  # [Q, layers, H, n]
    pooled = torch.nn.functional.avg_pool1d(probs.reshape(-1, 1, n), pool, 1, pool // 2)[..., :n].reshape(probs.shape)
    return pooled.amax(dim=(1, 2)).mean(0).double().numpy()


@pytest.mark.parametrize("arch, layers, hybrid", [("llama", 2, None), ("llama", 2, 5), ("qwen2", 2, None), ("llama", 1, None)])
def test_importance_equals_eager_attention_of_the_first_layers(arch, layers, hybrid):
    rng = np.random.default_rng(2)
    group = PrefixGroup(tokens(rng, 30), [GroupMember(0, tokens(rng, 9)), GroupMember(1, tokens(rng, 0)),
                                          GroupMember(2, tokens(rng, 1)), GroupMember(3, tokens(rng, 40))])
    options = SpecPrefillOptions(keep=0.3, speculator=f"layers:{layers}", chunk=4, pool=5)
    reference_model = tiny_model(arch)
    reference_model.set_attn_implementation("eager")
    engine = TorchEngine(tiny_model(arch), token_budget=16, hybrid_chunk=hybrid, speculative=options)  # members in chunks
    labels = torch.tensor(LABELS)
    importance = engine.speculator.importance(group, labels)
    for member, got in zip(group.members, importance):
        expected = reference_importance(reference_model, group.full_prompt(member), LABELS, layers, pool=5)
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------------------ job file, plan, output


def test_config_section_defaults_overrides_and_problems(tmp_path):
    from batchscore.errors import JobConfigError
    from batchscore.jobfile import config_from_dict, load_job

    base = {"input": {"path": "x.parquet"}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"]}
    assert config_from_dict(base).engine.speculative is None  # off by default
    spec = config_from_dict({**base, "engine": {"speculative": {}}}).engine.speculative
    assert (spec.keep, spec.speculator, spec.chunk, spec.pool) == (0.3, "layers:8", 32, 13)
    with pytest.raises(JobConfigError) as error:
        config_from_dict({**base, "engine": {"speculative": {"kep": 0.2}}})
    assert "did you mean engine.speculative.keep" in str(error.value)
    with pytest.raises(JobConfigError) as error:
        config_from_dict({**base, "engine": {"kind": "vllm", "speculative": {"keep": 1.5, "speculator": "layers:0",
                                                                             "chunk": 0, "pool": 0}}})
    for key in ("keep", "speculator", "chunk", "pool"):
        assert f"engine.speculative.{key}" in str(error.value)
    assert "engine.kind: torch" in str(error.value)
    job = tmp_path / "job.yaml"
    job.write_text("input: {path: x.parquet}\nprompt: {template: '{q}'}\nlabels: [Yes, No]\n")
    spec = load_job(job, {"engine.speculative.keep": "0.1", "engine.speculative.speculator": "layers:4"}).engine.speculative
    assert (spec.keep, spec.speculator, spec.chunk) == (0.1, "layers:4", 32)
    (tmp_path / "small").mkdir()  # a speculator model folder next to the job file
    spec = load_job(job, {"engine.speculative.speculator": "small"}).engine.speculative
    assert spec.speculator == str(tmp_path / "small")


def test_plan_json_reports_main_tokens_with_and_without_dropping(job_factory, small_input):
    import json

    from tests.test_cli import invoke

    exact = json.loads(invoke("plan", job_factory(small_input), "--json").output)
    assert not any(key.startswith("speculative_") for key in exact)
    result = invoke("plan", job_factory(small_input, engine={"speculative": {"keep": 0.3}}), "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output)
    assert stats["speculative_main_tokens_exact"] == stats["processed_tokens"] == exact["processed_tokens"]
    assert 0 < stats["speculative_main_tokens"] < stats["speculative_main_tokens_exact"]
    assert stats["speculative_groups_shared"] == 3  # one product page per group, pruned once
    assert stats["speculative_speculator_tokens"] == stats["processed_tokens"]
    assert stats["speculative_flop_ideal_speedup"] > 1.0


@pytest.mark.slow  # a whole run with the speculator (~8 s); make test keeps the speculator's unit tests
def test_run_marks_rows_approximate_and_keep_one_is_exact(job_factory, small_input, tmp_path, model_dir):
    import json

    import pyarrow.parquet as pq

    from batchscore.engines.speculative.kept_tokens import plan_drop_stats
    from batchscore.run.open import open_job
    from batchscore.store.build import plan_store
    from tests.test_cli import invoke

    assert invoke("run", job_factory(small_input), "-q", "-o", tmp_path / "exact.parquet").exit_code == 0
    exact = pq.read_table(tmp_path / "exact.parquet").to_pandas()
    assert "approx_keep" not in exact.columns
    for keep in (1.0, 0.3):
        job = job_factory(small_input, engine={"speculative": {"keep": keep}})
        out, metrics = tmp_path / f"keep{keep}.parquet", tmp_path / f"keep{keep}.json"
        result = invoke("run", job, "-q", "-o", out, "--metrics", metrics)
        assert result.exit_code == 0, result.output
        table = pq.read_table(out).to_pandas()
        assert (table["approx_keep"] == keep).all() and (table["status"] == "ok").all()
        assert json.loads(metrics.read_text())["approx_keep"] == keep
        dp = (table["p_Yes"] - exact["p_Yes"]).abs().max()
        if keep == 1.0:
            assert dp <= EXACT_TOLERANCE
        else:
            assert 0 < dp < 0.5
    # the engine runs exactly the main-model tokens the plan reported, keeping the chat markers
    from transformers import AutoTokenizer

    from batchscore.engines.speculative.kept_tokens import special_token_ids
    from batchscore.jobfile import load_job
    from batchscore.prepare.prompts import label_token_ids

    config = load_job(job)
    meta, store, _ = plan_store(open_job(config, for_output=False), tmp_path / "tokens")
    groups = meta.to_plan(store).groups
    stats = plan_drop_stats(groups, config.engine.speculative, model_dir, 2)
    options = SpecPrefillOptions.from_config(config.engine.speculative)
    engine = TorchEngine.from_pretrained(model_dir, token_budget=1024, speculative=options)
    labels = label_token_ids(AutoTokenizer.from_pretrained(str(model_dir)), ["Yes", "No"])
    pruned = list(engine.speculator.pruned(groups, engine._label_tensor(labels)))
    specials = special_token_ids(model_dir)
    assert {1, 2} <= set(specials.tolist())  # <|im_start|>, <|im_end|>
    for group, kept in zip(groups, pruned):
        assert kept.mode == SHARED
        assert np.isin(group.prefix, specials).sum() == np.isin(kept.prefix, specials).sum() > 0
    assert sum(g.processed_tokens for g in pruned) == stats.main_tokens


# ------------------------------------------------------------------------------ benchmark


def test_docqa_workloads_are_real_text_with_known_answers(tokenizer):
    from batchscore.bench.docqa import COLORS, distinct_documents, label_words, shared_documents
    from batchscore.bench.haystack import SENTENCES
    from batchscore.prepare.prompts import label_token_ids

    assert len(label_token_ids(tokenizer, label_words())) == len(COLORS)  # one token each
    items = distinct_documents(tokenizer, 4, min_tokens=300, max_tokens=400, seed=3)
    for item in items:
        fact = item.text.split("Question: What color is the ")[1].split("?")[0]
        assert f"The {fact} is {COLORS[item.answer]}." in item.text
        assert 280 <= len(tokenizer(item.text)["input_ids"]) <= 420
        assert sum(sentence in item.text for sentence in SENTENCES) >= 5  # real sentences, not random tokens
    assert len({item.text for item in items}) == 4
    shared = shared_documents(tokenizer, 2, 3, min_tokens=300, max_tokens=400)
    assert [item.document for item in shared] == [0, 0, 0, 1, 1, 1]
    for item in shared:
        fact = item.text.split("Question: What color is the ")[1].split("?")[0]
        assert f"The {fact} is {COLORS[item.answer]}." in item.text
    body = shared[0].text.split("\n\nQuestion:")[0]
    assert all(item.text.startswith(body) for item in shared[:3])


def test_specprefill_bench_writes_table_and_plot(tmp_path, tiny_llama):
    import json

    from click.testing import CliRunner

    from batchscore.bench.specprefill import specprefill

    out = tmp_path / "out"
    result = CliRunner().invoke(specprefill, ["--model", str(tiny_llama), "--docs", "3", "--shared-docs", "1",
                                              "--questions", "2", "--min-tokens", "200", "--max-tokens", "260",
                                              "--keeps", "0.3,1", "--speculator", "layers:1", "--chunk", "8",
                                              "--token-budget", "512", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {"specprefill.md", "specprefill.json", "specprefill.png"}
    report = json.loads((out / "specprefill.json").read_text())
    assert [w["name"] for w in report["workloads"]] == ["docqa-distinct", "docqa-shared"]
    for workload in report["workloads"]:
        exact, approx, full = workload["points"]
        assert (exact["keep"], approx["keep"], full["keep"]) == (None, 0.3, 1.0)
        assert approx["main_tokens"] < exact["main_tokens"] == full["main_tokens"] == workload["exact_tokens"]
        assert approx["speculator_tokens"] > 0 and approx["flop_ideal"] > 1.0
        assert full["max_dp"] <= EXACT_TOLERANCE and full["agreement"] == 1.0
    assert report["workloads"][1]["points"][1]["groups_by_mode"] == {"shared": 1}
    assert "| 0.3 |" in (out / "specprefill.md").read_text()


def test_flop_ideal_of_keep_03_with_eight_layers_on_long_documents(tokenizer, model_dir):
    """The arithmetic behind the CPU acceptance point: main-model FLOPs at keep 0.3 plus the
    speculator's (7 layers and the 8th layer's keys over every token, plus the probes)."""
    from batchscore.bench.docqa import distinct_documents
    from batchscore.engines.speculative.kept_tokens import special_token_ids
    from batchscore.engines.shape import read_model_config
    from batchscore.plan import build_plan, requests_from_token_lists

    items = distinct_documents(tokenizer, 6, seed=0)
    groups = build_plan(requests_from_token_lists([tokenizer(i.text)["input_ids"] for i in items])).groups
    shape = ModelShape.from_config(read_model_config(model_dir))
    options = SpecPrefillOptions(keep=0.3, speculator="layers:8")
    stats = drop_stats(groups, options, shape, special_token_ids(model_dir), 6, speculator_shape(shape, options))
    assert stats.groups_distinct == len(groups) and stats.groups_exact == 0
    assert 0.29 < stats.main_tokens / stats.main_tokens_exact < 0.31
    assert 0.2 < stats.speculator_flops / stats.main_flops_exact < 0.26  # ~7.1 of 30 layers
    assert 1.9 < stats.flop_ideal_speedup < 2.2


def test_random_weight_speed_mode_runs_with_a_separate_speculator(tmp_path):
    import json

    from click.testing import CliRunner

    from batchscore.bench.specprefill import specprefill

    result = CliRunner().invoke(specprefill, ["--random-weights", "tiny-llama:tiny-llama-speculator", "--lengths", "128",
                                              "--requests", "2", "--device", "cpu", "--keeps", "0.3", "--chunk", "8",
                                              "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    exact, approx = json.loads((tmp_path / "specprefill_random.json").read_text())["points"]
    assert exact["keep"] is None and exact["main_tokens"] == 256
    assert approx["keep"] == 0.3 and approx["main_tokens"] == 2 * 39 and approx["flop_ideal"] > 1
