"""How close each run came to the hardware: one row per engine and dtype.

For every run (a `Throughput` with its FLOPs counted by `engines.shape.forward_flops`):

  processed tokens/s   tokens actually computed per second
  logical tokens/s     prompt tokens as if unshared, per second
  x <first dtype>      this engine's logical tokens/s over the same engine in the first dtype
                       of the run (e.g. bfloat16 over float32: the acceptance ratio of issue 16)
  fraction of FLOP ideal   speedup over the plain forward of the same dtype / the FLOP ideal
                       (FLOPs without sharing / FLOPs with sharing)
  GFLOP/s              forward FLOPs computed per second
  x GEMM peak          that rate over the measured matmul peak of the dtype (bench/gemm_peak.py)
"""

from __future__ import annotations

from dataclasses import dataclass

from batchscore.bench.gemm_peak import GemmPeak, peak_fraction
from batchscore.bench.results import Throughput


@dataclass
class Efficiency:
    engine: str
    dtype: str
    processed_tokens_per_s: float
    logical_tokens_per_s: float
    over_first_dtype: float | None
    flop_ideal_fraction: float | None
    flops_per_s: float
    gemm_peak_fraction: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def efficiency(runs: list[Throughput], flop_ideal: float | None, peak: GemmPeak | None,
               plain: str = "plain") -> list[Efficiency]:
    """One `Efficiency` per run, in the runs' order. `plain` names the unshared baseline whose
    speedup sets the fraction of the FLOP ideal (same dtype only)."""
    first_dtype = runs[0].dtype if runs else ""
    rows = []
    for run in runs:
        same = {r.name: r for r in runs if r.dtype == run.dtype}
        base = same.get(plain)
        fraction = None
        if base is not None and run.name != plain and flop_ideal and run.seconds and base.seconds:
            fraction = run.speedup_over(base) / flop_ideal
        first = next((r for r in runs if r.name == run.name and r.dtype == first_dtype), None)
        over_first = run.speedup_over(first) if first is not None and first is not run and first.seconds else None
        rate = run.flops_per_s if run.flops else float("nan")  # nan: FLOPs not counted (vLLM)
        rows.append(Efficiency(run.name, run.dtype, run.processed_tokens_per_s, run.logical_tokens_per_s, over_first,
                               fraction, rate, peak_fraction(rate, peak, run.dtype)))
    return rows


def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None or value != value else format(value, fmt)


def markdown(rows: list[Efficiency], first_dtype: str, label: str = "") -> list[str]:
    """The rows as Markdown table lines (a `label` column first when given, e.g. the workload)."""
    head = "| workload " if label else ""
    lines = [f"{head}| engine | dtype | processed tokens/s | logical tokens/s | x {first_dtype} "
             "| fraction of FLOP ideal | GFLOP/s | x GEMM peak |",
             "|" + "---|" * (2 + bool(label)) + "---:|" * 6]
    for r in rows:
        lines.append(f"{f'| {label} ' if label else ''}| {r.engine} | {r.dtype} | {r.processed_tokens_per_s:,.0f} "
                     f"| {r.logical_tokens_per_s:,.0f} | {_f(r.over_first_dtype, '.2f')}{'x' if r.over_first_dtype else ''} "
                     f"| {_f(r.flop_ideal_fraction, '.2f')} | {_f(r.flops_per_s / 1e9, ',.1f')} "
                     f"| {_f(r.gemm_peak_fraction, '.1%')} |")
    return lines


__all__ = ["Efficiency", "efficiency", "markdown"]
