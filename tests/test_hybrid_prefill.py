"""Hybrid prefilling: chunked non-attention work gives the same scores; KV lives only as long as needed."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from batchscore.engines.torch import cascade_attention
from batchscore.engines.torch.cascade_attention import PrefixKV
from batchscore.engines.torch.hybrid import HybridDecoder
from batchscore.errors import HybridUnsupported
from batchscore.engines.torch.engine import TorchEngine
from batchscore.scores.normalize import normalize_totals
from batchscore.plan.types import GroupMember, PrefixGroup
from tests.test_torch_engine import BUDGET, FLOAT32_TOLERANCE, LABELS, make_groups, max_probability_error, tiny_model

HYBRID_TOLERANCE = 1e-5  # max |ΔP| hybrid on vs off, float32
CHUNK = 7  # smaller than most prompts, so every path is cut into chunks


def max_dp(results_a, results_b) -> float:
    by_row = {r.row_id: r for r in results_b}
    worst = 0.0
    for a in results_a:
        (p_a, mass_a), (p_b, mass_b) = normalize_totals(a.logp), normalize_totals(by_row[a.row_id].logp)
        worst = max(worst, np.abs(np.exp(p_a) - np.exp(p_b)).max(), abs(mass_a[0] - mass_b[0]))
    return worst


def arches():
    yield "llama"
    yield "qwen2"


@pytest.mark.parametrize("arch", list(arches()))
def test_hybrid_matches_unchunked_engine_and_plain_forward(arch):
    groups = make_groups()
    model = tiny_model(arch)
    error, plain_engine_results, _ = max_probability_error(model, groups, BUDGET)  # hybrid off
    hybrid = TorchEngine(model, token_budget=BUDGET, hybrid_chunk=CHUNK)
    results = list(hybrid.score(groups, LABELS))
    assert [r.row_id for r in results] == [m.row_id for g in groups for m in g.members]
    assert max_dp(results, plain_engine_results) <= HYBRID_TOLERANCE
    assert error <= FLOAT32_TOLERANCE
    # suffixes over the budget run in one pass of their own (no chunked prefill keeping their KV)
    long_suffixes = sum(1 for g in groups for m in g.members if len(m.suffix) > BUDGET)
    assert long_suffixes and max(hybrid.metrics.batch_token_counts) > BUDGET
    assert hybrid.metrics.processed_tokens == sum(g.processed_tokens for g in groups)


def test_hybrid_long_single_prompt_matches():
    # one prompt many chunks long, no prefix, and the same on top of a prefix (query chunks merge
    # the earlier rows of their own sequence and the prefix segments)
    rng = np.random.default_rng(5)
    groups = [PrefixGroup(np.zeros(0, np.int32), [GroupMember(0, rng.integers(0, 1000, 300, dtype=np.int32))]),
              PrefixGroup(rng.integers(0, 1000, 90, dtype=np.int32),
                          [GroupMember(1, rng.integers(0, 1000, 200, dtype=np.int32))])]
    model = tiny_model("llama")
    off = list(TorchEngine(model, token_budget=512).score(groups, LABELS))
    on = list(TorchEngine(model, token_budget=512, hybrid_chunk=32).score(groups, LABELS))
    assert max_dp(on, off) <= HYBRID_TOLERANCE


def test_builtin_model_hybrid_matches_unchunked(model_dir):
    path = model_dir  # the built-in model, converted once per machine (conftest)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 49152, 100, dtype=np.int32)
    groups = [PrefixGroup(np.zeros(0, np.int32), [GroupMember(0, rng.integers(0, 49152, 320, dtype=np.int32))]),
              PrefixGroup(prefix, [GroupMember(1 + i, rng.integers(0, 49152, 90, dtype=np.int32)) for i in range(2)])]
    labels = [9584, 2470]  # " Yes", " No"
    off = list(TorchEngine(model, token_budget=512).score(groups, labels))
    on = list(TorchEngine(model, token_budget=512, hybrid_chunk=64).score(groups, labels))  # 5 query chunks
    assert max_dp(on, off) <= HYBRID_TOLERANCE


def test_rejects_decoder_without_standard_names():
    with pytest.raises(HybridUnsupported, match="embed_tokens"):
        HybridDecoder(torch.nn.Module(), chunk=16)
    with pytest.raises(ValueError, match="hybrid_chunk"):
        TorchEngine(tiny_model("llama"), hybrid_chunk=0)


# ---------------------------------------------------------------- KV lifetimes


@pytest.mark.slow  # a gc.collect per row, 4 cases
@pytest.mark.parametrize("hybrid_chunk", [None, CHUNK])
@pytest.mark.parametrize("token_budget", [BUDGET, 4096])  # groups cut by passes; every group in one pass
def test_prefix_kv_lives_until_its_group_last_member(monkeypatch, hybrid_chunk, token_budget):
    """PrefixKV k belongs to group k (one `PrefixKV.empty` per group, in order)."""
    from batchscore.engines.torch.engine import GroupRun

    created: list[weakref.ref] = []
    original = PrefixKV.empty.__func__

    def tracked_empty(cls, num_layers):
        kv = original(cls, num_layers)
        created.append(weakref.ref(kv))
        return kv

    monkeypatch.setattr(PrefixKV, "empty", classmethod(tracked_empty))
    groups = make_groups(seed=3)
    engine = TorchEngine(tiny_model("llama"), token_budget=token_budget, hybrid_chunk=hybrid_chunk)
    scored_after = {}  # row -> passes run when its result was stored
    original_set = GroupRun.set

    def tracked_set(self, index, result):
        scored_after[result.row_id] = engine.metrics.batches
        original_set(self, index, result)

    monkeypatch.setattr(GroupRun, "set", tracked_set)
    where = {m.row_id: (k, i) for k, g in enumerate(groups) for i, m in enumerate(g.members)}
    alive_checked = 0
    for result in engine.score(groups, LABELS):
        gc.collect()
        group_index, member_index = where[result.row_id]
        last = groups[group_index].members[-1].row_id
        if member_index == len(groups[group_index].members) - 1:
            assert created[group_index]() is None, f"group {group_index}'s prefix KV outlives its last member"
        elif scored_after[result.row_id] < scored_after.get(last, float("inf")):
            # yielded while a later pass still scores members of its group
            assert created[group_index]() is not None
            alive_checked += 1
        # between passes only the group cut by the pass boundary keeps its KV
        assert sum(ref() is not None for ref in created) <= 1
    assert len(created) == len(groups)
    assert alive_checked > 0 or token_budget > BUDGET


@pytest.mark.slow  # KV lifetimes, a gc.collect per layer; make test keeps the hybrid exactness tests
def test_suffix_kv_dropped_after_its_layer_plain(monkeypatch):
    """Unchunked path: a suffix's K of layer i is gone when layer i + 1 attends."""
    previous: list[weakref.ref] = []
    original = cascade_attention._attend_part

    def tracked(query, key, value, part, layer_idx, scale, *row_kv):
        gc.collect()
        if part.record_into is None and layer_idx > 0:
            assert all(ref() is None for ref in previous), "previous layer's suffix KV still alive"
        previous.clear()
        if part.record_into is None:
            previous.append(weakref.ref(key))
        return original(query, key, value, part, layer_idx, scale, *row_kv)

    monkeypatch.setattr(cascade_attention, "_attend_part", tracked)
    list(TorchEngine(tiny_model("llama"), token_budget=BUDGET).score(make_groups(seed=4)[:2], LABELS))


