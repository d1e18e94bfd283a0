"""What a night cost: each stage's machine-seconds and, with the job's `report.price_per_hour`,
the run's price, its price per million rows and what prefix sharing saved.

Machine-seconds are a stage's wall seconds times the machines it held: one for a local run and for
each static shard (a shard's summary counts its own night), and for Ray's scoring the workers
(`executor.num_workers`, one worker a machine, as the recipes in jobs/deploy/ lay them out; the
driver's machine is counted once for the whole run). Sharing's saving is the scoring stage's
cost times the tokens it did not compute over those it did (logical − processed) / processed: the
same rows scored one plain forward each, at the run's own token rate.

Carrying's saving (an incremental night) prices the carried rows' scoring at tonight's own speed:
their logical tokens, shared as tonight's rows were (× processed / logical tokens), over the
processed tokens this run computed per scoring machine-second:

    cost_saved_by_carrying = price/3600 × score machine-seconds
                             × logical_tokens_carried × (processed_tokens / logical_tokens) / processed_tokens_done

None when tonight computed no token (every row carried: no speed to price them at).
"""

from __future__ import annotations

from batchscore.output.summary import Cost, RunSummary


def night_cost(summary: RunSummary, price_per_hour: float | None, ray_workers: int = 0) -> Cost:
    """The cost part of `summary` (`ray_workers`: the Ray actors that scored, 0 for a local run)."""
    timing, audit = summary.timing, summary.audit
    score = timing.score_seconds * (1 + ray_workers)  # the driver's machine waits while the workers score
    other = max(summary.seconds - timing.prepare_seconds - timing.score_seconds - timing.write_seconds
                - audit.seconds, 0.0)
    stages = {"read_and_plan": timing.prepare_seconds, "score": score, "write": timing.write_seconds,
              "audit": audit.seconds, "other": other}
    cost = Cost(machine_seconds={name: round(value, 3) for name, value in stages.items()})
    if price_per_hour is None:
        return cost
    per_second = price_per_hour / 3600.0
    total = sum(stages.values()) * per_second
    saved = (score * per_second * (summary.logical_tokens - summary.processed_tokens) / summary.processed_tokens
             if summary.processed_tokens > 0 else 0.0)
    return Cost(cost.machine_seconds, price_per_hour, total,
                total / summary.rows * 1e6 if summary.rows else None, max(saved, 0.0),
                _carrying_saved(summary, score * per_second))


def _carrying_saved(summary: RunSummary, score_cost: float) -> float | None:
    """What scoring the carried rows tonight would have cost (see the module's formula)."""
    carried, done = summary.carry.tokens, summary.progress.processed_tokens_done
    if carried is None or done <= 0 or summary.logical_tokens <= 0:
        return None
    shared = carried * summary.processed_tokens / summary.logical_tokens  # as tonight's rows shared prefixes
    return score_cost * shared / done


def cost_line(cost: Cost) -> str | None:
    """The summary's cost line, e.g. "cost: 0.0123 at 3.2 an hour (2.46 per million rows; sharing
    saved 0.0310; carrying rows saved 0.0950)" (carrying: an incremental night); None without a price."""
    if cost.total is None:
        return None
    per_million = "" if cost.per_million_rows is None else f"{cost.per_million_rows:.4g} per million rows; "
    carrying = "" if cost.carrying_saved is None else f"; carrying rows saved {cost.carrying_saved:.4g}"
    return (f"cost: {cost.total:.4g} at {cost.price_per_hour:g} an hour ({per_million}"
            f"sharing saved {cost.sharing_saved:.4g}{carrying})")
