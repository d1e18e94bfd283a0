"""A simulated prefix KV cache, like vLLM's automatic prefix caching, for counting tokens.

The cache holds full blocks of `block_size` tokens, each named by a hash of the whole prefix
up to and including the block (so a block only matches after the same prefix). A request
reuses its longest run of leading cached blocks and computes the rest; then its blocks are
cached, evicting least-recently-used blocks when the capacity (in tokens) is exceeded. Like
vLLM, a request's blocks are released tail first, so a prefix outlives its tails.
No GPU, no torch: the planner and the tests use it to count processed prefill tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from batchscore.plan.types import PrefixGroup

_BASE = np.uint64(0x100000001B3)  # odd, so it has an inverse modulo 2**64
_BASE_INV = np.uint64(pow(int(_BASE), -1, 2**64))
_POS_MIX = np.uint64(0x9E3779B97F4A7C15)


def block_keys(tokens: np.ndarray, block_size: int) -> list[int]:
    """Hash keys of the full blocks of `tokens`; key i covers tokens[: (i+1)*block_size].

    Vectorized rolling hash: h_i = sum_j (t_j+1) * B**(i-j) mod 2**64 = B**i * cumsum((t_j+1) *
    B**-j), so every prefix hash comes from one cumsum instead of a Python loop over tokens.
    (Polynomial hashing mod 2**64 can be attacked, but not by token workloads.)
    """
    n = int(tokens.shape[0]) - int(tokens.shape[0]) % block_size
    if n == 0:
        return []
    powers = np.full(n, _BASE, dtype=np.uint64)
    powers[0] = 1
    powers = np.cumprod(powers, dtype=np.uint64)
    inverses = np.full(n, _BASE_INV, dtype=np.uint64)
    inverses[0] = 1
    inverses = np.cumprod(inverses, dtype=np.uint64)
    t = tokens[:n].astype(np.uint64) + np.uint64(1)
    prefix_hash = powers * np.cumsum(t * inverses, dtype=np.uint64)
    ends = np.arange(block_size - 1, n, block_size, dtype=np.uint64)
    # Mix in the position so equal hashes at different lengths do not collide.
    return (prefix_hash[block_size - 1 :: block_size] ^ (ends * _POS_MIX)).tolist()


@dataclass
class CacheChange:
    """Block keys a call to `PrefixCache.admit` added and evicted."""

    added: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)


class PrefixCache:
    """LRU cache of KV blocks; capacity in tokens (None = unbounded)."""

    def __init__(self, capacity_tokens: int | None, block_size: int = 1) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.capacity_blocks = None if capacity_tokens is None else capacity_tokens // block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_tokens(self, keys: Sequence[int]) -> int:
        """Tokens of the leading blocks of `keys` in the cache; changes nothing."""
        hits = 0
        for key in keys:
            if key not in self._blocks:
                break
            hits += 1
        return hits * self.block_size

    def admit(self, keys: Sequence[int]) -> CacheChange:
        """Cache a request's blocks as most recently used, evicting LRU blocks over capacity."""
        change = CacheChange()
        for key in reversed(keys):  # tail first, so the tail is the older one
            if key in self._blocks:
                self._blocks.move_to_end(key)
            else:
                self._blocks[key] = None
                change.added.append(key)
        if self.capacity_blocks is not None:
            while len(self._blocks) > self.capacity_blocks:
                change.evicted.append(self._blocks.popitem(last=False)[0])
        return change


@dataclass
class SimResult:
    """What a simulated run processed: totals and the cached tokens of each request in order."""

    logical_tokens: int
    processed_tokens: int
    cached_per_request: list[int]

    @property
    def hits(self) -> int:
        """Requests that reused at least one cached block."""
        return sum(1 for c in self.cached_per_request if c > 0)

    @property
    def saving_ratio(self) -> float:
        return 1.0 - self.processed_tokens / self.logical_tokens if self.logical_tokens else 0.0


def simulate(
    sequences: Iterable[np.ndarray], capacity_tokens: int | None, block_size: int = 1
) -> SimResult:
    """Run `sequences` in order through a fresh PrefixCache and count prefill tokens.

    A fully cached prompt still computes its last token (its logits are the output).
    """
    cache = PrefixCache(capacity_tokens, block_size)
    logical = processed = 0
    cached_per_request: list[int] = []
    for tokens in sequences:
        length = int(tokens.shape[0])
        keys = block_keys(tokens, block_size)
        cached = min(cache.cached_tokens(keys), length - 1)
        cache.admit(keys)
        logical += length
        processed += length - cached
        cached_per_request.append(cached)
    return SimResult(logical, processed, cached_per_request)


def sequences_in_order(groups: Iterable[PrefixGroup]) -> Iterable[np.ndarray]:
    """Each member's full prompt (prefix + suffix), in execution order."""
    for group in groups:
        for member in group.members:
            yield group.full_prompt(member)


def simulate_groups(
    groups: Iterable[PrefixGroup], capacity_tokens: int | None, block_size: int = 1
) -> SimResult:
    """`simulate` over a plan's groups, run member after member in plan order."""
    return simulate(sequences_in_order(groups), capacity_tokens, block_size)
