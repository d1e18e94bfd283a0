"""`engine.compile`: the torch engine's decoder layers through `torch.compile` (inductor).

What it buys: in eager mode every layer makes ~20 passes over its activations outside the
matmuls (RMSNorm's float32 upcast, square, mean, scale and downcast; RoPE's slices, negation,
concatenation and products; SiLU, the gate product, the residual adds). Inductor fuses them into
a few C++ loops that read and write each activation once. The matmuls stay oneDNN/MKL calls (AMX
in bfloat16) and the cascade attention stays eager: it is Python over parts and prefix segments,
so it is a graph break (registered for the compiled model under its own name, wrapped in
`torch.compiler.disable`). Measured on SmolLM2-135M, micro 1000/100 degree 16: bfloat16
1.08-1.31x faster with one thread (CPU seconds), 1.25-1.42x with two; float32 ~1.1x (README,
"CPUs with native bfloat16").

Shapes: `dynamic=True`, so a pass of any length reuses the same compiled code (dynamo
specializes lengths 0 and 1 once). transformers' decoder layers are one class whose weights are
graph inputs (dynamo inlines nn modules), so all layers share one compilation per graph piece.
Compiling takes ~10-30 s on 2 cores the first time; inductor caches the result on disk
(`TORCHINDUCTOR_CACHE_DIR`, default under /tmp), later processes load it in seconds.

`engine.compile: null` (auto) compiles where it pays: bfloat16 on a CPU with native bfloat16,
where the fused elementwise work is a large share once the matmuls run on AMX, and bfloat16 on a
GPU, where it is the share the engine loses to a plain forward (random-weight Llama-3.1-8B on an
H200, micro 2000/200 degree 16: 0.86 of the FLOP ideal eager, 1.03 compiled, 450 → 534 TFLOP/s;
Qwen-2.5-7B 0.88 → 1.00) — each only once the engine has run `LAZY_COMPILE_TOKENS[device]`
tokens eagerly, so a short job never waits for a compiler (on a CPU the compile costs about as
much as ~100k eager tokens save; on the H200 compiling the 8B took 77 s, which the 1.19x pays back
after ~8 minutes of eager work, about what 20M tokens take there). `engine.compile: true` compiles at
engine start, `false` never. float32 stays eager unless asked for (within 1e-6 of eager on the
sample model). Hybrid prefilling drives the layers itself and is never compiled.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

from batchscore.engines.torch.cascade_attention import (
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
LAZY_COMPILE_TOKENS = {"cpu": 100_000, "cuda": 20_000_000}  # auto: compile once this many tokens ran eagerly


def _eager_cascade_attention(module, query, key, value, attention_mask, **kwargs):
    """`cascade_attention_forward` (never traced: registered behind `torch.compiler.disable`), its
    output [1, T, H, D] copied into fresh dense strides (transformers copies it next anyway): one
    stride pattern for every pass, however many parts, so the code after it compiles once."""
    out, weights = cascade_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out.clone(memory_format=torch.contiguous_format), weights


def should_compile(requested: bool | None, dtype: str, device: str, hybrid: bool = False,
                   lazy: bool = True) -> tuple[bool | int, str]:
    """(when to compile the layers, a line saying so) for `engine.compile` = `requested` (None:
    auto): False (never), True (at engine start) or a token count (once that many ran eagerly;
    auto with `lazy`). Benchmarks pass `lazy=False`: compiling inside a timed run would count."""
    if hybrid:
        return False, "eager layers (hybrid prefilling runs the layers itself)"
    if requested is not None:
        return requested, f"{'compiled' if requested else 'eager'} layers (engine.compile: {str(requested).lower()})"
    kind = "cuda" if device.startswith("cuda") else device
    if dtype == "bfloat16" and (kind == "cuda" or (kind == "cpu" and cpu_bf16().native)):
        where = "a GPU" if kind == "cuda" else "a CPU with native bfloat16"
        if lazy:
            return LAZY_COMPILE_TOKENS[kind], (f"layers compiled once {LAZY_COMPILE_TOKENS[kind]:,} tokens ran "
                                               f"eagerly (auto: bfloat16 on {where})")
        return True, f"compiled layers (auto: bfloat16 on {where})"
    return False, f"eager layers (auto: {dtype} on {device})"


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


class LayerCompilation:
    """The compilation state of one model's decoder layers: truthy once they are compiled.

    `after_tokens` > 0: a forward pre-hook on the decoder counts the tokens of every pass and
    compiles before the pass that crosses the count (then removes itself).
    """

    def __init__(self, model: torch.nn.Module, after_tokens: int = 0) -> None:
        self._model = weakref.ref(model)  # the engine's close() must be able to free the model
        self.after_tokens = after_tokens
        self.tokens = 0
        self.state = "pending"  # pending | compiled | eager (torch.compile does not work here)
        self._hook = None
        if after_tokens > 0:
            self._hook = model.get_decoder().register_forward_pre_hook(self._count, with_kwargs=True)
        else:
            self.compile_now()

    def __bool__(self) -> bool:
        return self.state == "compiled"

    def _count(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += int(ids.shape[-1]) if ids is not None else 0
        if self.tokens >= self.after_tokens:
            self._hook.remove()
            self._hook = None
            log.info("engine.compile: %d tokens ran eagerly, compiling the decoder layers", self.tokens)
            self.compile_now()

    def compile_now(self) -> None:
        """Compile every decoder layer in place and run one warm-up pass; stays eager (logged as
        a warning) when torch.compile does not work here.

        Side effects: registers the dynamo-disabled cascade attention under
        `COMPILED_ATTN_IMPLEMENTATION` and switches the model to it; wraps each layer's call with
        `nn.Module.compile`; the warm-up pass compiles (seconds, less with inductor's disk cache).
        """
        model = self._model()
        problem = compile_problem() if model is not None else "the model was freed"
        if problem is not None:
            log.warning("engine.compile: torch.compile does not work here (%s); running eager", problem)
            self.state = "eager"
            return
        from transformers import AttentionInterface

        AttentionInterface.register(COMPILED_ATTN_IMPLEMENTATION, _disabled_attention())
        model.set_attn_implementation(COMPILED_ATTN_IMPLEMENTATION)
        decoder = model.get_decoder()
        for layer in decoder.layers:
            layer.compile(dynamic=True)
        _warm_up(decoder)
        self.state = "compiled"


def compile_decoder_layers(model: torch.nn.Module, when: bool | int = True) -> LayerCompilation:
    """Compile the decoder layers of `model` (a transformers causal LM already switched to the
    cascade attention) now (`when` True) or once `when` tokens ran eagerly. The result is truthy
    once the layers are compiled (see `LayerCompilation`)."""
    return LayerCompilation(model, 0 if when is True else int(when))


@functools.lru_cache(maxsize=1)
def _disabled_attention():
    return torch.compiler.disable(_eager_cascade_attention)


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


__all__ = ["COMPILED_ATTN_IMPLEMENTATION", "LAZY_COMPILE_TOKENS", "LayerCompilation", "should_compile",
           "compile_problem", "compile_decoder_layers"]
