"""This process's resident memory and its peak (Linux /proc), and restarting that peak: how the
activation peak of a pass is read on a CPU, in the torch engine's benchmarks and inside vLLM's
worker alike. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import ctypes
import gc
import os


def process_memory() -> dict[str, int]:
    """The calling process's resident set now and at its peak (bytes): {"rss", "hwm", "pid"}."""
    values = {"pid": os.getpid()}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                values[line[2:5].lower()] = int(line.split()[1]) * 1024
    return values


def release_free_memory() -> str | None:
    """Hand the allocator's freed memory back to the OS, so a later pass that reuses it shows in
    its own peak: vLLM's CPU build preloads tcmalloc, which keeps freed pages resident; glibc
    keeps some in its arenas. Returns the allocator released ("tcmalloc", "glibc"; None: neither)."""
    process = ctypes.CDLL(None)
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
        return "tcmalloc"
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim(0)
        return "glibc"
    return None


def reset_peak_memory(release_free: bool = True) -> dict[str, int]:
    """Restart the peak-RSS counter at the current RSS (Linux >= 4.0 `clear_refs`), so the next peak
    is the next pass's own; returns `process_memory()`. With `release_free`, freed allocator
    memory goes back to the OS first (`release_free_memory`)."""
    gc.collect()
    if release_free:
        release_free_memory()
    with open("/proc/self/clear_refs", "w") as clear:  # "5" resets VmHWM to VmRSS
        clear.write("5")
    return process_memory()
