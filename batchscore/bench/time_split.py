"""Where a forward's time goes: matmuls, attention, elementwise work and overhead (torch.profiler).

`time_split(work)` runs `work()` once under torch.profiler (CPU activities) and splits its wall
time by the self time of the operators the calling thread ran:

  matmuls      aten::mm / addmm / bmm / baddbmm / linear kernels and oneDNN's linear (the projections,
               MLPs, LM head)
  attention    the scaled-dot-product / flash attention kernels
  elementwise  every other operator (norms, RoPE, SiLU, residual adds, copies, index_select, cat,
               the log-sum-exp merges, softmax of the LM head)
  overhead     the rest of the wall time: Python, module calls, the engine's packing and bookkeeping

Self times are the calling thread's (an operator's intra-op worker threads run inside it), so the
four shares add up to the wall time. The profiler itself adds a little to every operator call.

On a GPU (`device="cuda"`) the split is of the device's time: each operator's kernels' self
device time, and overhead is the wall time the GPU was not running a kernel (launches, Python,
synchronisation: a launch-bound forward shows here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkl_linear", "aten::mkldnn_linear",
              "aten::_addmm_activation", "aten::linear", "mkldnn::_linear_pointwise")
ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "_efficient_attention")


@dataclass
class TimeSplit:
    """Seconds of one profiled run, by kind of work."""

    wall: float
    matmuls: float
    attention: float
    elementwise: float

    @property
    def overhead(self) -> float:
        return max(self.wall - self.matmuls - self.attention - self.elementwise, 0.0)

    def shares(self) -> dict[str, float]:
        """Each kind's share of the wall time."""
        wall = self.wall or float("nan")
        return {"matmuls": self.matmuls / wall, "attention": self.attention / wall,
                "elementwise": self.elementwise / wall, "overhead": self.overhead / wall}

    def to_dict(self) -> dict:
        return {"wall_s": self.wall, **{k: v for k, v in self.shares().items()}}


def kind_of(op_name: str) -> str:
    """"matmuls", "attention" or "elementwise" for a profiler operator name."""
    if op_name in MATMUL_OPS:
        return "matmuls"
    if any(mark in op_name for mark in ATTENTION_MARKS):
        return "attention"
    return "elementwise"


def time_split(work: Callable[[], object], device: str = "cpu") -> TimeSplit:
    """Run `work()` once under torch.profiler and split its wall time (see the module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    gpu = device.startswith("cuda")
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        work()
        if gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    seconds = {"matmuls": 0.0, "attention": 0.0, "elementwise": 0.0}
    for event in prof.key_averages():
        if not event.key.startswith(("aten::", "mkldnn::")):
            continue
        spent = event.self_device_time_total if gpu else event.self_cpu_time_total
        seconds[kind_of(event.key)] += spent / 1e6
    return TimeSplit(wall, seconds["matmuls"], seconds["attention"], seconds["elementwise"])


def markdown(rows: list[tuple[str, str, TimeSplit]]) -> list[str]:
    """Rows (side, dtype, split) as Markdown table lines."""
    lines = ["| side | dtype | profiled s | matmuls | attention | elementwise | overhead |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for side, dtype, split in rows:
        shares = split.shares()
        lines.append(f"| {side} | {dtype} | {split.wall:.2f} | " + " | ".join(
            f"{shares[k]:.0%}" for k in ("matmuls", "attention", "elementwise", "overhead")) + " |")
    return lines


__all__ = ["TimeSplit", "kind_of", "time_split", "markdown"]
