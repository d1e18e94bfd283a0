"""TorchEngine: shared-prefix scoring equals a plain forward pass of every full prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from batchscore.engines.torch.engine import TorchEngine
from batchscore.engines.torch.long_prompts import plan_suffix_batches  # noqa: E402
from batchscore.scores.normalize import normalize_totals  # noqa: E402
from batchscore.plan.types import GroupMember, PrefixGroup  # noqa: E402

VOCAB = 1000
LABELS = [3, 17, 256, 999]
BUDGET = 48  # small, so prefixes and long suffixes are chunked and suffix batches split
FLOAT32_TOLERANCE = 1e-4  # max |ΔP| against a plain forward pass
# bfloat16: measured max |ΔP| 0.9e-2 .. 1.65e-2 (3 seeds × 2 archs); that is below bfloat16's own
# rounding noise here (plain bfloat16 forward vs float32: up to 4.5e-2).
BFLOAT16_TOLERANCE = 2.5e-2


def tiny_model(arch: str, dtype: torch.dtype = torch.float32):
    """A 2-layer random model with GQA (4 query heads, 2 KV heads); Qwen2 has attention bias."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # peaked next-token distributions, so errors show in P(label)
        tie_word_embeddings=False,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    return model.to(dtype).eval()


def make_groups(seed: int = 0) -> list[PrefixGroup]:
    """Groups covering every path of the engine (with BUDGET = 48)."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, VOCAB, n, dtype=np.int32)

    return [
        # short prefix, suffixes of different lengths, one empty suffix, batches split by budget
        PrefixGroup(tokens(20), [GroupMember(0, tokens(5)), GroupMember(1, tokens(17)), GroupMember(2, tokens(0)),
                                 GroupMember(3, tokens(30)), GroupMember(4, tokens(1)), GroupMember(5, tokens(12))]),
        # plain requests (empty prefix), packed whole prompts
        PrefixGroup(tokens(0), [GroupMember(10, tokens(9)), GroupMember(11, tokens(23)), GroupMember(12, tokens(2))]),
        # prefix longer than the budget (3 chunks), a suffix longer than the budget, an empty suffix
        PrefixGroup(tokens(110), [GroupMember(20, tokens(7)), GroupMember(21, tokens(60)), GroupMember(22, tokens(0)),
                                  GroupMember(23, tokens(48)), GroupMember(24, tokens(3))]),
        # single member, equal suffix lengths
        PrefixGroup(tokens(33), [GroupMember(30, tokens(8))]),
        PrefixGroup(tokens(5), [GroupMember(40 + i, tokens(10)) for i in range(4)]),
    ]


@torch.inference_mode()
def reference_log_probs(model, groups: list[PrefixGroup], labels: list[int]) -> dict[int, np.ndarray]:
    """log P(label) from `model(full prompt).logits[0, -1]`, one separate forward per prompt."""
    out = {}
    for group in groups:
        for member in group.members:
            ids = torch.from_numpy(np.concatenate([group.prefix, member.suffix]).astype(np.int64))[None]  # [1, T]
            logits = model(input_ids=ids).logits[0, -1].float()  # [V]
            out[member.row_id] = torch.log_softmax(logits, dim=-1)[labels].numpy()
    return out


def max_probability_error(model, groups, token_budget: int) -> tuple[float, list]:
    """Score with the engine and return (max |ΔP| over labels and label mass, the results)."""
    reference = reference_log_probs(model, groups, LABELS)  # before the engine switches attention
    engine = TorchEngine(model, token_budget=token_budget)
    results = list(engine.score(groups, LABELS))
    worst = 0.0
    for result in results:
        ref_log_probs, ref_mass = normalize_totals(reference[result.row_id])
        log_probs, mass = normalize_totals(result.logp)  # as the output normalizes them
        worst = max(worst, np.abs(np.exp(log_probs) - np.exp(ref_log_probs)).max(), abs(mass[0] - ref_mass[0]))
    return worst, results, engine


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_matches_plain_forward(arch):
    groups = make_groups()
    error, results, engine = max_probability_error(tiny_model(arch), groups, BUDGET)
    assert error <= FLOAT32_TOLERANCE
    # one result per member, group by group, members in order
    assert [r.row_id for r in results] == [m.row_id for g in groups for m in g.members]
    for result in results:  # raw totals: the labels' share of the full vocabulary, not normalized
        assert result.logp.shape == (len(LABELS),) and result.logp.dtype == np.float64
        assert 0 < np.exp(result.logp).sum() < 0.5  # 4 of 1000 tokens of a random model
    # the test is sensitive: label probabilities vary a lot between prompts
    assert np.ptp([np.exp(normalize_totals(r.logp)[0][0, 0]) for r in results]) > 0.2
    # the prefix is processed once per group, no batch exceeds the budget
    assert engine.metrics.processed_tokens == sum(g.processed_tokens for g in groups)
    assert max(engine.metrics.batch_token_counts) <= BUDGET
    assert engine.metrics.batches == len(engine.metrics.batch_token_counts)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_close_to_plain_forward(arch):
    error, _, _ = max_probability_error(tiny_model(arch, torch.bfloat16), make_groups(seed=1), BUDGET)
    assert error <= BFLOAT16_TOLERANCE


def test_large_budget_packs_every_group_into_one_pass():
    # prefixes and suffixes of all five groups (433 tokens) in one forward pass, exactly
    groups = make_groups(seed=2)
    error, _, engine = max_probability_error(tiny_model("llama"), groups, token_budget=4096)
    assert error <= FLOAT32_TOLERANCE
    assert engine.metrics.batches == 1
    assert engine.metrics.processed_tokens == sum(g.processed_tokens for g in groups) <= 4096


def test_no_pass_builds_an_autograd_graph():
    """Every decoder pass (prefixes, suffixes, chunks) runs without autograd: a prefix pass that
    recorded a graph kept its activations alive with its KV, and made compiled layers recompile."""
    model = tiny_model("llama")
    modes = []
    model.get_decoder().register_forward_pre_hook(lambda module, args: modes.append(torch.is_grad_enabled()))
    engine = TorchEngine(model, token_budget=BUDGET)
    results = list(engine.score(make_groups(seed=6), LABELS))
    assert results and modes and not any(modes)
    assert not any(p.requires_grad for p in model.parameters())


def test_plan_suffix_batches_respects_budget_and_order():
    batches = plan_suffix_batches([5, 0, 10, 7, 30, 3], token_budget=20)
    assert [(b.member_indices, b.chunked) for b in batches] == [
        ([0, 2], False),  # 15 tokens; adding 7 would exceed 20
        ([4], True),  # longer than the budget: prefilled alone, in chunks
        ([3, 5], False),  # packing goes on around the long member
    ]


def test_plan_suffix_batches_bounds_padding():
    # one long suffix among many short ones: the padded view is capped at 2 × budget slots
    batches = plan_suffix_batches([40] + [1] * 30, token_budget=64)
    for batch in batches:
        lengths = [40 if i == 0 else 1 for i in batch.member_indices]
        assert len(lengths) * max(lengths) <= 128 and sum(lengths) <= 64
    assert sorted(i for b in batches for i in b.member_indices) == list(range(31))


def test_rejects_bad_input():
    engine = TorchEngine(tiny_model("llama"))
    assert engine.max_context == 512
    with pytest.raises(ValueError, match="label token id 1000"):
        list(engine.score(make_groups(), [VOCAB]))
    with pytest.raises(ValueError, match="longer than the maximum 512"):
        list(engine.score([PrefixGroup(np.zeros(500, np.int32), [GroupMember(0, np.zeros(20, np.int32))])], LABELS))
    with pytest.raises(ValueError, match="empty prompt"):
        list(engine.score([PrefixGroup(np.zeros(0, np.int32), [GroupMember(0, np.zeros(0, np.int32))])], LABELS))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        list(engine.score(make_groups(), LABELS))


def test_builtin_model_float32_matches_plain_forward(model_dir):
    path = model_dir  # the built-in model, converted once per machine (conftest)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def encode(text: str) -> np.ndarray:
        return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)

    prefix = encode("You judge product reviews. Answer Yes if the review is positive, No otherwise.\nReview: ")
    reviews = ["Great kettle, boils fast.", "Broke after two days, avoid.", "", "It is fine I guess, nothing special."]
    groups = [PrefixGroup(prefix, [GroupMember(i, encode(r + "\nPositive:") if r else encode(""))
                                   for i, r in enumerate(reviews)])]
    labels = [int(encode(" Yes")[0]), int(encode(" No")[0])]
    reference = reference_log_probs(model, groups, labels)
    engine = TorchEngine(model, token_budget=16)  # prefix in two chunks
    for result in engine.score(groups, labels):
        ref_log_probs, ref_mass = normalize_totals(reference[result.row_id])
        log_probs, mass = normalize_totals(result.logp)
        assert np.abs(np.exp(log_probs) - np.exp(ref_log_probs)).max() <= FLOAT32_TOLERANCE
        assert abs(mass[0] - ref_mass[0]) <= FLOAT32_TOLERANCE


def test_merge_partial_attention_equals_attention_over_all_keys():
    from batchscore.engines.torch.cascade_attention import merge_partial_attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8)  # [B, H, T, D]
    k, v = torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)  # [B, H_kv, S, D], GQA
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    full, full_lse = flash(q, k, v, 0.0, False)
    out_a, lse_a = flash(q, k[:, :, :4], v[:, :, :4], 0.0, False)
    out_b, lse_b = flash(q, k[:, :, 4:], v[:, :, 4:], 0.0, False)
    out, lse = merge_partial_attention(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal, rows, keys", [(True, 37, 37), (False, 5, 70)])
def test_attention_kernel_matches_float32_math(causal, rows, keys):
    """The kernel path (grouped-query: 6 query heads on 2 K/V heads) returns the same output and
    log-sum-exp as plain float32 math; the log-sum-exp is what the exact merges rely on."""
    from batchscore.engines.torch.cascade_attention import attention_with_lse, attention_with_lse_math

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, rows, 16, generator=generator)
    k, v = (torch.randn(2, 2, keys, 16, generator=generator) for _ in range(2))
    out, lse = attention_with_lse(q, k, v, causal, 0.25)
    ref_out, ref_lse = attention_with_lse_math(q, k, v, causal, 0.25)
    assert out.shape == (2, 6, rows, 16) and lse.shape == (2, 6, rows)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def decision_groups(seed: int = 7) -> list[PrefixGroup]:
    """The shape of decision and topic jobs: many small groups (a state × a few short questions),
    single-member groups (nothing to share) and one empty suffix among them."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, VOCAB, n, dtype=np.int32)

    groups, row = [], 0
    for number in range(14):
        degree = 1 if number % 4 == 3 else int(rng.integers(2, 5))
        members = []
        for _ in range(degree):
            members.append(GroupMember(row, tokens(0 if row == 5 else int(rng.integers(2, 9)))))
            row += 1
        groups.append(PrefixGroup(tokens(int(rng.integers(20, 45))), members))
    return groups


