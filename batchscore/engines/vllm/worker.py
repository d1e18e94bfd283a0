"""batchscore's methods inside vLLM's workers, through vLLM's public plugin point: the engine
passes `worker_extension_cls="batchscore.engines.vllm.worker.WorkerExtension"` and calls these
methods by name with `LLM.collective_rpc("batchscore_…", args=…)`. Names and plain arguments
cross the process boundary, never pickled functions, so vLLM's insecure serialization stays off.

Every method starts with `batchscore_` (vLLM refuses an extension whose names clash with the
worker's own).
"""

from __future__ import annotations

import gc
import os

from batchscore.engines.peak_memory import process_memory, reset_peak_memory


class WorkerExtension:
    """Mixed into vLLM's worker class (`self` is the worker: `self.model_runner.model`)."""

    def batchscore_set_hybrid_chunk(self, chunk: int | None) -> int:
        """Hybrid prefilling: every row-wise op runs `chunk` tokens at a time, decoder layers of a
        known layout whole chunk by chunk, attention included (None: off). Returns how many
        modules changed."""
        from batchscore.engines.vllm.hybrid import chunk_rowwise
        from batchscore.engines.vllm.query_chunks import StepMetadata, supports_query_chunks

        step = self.__dict__.pop("_batchscore_step", None)
        if step is not None:
            step.remove()
        step = None  # without: attention over the whole step, the row-wise ops chunked one by one
        if chunk is not None and supports_query_chunks(self.model_runner):
            step = self._batchscore_step = StepMetadata(self.model_runner)
        return chunk_rowwise(self.model_runner.get_model(), chunk, step)

    def batchscore_rowwise_modules(self) -> dict[str, int]:
        """How many modules of each class hybrid prefilling chunks (for the log and tests)."""
        from batchscore.engines.vllm.hybrid import rowwise_modules
        from batchscore.engines.vllm.query_chunks import supports_query_chunks

        counts: dict[str, int] = {}
        layers = supports_query_chunks(self.model_runner)
        for _, module, _ in rowwise_modules(self.model_runner.get_model(), layers):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
        return counts

    def batchscore_count_tensors(self, on: bool) -> bool:
        """Count the model's activation bytes tensor by tensor (`live_bytes.py`) from now on (or stop)."""
        from batchscore.engines.vllm.live_bytes import CountedForward, LiveTensorBytes

        model = self.model_runner.get_model()
        counted = model.__dict__.get("forward")
        if isinstance(counted, CountedForward):
            del model.forward
        if on:
            model.forward = CountedForward(model.forward, LiveTensorBytes())
        return on

    def _batchscore_counter(self):
        counted = self.model_runner.get_model().__dict__.get("forward")
        return getattr(counted, "mode", None)

    def batchscore_reset_peak(self) -> dict[str, int]:
        """Restart the activation-peak counter; returns the memory in use now (bytes).

        GPU: `torch.cuda.reset_peak_memory_stats`. CPU: freed allocator memory goes back to the
        OS (vLLM's CPU build preloads tcmalloc, which keeps it resident), then the peak resident
        set restarts at the current one (Linux `clear_refs`)."""
        import torch

        gc.collect()
        counter = self._batchscore_counter()
        if counter is not None:
            counter.reset()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return {"now": int(torch.cuda.memory_allocated()), "pid": os.getpid()}
        return {"now": reset_peak_memory()["rss"], "pid": os.getpid()}

    def batchscore_peak(self) -> dict[str, int]:
        """The memory in use now and its peak since `batchscore_reset_peak` (bytes)."""
        import torch

        counter = self._batchscore_counter()
        tensors = {} if counter is None else {"tensor_now": counter.now, "tensor_peak": counter.peak}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            return {"now": int(torch.cuda.memory_allocated()), "peak": int(torch.cuda.max_memory_allocated()), **tensors}
        status = process_memory()
        return {"now": status["rss"], "peak": status["hwm"], **tensors}

    def batchscore_touch_kv_cache(self) -> int:
        """Write zeros over this worker's whole KV cache (no request may be running), so its memory
        is resident before a peak is measured; returns the bytes touched."""
        total = 0
        for cache in getattr(self.model_runner, "kv_caches", None) or []:
            cache.zero_()
            total += cache.numel() * cache.element_size()
        return total


EXTENSION = f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}"
