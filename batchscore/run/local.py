"""The local executor: score a worker's groups with one engine in this process, stop cleanly."""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Sequence

from batchscore.engines.base import Engine, RawScores, num_options
from batchscore.errors import RunInterrupted
from batchscore.run.sinks import PartSink, RowProgress, record
from batchscore.plan.types import PrefixGroup

log = logging.getLogger("batchscore")


def score_locally(engine: Engine, sink: PartSink, label_ids: Sequence[int] | None, progress: RowProgress,
                  where: Callable[[int], str] | None = None) -> None:
    """Score the sink's remaining rows with `engine` in this process.

    SIGTERM/SIGINT is checked after every result, i.e. after every forward batch of the engine:
    the rows scored so far are flushed as a part and RunInterrupted is raised. `where` names a
    row in its error (its file:line; default "row N").
    """
    with stop_signals() as stop:
        for result in score_with_row_errors(engine, sink.remaining_groups(), label_ids, where):
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
                          where: Callable[[int], str] | None = None):
    """`engine.score`, except that rows the engine says it cannot fit (its `memory_problems`)
    come out as error results, named by `where` (file:line), instead of stopping the job.
    Yields group by group."""
    bad = {p.row_id: f"{where(p.row_id)}: {p.reason}" if where is not None and hasattr(p, "reason") else str(p)
           for p in engine.memory_problems(groups)}
    if not bad:
        yield from engine.score(groups, label_ids)
        return
    runnable = [PrefixGroup(g.prefix, [m for m in g.members if m.row_id not in bad]) for g in groups]
    results = iter(engine.score([g for g in runnable if g.members], label_ids))
    for group, kept in zip(groups, runnable):
        for member in group.members:
            if member.row_id in bad:
                yield RawScores.failed(member.row_id, num_options(member, label_ids), bad[member.row_id])
        for _ in kept.members:
            yield next(results)


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
