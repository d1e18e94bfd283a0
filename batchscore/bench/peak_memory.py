"""The `Measurement` the memory benchmarks record. Reading and restarting the peak resident memory
lives in `engines/peak_memory.py` (vLLM's worker uses it too)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Measurement:
    """The peak resident memory around scoring one prompt (bytes)."""

    mode: str  # plain | hybrid | chunked-prefill
    tokens: int
    baseline_rss: int  # before the pass
    peak_rss: int  # during it
    estimated: int = 0  # the torch engine's memory estimate for this prompt (0: none)

    @property
    def activation(self) -> int:
        return self.peak_rss - self.baseline_rss