@pytest.mark.parametrize("hybrid_chunk", [None, 7])
def test_many_small_groups_fill_each_pass_exactly(hybrid_chunk):
    """Each pass holds the prefixes and suffixes of several groups (a prefix split where the room
    ends), up to the token budget; scores equal a plain forward; results come in plan order."""
    from tests.test_hybrid_prefill import max_dp

    groups = decision_groups()
    budget = 128
    model = tiny_model("llama")
    reference = reference_log_probs(model, groups, LABELS)
    engine = TorchEngine(model, token_budget=budget, hybrid_chunk=hybrid_chunk)
    results = list(engine.score(groups, LABELS))
    assert [r.row_id for r in results] == [m.row_id for g in groups for m in g.members]
    for result in results:
        ref_log_probs, _ = normalize_totals(reference[result.row_id])
        log_probs, _ = normalize_totals(result.logp)
        assert np.abs(np.exp(log_probs) - np.exp(ref_log_probs)).max() <= FLOAT32_TOLERANCE
    counts = engine.metrics.batch_token_counts
    processed = sum(g.processed_tokens for g in groups)
    assert sum(counts) == engine.metrics.processed_tokens == processed
    assert max(counts) <= budget and min(counts[:-1]) >= budget - 64  # every pass but the last filled
    assert len(counts) < len(groups) / 2  # one group per pass would take 14 passes
    if hybrid_chunk is None:  # the same scores as the hybrid path (checked once)
        hybrid = list(TorchEngine(model, token_budget=budget, hybrid_chunk=7).score(groups, LABELS))
        assert max_dp(hybrid, results) <= 1e-5


