"""This process's resident memory and its peak (Linux /proc), for the memory benchmarks, and the
`Measurement` they record.

The functions also run inside vLLM's engine process (sent with `LLM.collective_rpc`, which passes
the worker as the first argument: hence the unused `worker` parameters).
"""

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


def process_memory(worker=None) -> dict[str, int]:
    """The calling process's resident set now and at its peak (bytes): {"rss", "hwm", "pid"}."""
    import os

    values = {"pid": os.getpid()}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                values[line[2:5].lower()] = int(line.split()[1]) * 1024
    return values


def reset_peak_memory(worker=None, release_free_memory: bool = True) -> dict[str, int]:
    """Restart the peak-RSS counter at the current RSS (Linux ≥ 4.0 `clear_refs`), so the next
    peak is the next pass's own; returns `process_memory()`.

    With `release_free_memory`, freed allocator memory goes back to the OS first: vLLM's CPU build
    preloads tcmalloc, which keeps freed pages resident, and a later pass would reuse them
    without its peak showing.
    """
    import ctypes
    import gc

    gc.collect()
    if release_free_memory:
        process = ctypes.CDLL(None)
        for name in ("MallocExtension_ReleaseFreeMemory", "malloc_trim"):  # tcmalloc, else glibc
            release = getattr(process, name, None)
            if release is not None:
                release(*([0] if name == "malloc_trim" else []))
                break
    with open("/proc/self/clear_refs", "w") as clear:  # "5" resets VmHWM to VmRSS
        clear.write("5")
    return process_memory()
