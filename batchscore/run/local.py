"""The local executor: score a worker's groups with one engine in this process, stop cleanly."""

from __future__ import annotations

import itertools
import logging
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Sequence

from batchscore.engines.base import Engine, RawScores, num_options
from batchscore.errors import RunInterrupted
from batchscore.run.sinks import PartSink, RowProgress, record
from batchscore.plan.order import largest_pass
from batchscore.plan.types import PrefixGroup

log = logging.getLogger("batchscore")


def score_locally(engine: Engine, sink: PartSink, label_ids: Sequence[int] | None, progress: RowProgress,
                  where: Callable[[int], str] | None = None) -> None:
    """Score the sink's remaining rows with `engine` in this process.

    SIGTERM/SIGINT is checked after every result, i.e. after every forward batch of the engine:
    the rows scored so far are flushed as a part and RunInterrupted is raised. `where` names a
    row in its error (its file:line; default "row N").
    """
    progress.start()  # the engine is loaded: scoring time (and the bar's ETA) starts here
    with stop_signals() as stop:
        for result in score_with_row_errors(engine, sink.remaining_groups(), label_ids, where, fail_fast=True):
            record(result, sink, progress)
            if stop.is_set():
                sink.flush()
                raise RunInterrupted(
                    f"interrupted after {sink.position} of {sink.total} rows; the scored rows are saved in "
                    f"{sink.store.folder} — rerun the same command to resume")
            sink.maybe_flush()
        sink.flush()
    if not sink.done:
        raise RuntimeError(f"the engine returned results for {sink.position} of {sink.total} rows")


def score_with_row_errors(engine: Engine, groups: Sequence[PrefixGroup], label_ids: Sequence[int] | None,
                          where: Callable[[int], str] | None = None, fail_fast: bool = False):
    """`engine.score`, except that rows the engine says it cannot fit (its `memory_problems`)
    come out as error results, named by `where` (file:line), instead of stopping the job.
    With `fail_fast`, the largest pass runs first (`run_largest_pass`). Yields group by group;
    builds each group as it goes (a lazy sequence of groups stays lazy)."""
    bad = {p.row_id: f"{where(p.row_id)}: {p.reason}" if where is not None and hasattr(p, "reason") else str(p)
           for p in engine.memory_problems(groups)}
    if fail_fast:
        run_largest_pass(engine, groups, label_ids, frozenset(bad))
    if not bad:
        yield from engine.score(groups, label_ids)
        return
    pairs = ((g, PrefixGroup(g.prefix, [m for m in g.members if m.row_id not in bad])) for g in groups)
    mine, theirs = itertools.tee(pairs)  # the engine reads ahead by at most a pass
    results = iter(engine.score((kept for _, kept in theirs if kept.members), label_ids))
    for group, kept in mine:
        for member in group.members:
            if member.row_id in bad:
                yield RawScores.failed(member.row_id, num_options(member, label_ids), bad[member.row_id])
        for _ in kept.members:
            yield next(results)


def run_largest_pass(engine: Engine, groups: Sequence[PrefixGroup], label_ids: Sequence[int] | None,
                     skip: frozenset[int] = frozenset()) -> None:
    """Fail fast: score the longest prompt alone before anything else and drop its result (it is
    scored again in its place, so every row's bits are the plan order's), so a job whose largest
    pass cannot fit fails in its first minute, not its last hour (plan/order.largest_pass).
    Costs one prompt's forward, so it runs only for jobs of at least FAIL_FAST_MIN_PASSES such
    prompts of work (a smaller job reaches its largest pass in minutes anyway)."""
    largest = groups.largest_pass(skip) if hasattr(groups, "largest_pass") else largest_pass(groups, skip)
    if largest is None:
        return
    length = largest.prefix_len + largest.members[0].work_tokens
    if length * FAIL_FAST_MIN_PASSES > _work_tokens(groups):
        return  # a small job fails fast anyway: the probe would cost a noticeable share of its time
    log.info("fail fast: the longest prompt (%d tokens, row %d) is scored first, alone",
             largest.prefix_len + largest.members[0].work_tokens, largest.members[0].row_id)
    for _ in engine.score([largest], label_ids):
        pass


FAIL_FAST_MIN_PASSES = 50  # the probe runs when the job is at least 50 longest prompts of work (≤ 2% extra)


def _work_tokens(groups) -> int:
    """The tokens `groups` will compute (each prefix once, each member's own tokens)."""
    if hasattr(groups, "work_tokens"):
        return groups.work_tokens()
    return sum(g.prefix_len + sum(m.work_tokens for m in g.members) for g in groups)


@contextmanager
def stop_signals():
    """Turn SIGTERM/SIGINT into a flag the executors check after every result (main thread only)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum, frame):
        if stop.is_set():  # a second signal: stop right away
            raise KeyboardInterrupt
        log.warning("signal %s: saving the rows scored so far, then stopping", signum)
        stop.set()

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