def test_many_small_groups_with_options_match_plain_forward():
    """Per-row options (multi-token choices, decision reads) over many groups per pass: option rows
    of several groups in one pass, each attending to its own prefix and suffix."""
    from batchscore.plan.options import OptionTokens
    from tests.option_reference import reference_option_logps

    rng = np.random.default_rng(3)
    groups = [PrefixGroup(g.prefix, [GroupMember(m.row_id, m.suffix, OptionTokens.from_lists(
        [rng.integers(0, VOCAB, int(rng.integers(1, 4))) for _ in range(int(rng.integers(2, 5)))]))
        for m in g.members]) for g in decision_groups()]
    model = tiny_model("qwen2")
    expected = {m.row_id: reference_option_logps(model, g.full_prompt(m), m.options) for g in groups for m in g.members}
    engine = TorchEngine(model, token_budget=160)
    results = list(engine.score(groups, None))
    assert [r.row_id for r in results] == [m.row_id for g in groups for m in g.members]
    assert max(float(np.abs(r.logp - expected[r.row_id]).max()) for r in results) <= 1e-4
    assert all(np.isfinite(r.top_logp) and r.top_logp <= 0 for r in results)
    assert engine.metrics.batches < len(groups) / 2


def test_single_member_groups_run_as_whole_prompts(monkeypatch):
    """A group of one member shares nothing: its prompt runs as one causal sequence, packed with
    the other whole prompts of the pass (the plain forward's attention: no prefix part, no merge)."""
    from batchscore.engines.torch import cascade_attention

    merges = []
    original = cascade_attention.merge_partial_attention
    monkeypatch.setattr(cascade_attention, "merge_partial_attention",
                        lambda *args: merges.append(1) or original(*args))
    rng = np.random.default_rng(9)
    groups = [PrefixGroup(rng.integers(0, VOCAB, 40, dtype=np.int32),
                          [GroupMember(i, rng.integers(0, VOCAB, 10, dtype=np.int32))]) for i in range(6)]
    error, results, engine = max_probability_error(tiny_model("llama"), groups, token_budget=128)
    assert error <= FLOAT32_TOLERANCE
    assert not merges
    assert engine.metrics.batch_token_counts == [100, 100, 100]  # two 50-token prompts per pass


