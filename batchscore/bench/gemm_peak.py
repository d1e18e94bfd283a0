"""The measured GEMM peak of this machine, per engine dtype: what "fraction of peak" divides by.

`gemm_peak(dtype)` times square matmuls of a few sizes in both dtypes, interleaved (so load from
other processes hits both alike), several rounds each, and keeps the best rate per dtype: the
most FLOP/s a matmul reached here, with torch's current thread count. Cached per process, dtype,
device and thread count. On a GPU the sizes are larger and the device is synchronized around each
timing. `efficiency(run, peak)` is a run's FLOP/s over that peak.

Noise: on a shared machine the best of several short timings is a lower bound of the real peak
(other processes only slow a timing down), so fractions of it are upper bounds; the report
states the thread count and load average next to them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from batchscore.engines.cpu_features import CpuBf16, best_matmul_flops, cpu_bf16

CPU_SIZES = (1024, 2048)
GPU_SIZES = (4096, 8192)


@dataclass(frozen=True)
class GemmPeak:
    """The best matmul rate measured per dtype on one device."""

    device: str
    threads: int
    flops: dict[str, float]  # dtype -> FLOP/s
    support: CpuBf16 | None = None  # CPU only

    def ratio(self, dtype: str, baseline: str = "float32") -> float | None:
        if dtype in self.flops and baseline in self.flops:
            return self.flops[dtype] / self.flops[baseline]
        return None

    def describe(self) -> str:
        """One line for a report header."""
        rates = ", ".join(f"{d} {f / 1e9:,.0f} GFLOP/s" for d, f in self.flops.items())
        bf16 = self.ratio("bfloat16")
        ratio = f" (bfloat16 {bf16:.1f}x float32)" if bf16 and len(self.flops) > 1 else ""
        where = f"{self.threads} CPU thread(s)" if self.device == "cpu" else self.device
        native = ""
        if self.support is not None:
            native = (f"CPU has native bfloat16 ({', '.join(self.support.names)}); " if self.support.native
                      else "CPU has no native bfloat16 (no AVX512-BF16 or AMX); ")
        return f"{native}measured GEMM peak on {where}: {rates}{ratio}"

    def to_dict(self) -> dict:
        return {"device": self.device, "threads": self.threads, "flops": dict(self.flops),
                "native_bf16": self.support.names if self.support is not None else None}


def gemm_peak(dtypes: tuple[str, ...] = ("float32", "bfloat16"), device: str = "cpu", rounds: int = 6,
              seconds: float = 0.3) -> GemmPeak:
    """Best matmul FLOP/s per dtype in `dtypes` on `device` (cached; see the module docstring)."""
    import torch

    return _gemm_peak(tuple(dtypes), device, rounds, seconds, torch.get_num_threads())


@functools.lru_cache(maxsize=16)
def _gemm_peak(dtypes: tuple[str, ...], device: str, rounds: int, seconds: float, threads: int) -> GemmPeak:
    import torch

    sizes = CPU_SIZES if device == "cpu" else GPU_SIZES
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    matrices = {(d, n): (torch.randn(n, n, device=device).to(getattr(torch, d)),
                         torch.randn(n, n, device=device).to(getattr(torch, d))) for d in dtypes for n in sizes}
    best = dict.fromkeys(dtypes, 0.0)
    with torch.inference_mode():
        for a, b in matrices.values():  # first calls: kernel selection, buffers
            torch.mm(a, b)
        sync()
        for round_index in range(rounds):
            keys = list(matrices) if round_index % 2 == 0 else list(matrices)[::-1]
            for dtype, n in keys:
                a, b = matrices[(dtype, n)]
                best[dtype] = max(best[dtype], best_matmul_flops(a, b, seconds / len(sizes), sync))
    return GemmPeak(device, threads, best, cpu_bf16() if device == "cpu" else None)


def peak_fraction(flops_per_s: float, peak: GemmPeak | None, dtype: str) -> float | None:
    """A run's FLOP/s over the measured peak of its dtype (None when not measured)."""
    if peak is None or not peak.flops.get(dtype) or flops_per_s != flops_per_s:
        return None
    return flops_per_s / peak.flops[dtype]


__all__ = ["GemmPeak", "gemm_peak", "peak_fraction"]
