"""`engine.compile`: the torch engine's decoder layers through `torch.compile` (inductor).

What it buys: in eager mode every layer makes ~20 passes over its activations outside the
matmuls (RMSNorm's float32 upcast, square, mean, scale and downcast; RoPE's slices, negation,
concatenation and products; SiLU, the gate product, the residual adds). Inductor fuses them into
a few C++ loops that read and write each activation once. The matmuls stay oneDNN/MKL calls (AMX
in bfloat16) and the cascade attention stays eager: it is Python over parts and prefix segments,
so it is a graph break (registered for the compiled model under its own name, wrapped in
`torch.compiler.disable`). Measured on SmolLM2-135M, micro 1000/100 degree 16, one thread, CPU
seconds: bfloat16 ~1.1-1.3x faster, float32 ~1.1x (README, "CPU: bfloat16 and compiled layers").

Shapes: `dynamic=True`, so a pass of any length reuses the same compiled code (dynamo
specializes lengths 0 and 1 once). transformers' decoder layers are one class whose weights are
graph inputs (dynamo inlines nn modules), so all layers share one compilation per graph piece.
Compiling takes ~10-30 s on 2 cores the first time; inductor caches the result on disk
(`TORCHINDUCTOR_CACHE_DIR`, default under /tmp), later processes load it in seconds.

`engine.compile: null` (auto) compiles where it pays: bfloat16 on a CPU with native bfloat16,
where the fused elementwise work is a large share once the matmuls run on AMX. float32 stays
eager unless asked for (`engine.compile: true`; within 1e-6 of eager on the sample model).
Hybrid prefilling drives the layers itself and is never compiled.
"""

from __future__ import annotations

import functools
import logging

import torch

from batchscore.engines.cascade_attention import (
    CascadeBatch,
    CascadePart,
    PrefixKV,
    SequenceLayout,
    cascade_attention_forward,
)
from batchscore.engines.cpu_features import cpu_bf16

log = logging.getLogger("batchscore")

COMPILED_ATTN_IMPLEMENTATION = "batchscore_cascade_compiled"
WARMUP_TOKENS = 37  # the first compiled pass: a length no model dimension has (no size specialization)


@torch.compiler.disable
def _eager_cascade_attention(module, query, key, value, attention_mask, **kwargs):
    """`cascade_attention_forward`, never traced, its output [1, T, H, D] copied into fresh dense
    strides (transformers copies it next anyway): one stride pattern for every pass, however many
    parts, so the code after it compiles once."""
    out, weights = cascade_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out.clone(memory_format=torch.contiguous_format), weights


def should_compile(requested: bool | None, dtype: str, device: str, hybrid: bool = False) -> tuple[bool, str]:
    """(compile the layers?, why) for `engine.compile` = `requested` (None: auto)."""
    if hybrid:
        return False, "hybrid prefilling runs the layers itself"
    if requested is not None:
        return requested, f"engine.compile: {str(requested).lower()}"
    if device == "cpu" and dtype == "bfloat16" and cpu_bf16().native:
        return True, "auto: bfloat16 on a CPU with native bfloat16"
    return False, f"auto: {dtype} on {device} runs eager"


@functools.lru_cache(maxsize=1)
def compile_problem() -> str | None:
    """None when torch.compile works in this process (inductor and its C++ compiler), else why
    not. Compiles a one-line function once per process (cached on disk by inductor)."""
    try:
        probe = torch.compile(lambda x: x * 2.0 + 1.0, dynamic=False)
        with torch.inference_mode():
            if float(probe(torch.ones(8))[0]) != 3.0:
                return "the compiled probe computed a wrong value"
    except Exception as exc:  # noqa: BLE001 - any failure means: run eager
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None


def compile_decoder_layers(model: torch.nn.Module) -> bool:
    """Compile every decoder layer of `model` (a transformers causal LM already switched to the
    cascade attention) in place. Returns False, leaving the model eager, when torch.compile does
    not work here (the reason is logged as a warning).

    Side effects: registers the dynamo-disabled cascade attention under
    `COMPILED_ATTN_IMPLEMENTATION` and switches the model to it; wraps each layer's call with
    `nn.Module.compile`; runs one warm-up pass, which compiles (seconds, less with inductor's
    disk cache).
    """
    problem = compile_problem()
    if problem is not None:
        log.warning("engine.compile: torch.compile does not work here (%s); running eager", problem)
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(COMPILED_ATTN_IMPLEMENTATION, _eager_cascade_attention)
    model.set_attn_implementation(COMPILED_ATTN_IMPLEMENTATION)
    decoder = model.get_decoder()
    for layer in decoder.layers:
        layer.compile(dynamic=True)
    _warm_up(decoder)
    return True


@torch.inference_mode()
def _warm_up(decoder: torch.nn.Module) -> None:
    """One pass of `WARMUP_TOKENS` tokens, so the first compilation is the general one (a first
    real pass of, e.g., 64 tokens would specialize on equalling the head size, then recompile)."""
    device = next(decoder.parameters()).device
    tokens = WARMUP_TOKENS
    kv = PrefixKV.empty(len(decoder.layers))
    part = CascadePart(tokens, prefix=kv, layout=SequenceLayout.from_lengths([tokens]), record_into=kv)
    ids = torch.arange(tokens, device=device)[None] % int(decoder.embed_tokens.num_embeddings)
    decoder(input_ids=ids, position_ids=torch.arange(tokens, device=device)[None], use_cache=False,
            cascade=CascadeBatch([part]))


__all__ = ["COMPILED_ATTN_IMPLEMENTATION", "should_compile", "compile_problem", "compile_decoder_layers"]
