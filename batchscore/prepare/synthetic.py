"""Synthetic token-id workloads from the BatchLLM paper (pure numpy, seeded, no torch).

Each generator returns list[np.ndarray] (int32 token ids below `vocab_size`; the default
49152 fits the default model's vocabulary). Siblings in the intended prefix tree get distinct
first tokens, so random collisions never add sharing the paper's numbers do not count.
`WORKLOADS` maps names used in job files to generators.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np

DEFAULT_VOCAB = 49152

TABLE3_SETTINGS = {
    # setting: (group prefix tokens, sub prefix tokens); suffix fills the prompt to 1000.
    "A": (490, 11),  # BatchLLM Table 3: expected first-level saving 48.6%
    "B": (400, 101),  # expected 39.7%
}


def _random_runs(
    rng: np.random.Generator, count: int, length: int, vocab_size: int
) -> np.ndarray:
    """[count, length] random tokens whose rows start with distinct tokens (when length > 0)."""
    runs = rng.integers(0, vocab_size, size=(count, length), dtype=np.int32)
    if length and count <= vocab_size:
        runs[:, 0] = rng.choice(vocab_size, size=count, replace=False)
    return runs


def table3(
    setting: str = "A",
    num_groups: int = 50,
    subcategories: int = 64,
    prompts_per_sub: int = 2,
    prompt_len: int = 1000,
    shuffle: bool = True,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
) -> list[np.ndarray]:
    """BatchLLM Table 3: group prefix + sub prefix + random suffix, 6400 prompts of 1000 tokens.

    Setting A (490 + 11) saves 48.6% with first-level sharing, Setting B (400 + 101) 39.7%.
    """
    if setting not in TABLE3_SETTINGS:
        raise ValueError(f"setting must be one of {sorted(TABLE3_SETTINGS)}, got {setting!r}")
    group_len, sub_len = TABLE3_SETTINGS[setting]
    suffix_len = prompt_len - group_len - sub_len
    rng = np.random.default_rng(seed)
    group_prefix = _random_runs(rng, num_groups, group_len, vocab_size)
    prompts = np.empty((num_groups, subcategories, prompts_per_sub, prompt_len), dtype=np.int32)
    prompts[..., :group_len] = group_prefix[:, None, None, :]
    for g in range(num_groups):
        sub_prefix = _random_runs(rng, subcategories, sub_len, vocab_size)
        prompts[g, :, :, group_len : group_len + sub_len] = sub_prefix[:, None, :]
        for s in range(subcategories):
            prompts[g, s, :, group_len + sub_len :] = _random_runs(
                rng, prompts_per_sub, suffix_len, vocab_size
            )
    rows = list(prompts.reshape(-1, prompt_len))
    return shuffled(rng, rows) if shuffle else rows


def shuffled(rng: np.random.Generator, prompts: list[np.ndarray]) -> list[np.ndarray]:
    """The prompts in a random order drawn from `rng` (the papers shuffle their batches)."""
    return [prompts[i] for i in rng.permutation(len(prompts))]


def _lengths(rng: np.random.Generator, mean: int, count: int, poisson: bool) -> np.ndarray:
    """`count` lengths around `mean` (Poisson-perturbed when asked), each at least 1."""
    if not poisson:
        return np.full(count, max(mean, 1), dtype=np.int64)
    return np.maximum(rng.poisson(mean, size=count), 1)


def grouped_prompts(
    rng: np.random.Generator,
    degrees: np.ndarray,
    prefix_lens: np.ndarray,
    distinct_lens: np.ndarray,
    vocab_size: int,
    head: np.ndarray,
) -> list[np.ndarray]:
    """Prompts head + group prefix + distinct part, group by group; `degrees` prompts each."""
    prompts: list[np.ndarray] = []
    first_tokens = rng.choice(vocab_size, size=min(len(degrees), vocab_size), replace=False)
    total = int(prefix_lens.sum() + distinct_lens.sum())
    pool = rng.integers(0, vocab_size, size=total, dtype=np.int32)
    at = 0
    d = 0
    for g, degree in enumerate(degrees.tolist()):
        prefix = pool[at : at + prefix_lens[g]].copy()
        at += int(prefix_lens[g])
        if prefix.size and g < len(first_tokens):
            prefix[0] = first_tokens[g]
        firsts = rng.choice(vocab_size, size=degree, replace=False)
        for i in range(degree):
            distinct = pool[at : at + distinct_lens[d]]
            at += int(distinct_lens[d])
            d += 1
            prompt = np.concatenate((head, prefix, distinct))
            prompt[head.size + prefix.size] = firsts[i]  # distinct parts differ at once
            prompts.append(prompt)
    return prompts


def microbench(
    prefix_len: int = 2000,
    distinct_len: int = 200,
    sharing_degree: int = 16,
    num_requests: int = 1600,
    poisson: bool = True,
    shuffle: bool = True,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
) -> list[np.ndarray]:
    """BatchLLM microbenchmark: groups of `sharing_degree` prompts sharing one prefix.

    Upper-bound saving = 1 - (P + k*D) / (k*(P + D)); 2000/200/16 gives 85.2%. Lengths are
    Poisson around the means when `poisson` (the ratio of sums stays near the bound).
    """
    rng = np.random.default_rng(seed)
    num_groups = -(-num_requests // sharing_degree)
    degrees = np.full(num_groups, sharing_degree, dtype=np.int64)
    degrees[-1] = num_requests - sharing_degree * (num_groups - 1)
    prefix_lens = _lengths(rng, prefix_len, num_groups, poisson)
    distinct_lens = _lengths(rng, distinct_len, num_requests, poisson)
    head = np.zeros(0, dtype=np.int32)
    prompts = grouped_prompts(rng, degrees, prefix_lens, distinct_lens, vocab_size, head)
    return shuffled(rng, prompts) if shuffle else prompts


def industry(
    num_requests: int = 8000,
    mean_degree: float = 3.0,
    prefix_len: int = 1570,
    distinct_len: int = 30,
    header_len: int = 64,
    shuffle: bool = True,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
) -> list[np.ndarray]:
    """Industry-like batch (BatchLLM): mean sharing degree ~3, prefix ~1570, distinct ~30.

    Every prompt starts with the same `header_len`-token instruction header (counted in the
    prefix), so the plain first level is one short node and enlargement has work to do.
    Degrees are 1 + Poisson(mean_degree - 1); lengths are Poisson around their means.
    """
    rng = np.random.default_rng(seed)
    degrees_list = []
    total = 0
    while total < num_requests:
        batch = 1 + rng.poisson(mean_degree - 1, size=max(16, num_requests // 2))
        for degree in batch.tolist():
            degree = min(degree, num_requests - total)
            degrees_list.append(degree)
            total += degree
            if total == num_requests:
                break
    degrees = np.asarray(degrees_list, dtype=np.int64)
    head = rng.integers(0, vocab_size, size=header_len, dtype=np.int32)
    prefix_lens = _lengths(rng, max(prefix_len - header_len, 1), len(degrees), True)
    distinct_lens = _lengths(rng, distinct_len, num_requests, True)
    prompts = grouped_prompts(rng, degrees, prefix_lens, distinct_lens, vocab_size, head)
    return shuffled(rng, prompts) if shuffle else prompts


WORKLOADS: dict[str, Callable[..., list[np.ndarray]]] = {
    "table3_a": partial(table3, setting="A"),
    "table3_b": partial(table3, setting="B"),
    "microbench": microbench,
    "industry": industry,
}
