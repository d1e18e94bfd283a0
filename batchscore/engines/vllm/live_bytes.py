"""Tensor-level accounting of a forward's activation memory (tracemalloc-style, for CPU, where
torch's allocator keeps no statistics and the process's peak RSS also holds the allocator's own
caches): every storage an op creates while the mode is on counts from its creation until the
last tensor viewing it is gone; the peak is the most bytes alive at once. Storages that existed
before (weights, the KV cache) and outputs that alias an input (in-place ops, views) add nothing.
Scratch memory a C++ kernel allocates inside itself is not seen.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Counts bytes of the storages created under it that are still referenced (`now`, `peak`)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive on it]

    def reset(self) -> None:
        self.peak = self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        entry = self._live.get(address)
        if entry is None:
            if address == 0 or address in inputs:  # empty, or an alias of a storage made before
                return
            entry = self._live[address] = [storage.nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(tensor, self._release, address)

    def _release(self, address: int) -> None:
        entry = self._live.get(address)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[address]
            self.now -= entry[0]


class CountedForward:
    """A model's `forward` run under `LiveTensorBytes` (one mode for every call)."""

    def __init__(self, forward, mode: LiveTensorBytes) -> None:
        self.forward, self.mode = forward, mode

    def __call__(self, *args, **kwargs):
        with self.mode:
            return self.forward(*args, **kwargs)
