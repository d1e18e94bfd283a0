"""torch's compiler cache folder (`TORCHINDUCTOR_CACHE_DIR`) checked before torch's compiler loads.

Importing a transformers model imports `torch._dynamo`, which creates that folder at import time:
a path that cannot be a folder (a file, a path under a file, no permission) would fail every run
with an OSError, even one that never compiles. The cache only saves compile time, so such a path
is dropped with a warning and torch's default folder is used (a compile there starts cold).
Imports no torch: it must run before torch's compiler is imported.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("batchscore")

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


# Variables that hold torch's kernels to a lower instruction set than the CPU's (as `make test-avx2` does)
HOLDS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def use_usable_inductor_cache() -> None:
    """Drop `TORCHINDUCTOR_CACHE_DIR` from this process's environment (with a warning) when it
    cannot be created as a folder; otherwise create it, as torch would. A process whose kernels are
    held to a lower instruction set (`HOLDS`) and that names no cache gets a cache of its own beside
    torch's default: compiled kernels shared between held and unheld processes of one machine gave
    wrong scores (NaN) and heap corruption in the next compile (seen with `make test-avx2` after
    `make test`)."""
    path = os.environ.get(VARIABLE)
    if not path:
        held = "-".join(f"{name}={os.environ[name]}" for name in HOLDS if os.environ.get(name))
        if held:
            import getpass
            import tempfile

            os.environ[VARIABLE] = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}",
                                                "held", held.replace("/", "_"))
        return
    try:
        os.makedirs(path, exist_ok=True)
        usable = os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)
        reason = "not a writable folder"
    except OSError as exc:
        usable, reason = False, exc.strerror or str(exc)
    if not usable:
        log.warning("%s=%s cannot be used (%s): torch's default compiler cache is used instead, and a compile "
                    "(engine.compile) starts cold", VARIABLE, path, reason)
        del os.environ[VARIABLE]
