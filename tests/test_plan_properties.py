"""Hypothesis properties of build_plan over small, heavily-sharing token alphabets."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchscore.plan import PlanOptions, build_plan, requests_from_token_lists, simulate_groups

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    """Prompts built from a few shared stems plus short tails over a tiny alphabet."""
    alphabet = st.integers(0, 3)
    stems = draw(st.lists(st.lists(alphabet, min_size=0, max_size=12), min_size=1, max_size=4))
    prompts = []
    for _ in range(draw(st.integers(1, 24))):
        stem = draw(st.sampled_from(stems))
        tail = draw(st.lists(alphabet, min_size=0, max_size=6))
        prompt = stem + tail
        prompts.append(prompt if prompt else [draw(alphabet)])
    return prompts


options_strategy = st.builds(
    PlanOptions,
    min_prefix_tokens=st.integers(0, 5),
    block_size=st.integers(1, 4),
    order=st.sampled_from(["r_group", "input", "srjf"]),
    enlarge=st.booleans(),
    cache_tokens=st.one_of(st.none(), st.integers(0, 40)),
)


def plan_of(prompts, options):
    row_ids = [10 + 3 * i for i in range(len(prompts))]
    return build_plan(requests_from_token_lists(prompts, row_ids=row_ids), options)


@SETTINGS
@given(batches(), options_strategy)
def test_every_request_once_and_tokens_reproduced(prompts, options):
    plan = plan_of(prompts, options)
    seen = {}
    for group in plan.groups:
        assert group.members
        for member in group.members:
            assert member.row_id not in seen
            seen[member.row_id] = np.concatenate([group.prefix, member.suffix]).tolist()
    assert seen == {10 + 3 * i: p for i, p in enumerate(prompts)}
    stats = plan.stats
    assert stats.num_requests == len(prompts) and stats.num_groups == len(plan.groups)
    assert stats.logical_tokens == sum(map(len, prompts))
    assert stats.processed_tokens == sum(g.processed_tokens for g in plan.groups)
    for group in plan.groups:
        assert group.prefix_len % options.block_size == 0
        if group.prefix_len:
            assert len(group.members) >= 2 and group.prefix_len >= options.min_prefix_tokens
    # No two empty-prefix groups in a row: plain requests are merged for batching.
    flags = [g.prefix_len == 0 for g in plan.groups]
    assert not any(a and b for a, b in zip(flags, flags[1:]))


@SETTINGS
@given(batches(), options_strategy)
def test_saving_ratios_are_ordered(prompts, options):
    stats = plan_of(prompts, options).stats
    enlarged = plan_of(prompts, PlanOptions(**{**options.__dict__, "enlarge": True})).stats
    eps = 1e-12
    assert enlarged.saving_ratio + eps >= enlarged.first_level_saving_ratio
    assert stats.saving_ratio <= stats.unaligned_saving_ratio + eps
    assert stats.unaligned_saving_ratio <= stats.multilevel_saving_ratio + eps
    assert 0.0 <= stats.saving_ratio < 1.0


@SETTINGS
@given(batches(), options_strategy)
def test_plan_is_deterministic(prompts, options):
    a, b = plan_of(prompts, options), plan_of(list(prompts), options)
    def shape(plan):
        return [
            (g.prefix.tolist(), [(m.row_id, m.suffix.tolist()) for m in g.members])
            for g in plan.groups
        ]

    assert shape(a) == shape(b)
    assert {k: v for k, v in a.stats.to_dict().items() if "seconds" not in k} == {
        k: v for k, v in b.stats.to_dict().items() if "seconds" not in k
    }


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(1, 4))
def test_unbounded_cache_replays_plan_within_its_token_count(prompts, block_size):
    plan = plan_of(prompts, PlanOptions(block_size=block_size, min_prefix_tokens=0))
    sim = simulate_groups(plan.groups, None, block_size)
    # A member with an empty suffix reuses the prefix's last logits in the plan, while the
    # simulated vLLM cache recomputes a fully cached prompt's last token.
    empty = sum(1 for g in plan.groups for m in g.members if len(m.suffix) == 0)
    assert sim.processed_tokens <= plan.stats.processed_tokens + empty


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), max_size=12), max_size=20), st.one_of(st.none(), st.integers(0, 12)),
       st.one_of(st.none(), st.integers(1, 61)))
def test_prompt_problems_names_the_rows_prompt_problem_names(rows, max_length, vocab_size):
    """The vectorized check (one mask per batch) refuses exactly the prompts the per-prompt one
    refuses, with the same message."""
    from batchscore.plan.validate import prompt_problem, prompt_problems, row_maxima

    lengths = np.asarray([len(r) for r in rows], dtype=np.int64)
    flat = np.asarray([t for r in rows for t in r], dtype=np.int64)
    found = prompt_problems(lengths, row_maxima(flat, lengths), max_length, vocab_size=vocab_size)
    expected = {i: prompt_problem(len(r), max_length, largest_token=max(r) if r else None, vocab_size=vocab_size)
                for i, r in enumerate(rows)}
    assert found == {i: p for i, p in expected.items() if p is not None}
