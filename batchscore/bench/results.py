"""The one result type of the benchmarks: requests (and tokens, FLOPs) served over seconds.

Every bench that reports a throughput measures it into a `Throughput`: the plain forward and the
torch engine (`bench engine`, `bench gpu`, the suite), hybrid prefilling off and on (`bench mil
--throughput-requests`), vLLM on two request orders (`bench vllm`, the suite). Speedups compare
logical tokens per second (prompt tokens as if unshared), which is the requests/s ratio when both
sides scored the same requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

Probs = dict[int, np.ndarray]  # row_id -> [L] label probabilities (normalized over the labels)


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds else float("nan")


@dataclass
class Throughput:
    """What one side of a benchmark served, and in how long."""

    name: str
    dtype: str = ""  # the engine dtype it ran in, where a bench compares dtypes
    requests: int = 0
    seconds: float = 0.0  # wall clock
    cpu_seconds: float = 0.0  # this process's CPU time (steadier on a machine shared with other jobs)
    logical_tokens: int = 0  # prompt tokens, as if nothing were shared
    processed_tokens: int = 0  # tokens actually computed
    flops: float = 0.0  # forward FLOPs computed (engines.shape.forward_flops), where counted
    batch_token_counts: list[int] | None = None  # tokens per forward batch, in order
    probs: Probs = field(default_factory=dict, repr=False)
    note: str = ""

    @property
    def requests_per_s(self) -> float:
        return _rate(self.requests, self.seconds)

    @property
    def requests_per_cpu_s(self) -> float:
        return _rate(self.requests, self.cpu_seconds)

    @property
    def logical_tokens_per_s(self) -> float:
        return _rate(self.logical_tokens, self.seconds)

    @property
    def processed_tokens_per_s(self) -> float:
        return _rate(self.processed_tokens, self.seconds)

    @property
    def flops_per_s(self) -> float:
        return _rate(self.flops, self.seconds)

    @property
    def tflops_per_s(self) -> float:
        return self.flops_per_s / 1e12

    @property
    def saving_ratio(self) -> float:
        return 1.0 - self.processed_tokens / self.logical_tokens if self.logical_tokens else 0.0

    @property
    def ideal_speedup(self) -> float:
        """Logical / processed tokens (BatchLLM Eq. 1): the speedup over no sharing if every
        token cost the same."""
        return _rate(self.logical_tokens, self.processed_tokens)

    def add(self, seconds: float, probs: Probs, cpu_seconds: float = 0.0) -> None:
        """Side effect: accumulates one timed piece of work."""
        self.seconds += seconds
        self.cpu_seconds += cpu_seconds
        self.requests += len(probs)
        self.probs.update(probs)

    def time(self, score: Callable[[], Probs], sync: Callable[[], None] | None = None) -> Probs:
        """Run `score`, adding its wall and CPU seconds and the rows it scored; `sync` (e.g.
        `torch.cuda.synchronize`) runs before the clock starts and before it stops."""
        if sync is not None:
            sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        probs = score()
        if sync is not None:
            sync()
        self.add(time.perf_counter() - start, probs, time.process_time() - cpu_start)
        return probs

    def speedup_over(self, baseline: Throughput, clock: str = "wall") -> float:
        """This side's rate over `baseline`'s: logical tokens/s where both counted tokens, else
        requests/s; per second of `clock` ("wall" or "cpu")."""
        if clock == "cpu":
            return self.requests_per_cpu_s / baseline.requests_per_cpu_s
        if self.logical_tokens and baseline.logical_tokens:
            return self.logical_tokens_per_s / baseline.logical_tokens_per_s
        return self.requests_per_s / baseline.requests_per_s

    def max_abs_dp(self, other: Throughput) -> float | None:
        """Largest |ΔP(label)| between the two on the rows both scored (None: no common row)."""
        common = [row for row in other.probs if row in self.probs]
        if not common:
            return None
        return max(float(np.abs(self.probs[row] - other.probs[row]).max()) for row in common)


__all__ = ["Probs", "Throughput"]