def test_refused_group_raises_after_every_earlier_result():
    """A group the engine refuses stops the packing there: the earlier groups (which would share
    its pass) are scored and yielded first, nothing of the refused group runs."""
    groups = decision_groups()[:4]
    too_long = PrefixGroup(np.zeros(500, np.int32), [GroupMember(99, np.zeros(20, np.int32))])
    engine = TorchEngine(tiny_model("llama"), token_budget=4096)
    scores = engine.score(groups + [too_long] + groups, LABELS)
    rows = [next(scores).row_id for _ in range(sum(len(g.members) for g in groups))]
    assert rows == [m.row_id for g in groups for m in g.members]
    with pytest.raises(ValueError, match="row 99: .*longer than the maximum 512"):
        next(scores)
    assert engine.metrics.processed_tokens == sum(g.processed_tokens for g in groups)


def test_bfloat16_reads_float32_logits_and_leaves_the_plain_forward_alone():
    """In bfloat16 the read positions leave through a float32 final norm and float32 logits: a
    bfloat16 logit of ~20 is rounded to 0.125, which alone moves P(label) by ~0.01–0.03 on the real
    model. The final norm's float32 hook lives for the engine's own decoder calls only."""
    model = tiny_model("llama", torch.bfloat16)
    engine = TorchEngine(model, token_budget=BUDGET)
    rows = torch.randn(3, 64) * 4  # [C, hidden] float32, as the final norm now hands them over
    weight = model.lm_head.weight.double()  # [V, hidden] the bfloat16 weights, exactly
    exact = rows.double() @ weight.T  # [C, V]
    logits = engine._logits(rows)
    assert logits.dtype == torch.float32
    error = (logits.double() - exact).abs().max().item()
    rounding = (exact.to(torch.bfloat16).double() - exact).abs().max().item()  # what bfloat16 logits lose
    assert error < rounding / 100
    seen, logits_of = [], engine._logits
    engine._logits = lambda hidden: (seen.append(hidden.dtype), logits_of(hidden))[1]
    results = list(engine.score(make_groups(seed=1), LABELS))
    assert len(results) == sum(len(g.members) for g in make_groups(seed=1))
    assert seen and set(seen) == {torch.float32}  # the read rows came out of the float32 final norm
    hidden = torch.randn(2, 64, dtype=torch.bfloat16)
    assert not model.model.norm._forward_hooks and model.model.norm(hidden).dtype == torch.bfloat16
