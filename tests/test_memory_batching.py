"""Memory-centric token batching: batches close at the token or the memory budget; too-big rows fail clearly."""

from __future__ import annotations

import numpy as np
import pytest

from batchscore.engines.torch.memory import MemoryEstimator
from batchscore.engines.shape import ModelShape
from batchscore.errors import MemoryBudgetError
from batchscore.engines.torch.engine import TorchEngine
from batchscore.engines.torch.long_prompts import plan_suffix_batches
from batchscore.plan.types import GroupMember, PrefixGroup
from tests.test_hybrid_prefill import max_dp
from tests.test_torch_engine import LABELS, make_groups, tiny_model

SMOLLM2 = ModelShape(num_layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152,
                     dtype_bytes=4)


def test_model_shape_from_config():
    model = tiny_model("llama")
    shape = ModelShape.from_config(model.config, dtype_bytes=4)
    assert (shape.num_layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (2, 64, 4, 2, 16)
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert SMOLLM2.kv_bytes_per_token == 30 * 2 * 192 * 4  # the KV of all layers, per token


def test_estimates_grow_with_tokens_and_hybrid_is_smaller_for_long_prompts():
    plain, hybrid = MemoryEstimator(SMOLLM2), MemoryEstimator(SMOLLM2, hybrid_chunk=512)
    for estimator in (plain, hybrid):
        sizes = [estimator.suffix_batch_bytes(0, [n]) for n in (256, 1024, 4096, 8192)]
        assert sizes == sorted(sizes)
        assert estimator.suffix_batch_bytes(1000, [100]) - estimator.suffix_batch_bytes(0, [100]) == \
            estimator.kv_bytes(1000)  # a held prefix costs exactly its KV
    assert plain.suffix_batch_bytes(0, [8192]) > 3 * hybrid.suffix_batch_bytes(0, [8192])
    # without hybrid, a long suffix is prefilled in chunks and keeps its KV of all layers
    assert plain.long_suffix_bytes(0, 8192, 2048) >= plain.kv_bytes(8192)


def test_memory_closes_batches_without_a_request_cap():
    lengths = [1] * 500
    assert len(plan_suffix_batches(lengths, token_budget=4096)) == 1  # 500 requests, one batch
    estimator = MemoryEstimator(SMOLLM2)
    budget = estimator.suffix_batch_bytes(0, [1] * 100)
    batches = plan_suffix_batches(lengths, 4096, fits=lambda ls: estimator.suffix_batch_bytes(0, ls) <= budget)
    assert [len(b.member_indices) for b in batches] == [100] * 5
    assert sorted(i for b in batches for i in b.member_indices) == list(range(500))


def test_engine_batches_respect_memory_budget_and_scores_do_not_change():
    groups = make_groups(seed=6)
    model = tiny_model("llama")
    free = TorchEngine(model, token_budget=4096)
    reference = list(free.score(groups, LABELS))
    probe = TorchEngine(model, token_budget=4096)
    budget = max(probe.memory_needed(g, i) for g in groups for i in range(len(g.members)))
    tight = TorchEngine(model, token_budget=4096, memory_budget=budget)
    results = list(tight.score(groups, LABELS))
    assert max_dp(results, reference) <= 1e-6
    assert tight.metrics.batches > free.metrics.batches == 1  # the memory budget split the one pass
    assert len(tight.metrics.batch_token_counts) == tight.metrics.batches
    assert sum(tight.metrics.batch_token_counts) == tight.metrics.processed_tokens
    assert 0 < tight.largest_pass_bytes <= budget  # every packed pass's estimate stays within the budget


@pytest.mark.parametrize("hybrid_chunk", [None, 16])
def test_request_too_big_for_the_budget_raises_before_running(hybrid_chunk):
    rng = np.random.default_rng(0)
    small = PrefixGroup(rng.integers(0, 1000, 10, dtype=np.int32), [GroupMember(7, rng.integers(0, 1000, 5))])
    big = PrefixGroup(rng.integers(0, 1000, 10, dtype=np.int32),
                      [GroupMember(8, rng.integers(0, 1000, 5)), GroupMember(9, rng.integers(0, 1000, 400))])
    probe = TorchEngine(tiny_model("llama"), token_budget=64, hybrid_chunk=hybrid_chunk)
    budget = max(probe.memory_needed(small, 0), probe.memory_needed(big, 0))
    needed = probe.memory_needed(big, 1)
    assert needed > budget
    engine = TorchEngine(tiny_model("llama"), token_budget=64, hybrid_chunk=hybrid_chunk, memory_budget=budget)
    assert [(p.row_id, p.needed_bytes) for p in engine.memory_problems([small, big])] == [(9, needed)]
    scores = engine.score([small, big], LABELS)
    assert next(scores).row_id == 7
    batches_before = engine.metrics.batches
    with pytest.raises(MemoryBudgetError, match=r"row 9: needs about .* MiB") as caught:
        next(scores)
    assert isinstance(caught.value, ValueError)
    assert (caught.value.row_id, caught.value.needed_bytes, caught.value.budget_bytes) == (9, needed, budget)
    assert engine.metrics.batches == batches_before  # nothing of the group was computed


def test_rejects_bad_memory_budget():
    with pytest.raises(ValueError, match="memory_budget"):
        TorchEngine(tiny_model("llama"), memory_budget=0)