@pytest.mark.slow  # KV lifetimes, a gc.collect per layer
def test_suffix_kv_dropped_after_its_layer_hybrid(monkeypatch):
    """Hybrid path: each layer's K/V are new tensors, freed after the layer unless a prefix records them."""
    alive: list[tuple[weakref.ref, bool]] = []
    original_layer = HybridDecoder._layer

    def tracked_layer(self, layer, hidden, cos, sin, cascade, chunks):
        gc.collect()
        recording = any(p.record_into is not None for p in cascade.parts)
        assert all(ref() is None for ref, recorded in alive if not recorded), "earlier layer's suffix KV alive"
        original_keys_values = self._keys_values

        def keys_values(*args):
            key, value = original_keys_values(*args)
            alive.append((weakref.ref(key), recording))
            return key, value

        self._keys_values = keys_values
        try:
            return original_layer(self, layer, hidden, cos, sin, cascade, chunks)
        finally:
            del self._keys_values

    monkeypatch.setattr(HybridDecoder, "_layer", tracked_layer)
    groups = [PrefixGroup(np.arange(30, dtype=np.int32), [GroupMember(0, np.arange(100, dtype=np.int32) % 7)])]
    list(TorchEngine(tiny_model("llama"), token_budget=64, hybrid_chunk=16).score(groups, LABELS))
    gc.collect()
    assert alive and all(ref() is None for ref, _ in alive)  # prefix KV too, after the group
