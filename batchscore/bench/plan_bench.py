"""`batchscore bench plan`: planning time on the industry workload and its growth at 10x the size.

    batchscore bench plan [--requests 8000] [--scale 10] [--runs 3]

Prints the saving ratios of the paper workloads, then the planning time (tree + DP +
grouping + ordering, validation excluded) for N and scale*N requests and the growth ratio.
Targets (the metadata planner's, 2 cores): <= 0.15 s for 8000 requests (~1,600 tokens, sharing
degree ~3), <= 1.5 s for 80,000, and never slower than the tree planner.

Both planners are timed: the one every job runs (`plan_rows`, the plan as metadata over the
token store's flat arrays; the targets are its) and the in-memory tree planner beside it
(`build_plan`, which `plan.order: srjf` still uses). Each timing is one call in a fresh process
(best of --runs processes): a batch job plans once per process, and a fresh process gives both sizes the same cold allocator
(a repeat in the same process lets a small batch reuse freed memory a large one cannot).
CPU time is printed beside wall time because a shared machine inflates wall time.
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from batchscore.bench.common import in_fresh_process
from batchscore.plan import PlanOptions, build_plan, requests_from_token_lists
from batchscore.prepare.synthetic import WORKLOADS, industry


@dataclass
class Timing:
    """Best-of-runs seconds of planning one batch."""

    plan_seconds: float  # wall, PlanStats.plan_seconds
    plan_cpu_seconds: float  # CPU, PlanStats.plan_cpu_seconds
    tokens_per_request: float


PLANNERS = {"metadata": "plan_rows, every job's planner", "tree": "build_plan, in memory (plan.order: srjf)"}


def plan_once(num_requests: int, block_size: int, planner: str = "metadata") -> dict:
    """Generate the industry workload and plan it once with `planner` (PLANNERS); returns
    PlanStats.to_dict() (its timing covers the planning alone, not making the rows)."""
    requests = requests_from_token_lists(industry(num_requests=num_requests, seed=1))
    options = PlanOptions(block_size=block_size)
    if planner == "tree":
        return build_plan(requests, options).stats.to_dict()
    from batchscore.plan.metadata import RequestRows, plan_rows

    return plan_rows(RequestRows.from_requests(requests), options).stats.to_dict()


def time_in_fresh_processes(sizes: list[int], runs: int, block_size: int,
                            planner: str = "metadata") -> dict[int, Timing]:
    """Plan each size once in each of `runs` fresh processes; keep the best times per size.

    Sizes alternate run by run, so a burst of load elsewhere hits them alike.
    """
    best = {n: Timing(float("inf"), float("inf"), 0.0) for n in sizes}
    for _ in range(runs):
        for n in sizes:
            stats = in_fresh_process("batchscore.bench.plan_bench", "plan_once", n, block_size, planner,
                                     what=f"planning {n} requests ({planner})")
            best[n] = Timing(
                min(best[n].plan_seconds, stats["plan_seconds"]),
                min(best[n].plan_cpu_seconds, stats["plan_cpu_seconds"]),
                stats["logical_tokens"] / n,
            )
    return best


def print_savings(block_size: int) -> None:
    """Saving ratios (BatchLLM Eq. 1) of the named workloads at their default sizes."""
    click.echo("== saving ratios (BatchLLM Eq. 1) ==")
    for name in ("table3_a", "table3_b", "microbench", "industry"):
        requests = requests_from_token_lists(WORKLOADS[name]())
        stats = build_plan(requests, PlanOptions(block_size=block_size)).stats
        click.echo(
            f"{name:<11} saving {stats.saving_ratio:6.1%}"
            f"  first-level {stats.first_level_saving_ratio:6.1%}"
            f"  multi-level bound {stats.multilevel_saving_ratio:6.1%}  groups {stats.num_groups}"
        )


@click.command("plan")
@click.option("--requests", type=click.IntRange(min=1), default=8000, show_default=True)
@click.option("--scale", type=click.IntRange(min=1), default=10, show_default=True,
              help="The larger batch is this many times --requests.")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True, help="Fresh processes per size.")
@click.option("--block-size", type=click.IntRange(min=1), default=1, show_default=True)
def plan(requests: int, scale: int, runs: int, block_size: int) -> None:
    """Planner speed and saving ratios: the paper workloads, then N and scale*N industry requests.

    Example:

        batchscore bench plan --requests 8000 --scale 10 --runs 3
    """
    print_savings(block_size)
    click.echo("== planning time, industry workload, one plan per fresh process ==")
    small, large = requests, requests * scale
    for planner in ("tree", "metadata"):  # the targets below are the last one's: every job's planner
        timings = time_in_fresh_processes([small, large], runs, block_size, planner)
        if planner == "tree":
            tree = timings
        click.echo(f"{planner} ({PLANNERS[planner]}):")
        for n, t in timings.items():
            click.echo(
                f"{n:>7} requests ({t.tokens_per_request:,.0f} tokens avg, sharing degree ~3): "
                f"plan {t.plan_seconds:.3f} s wall, {t.plan_cpu_seconds:.3f} s CPU"
            )
    wall_ratio = timings[large].plan_seconds / timings[small].plan_seconds
    cpu_ratio = timings[large].plan_cpu_seconds / timings[small].plan_cpu_seconds
    click.echo(f"growth for {scale}x requests: {wall_ratio:.1f}x wall, {cpu_ratio:.1f}x CPU")
    for n in (small, large):
        ratio = timings[n].plan_seconds / tree[n].plan_seconds
        click.echo(f"metadata / tree at {n} requests: {ratio:.2f}x wall "
                   f"({timings[n].plan_cpu_seconds / tree[n].plan_cpu_seconds:.2f}x CPU)")
    for n, limit in ((8000, 0.15), (80_000, 1.5)):
        if n in timings:
            met = timings[n].plan_seconds <= limit
            click.echo(f"target {n} requests <= {limit} s: {'MET' if met else 'MISSED'}")


if __name__ == "__main__":
    plan()
