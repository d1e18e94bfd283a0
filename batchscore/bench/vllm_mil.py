"""Maximum input length on vLLM with and without hybrid prefilling (every row-wise op chunked inside vLLM).

One vLLM engine with a fixed KV cache (`VLLM_CPU_KVCACHE_SPACE`, whole GiB) and one-pass prefill
(`max_num_batched_tokens` ≥ the longest prompt, no chunked prefill: PrefillOnly's setting). The
KV cache is written over once first, so its memory counts in the baseline, and one pass of each
mode at the longest length runs unmeasured, so one-time costs (kernels' first use, buffers a step
writes for the first time) fall in neither mode. Then, per prompt length N and mode (plain: whole
steps; hybrid: decoder layers chunk by chunk, attention included, switched inside the same
engine), inside vLLM's worker (the worker extension's methods, called by name): release freed
allocator memory and reset the peak (CPU: peak RSS; GPU: `torch.cuda.max_memory_allocated`),
score one random N-token prompt (prefix cache reset, so it is computed in full), read the peak.
The activation peak is that peak minus the memory before the pass. The longest prompt under a
budget (default: hybrid's peak at the longest length) is found per mode by bisection.
"""

from __future__ import annotations

import os

import numpy as np

from batchscore.bench.peak_memory import Measurement
from batchscore.bench.scoring import plain_group
from batchscore.plan.types import Request

MIB = 2**20


class VllmMemoryProbe:
    """A vLLM engine that measures the engine process's memory peak of single prompts."""

    def __init__(self, model_dir, dtype: str, longest: int, hybrid_chunk: int, kv_space_gib: int) -> None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
        from batchscore.engines.vllm.engine import VllmEngine

        self._rng = np.random.default_rng(0)
        self._row = 0
        self.hybrid_chunk = hybrid_chunk
        self.engine = VllmEngine(model_dir, dtype=dtype, token_budget=longest, hybrid_chunk=hybrid_chunk)
        self.engine.start([self._group(np.zeros(longest, np.int32))])  # sized for the longest prompt
        self.touched = sum(self.engine.llm.collective_rpc("batchscore_touch_kv_cache"))
        self.vocab = self.engine.vocab_size
        for mode in ("plain", "hybrid"):  # warm-up at the longest length: one-time costs (kernels' first
            self.measure(mode, longest)     # use, buffers a step first writes) then count in neither mode

    def _group(self, prompt: np.ndarray):
        self._row += 1
        return plain_group([Request(self._row, prompt)])

    def measure(self, mode: str, tokens: int) -> Measurement:
        """Peak RSS of vLLM's engine process around one `tokens`-token prompt in `mode` (no estimate)."""
        self.engine.set_hybrid_chunk(self.hybrid_chunk if mode == "hybrid" else None)
        self.engine.reset_prefix_cache()
        prompt = self._rng.integers(0, self.vocab, tokens, dtype=np.int32)
        before = self.engine.reset_worker_peak()
        (result,) = self.engine.score([self._group(prompt)], [0, 1])
        if result.error:
            raise RuntimeError(f"vLLM refused the {tokens}-token prompt: {result.error}")
        after = self.engine.worker_peak()
        return Measurement(mode, tokens, before["now"], after["peak"])

    def close(self) -> None:
        self.engine.close()

