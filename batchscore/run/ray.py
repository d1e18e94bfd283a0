"""Scale out on Ray: one engine per Ray actor, groups placed by the planner, results streamed back.

The driver keeps the durable-parts writer, so resume works across workers. Ray's own fault
tolerance re-runs a lost worker: actors restart (`max_restarts`) and their unfinished tasks are
retried (`max_task_retries`); a task is a run of whole groups, so a retried task rescores whole
groups and nothing is written twice (parts are written by the driver only, in order).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Sequence

from batchscore.config import EngineConfig, ExecutorConfig
from batchscore.engines.factory import ResolvedEngine, create_engine
from batchscore.engines.base import RawScores
from batchscore.errors import EngineUnavailable, RunInterrupted
from batchscore.run.local import score_with_row_errors, stop_signals
from batchscore.run.sinks import PartSink, RowProgress, record

log = logging.getLogger("batchscore")

TASK_ROWS = 64  # most rows per task: small enough to stream and to lose little when a worker dies
MAX_RESTARTS = 3


def _import_ray():
    try:
        import ray
    except ImportError:
        raise EngineUnavailable("executor.kind: ray needs Ray; install it with pip install 'batchscore[ray]'") from None
    return ray


class ScoringWorker:
    """A Ray actor holding one engine (created in the actor's own process)."""

    def __init__(self, resolved: ResolvedEngine, model_dir: str, engine: EngineConfig, threads: int):
        import torch

        torch.set_num_threads(max(1, threads))
        self.engine = create_engine(resolved, model_dir, engine)

    def score(self, groups, label_ids, where=None) -> list[RawScores]:
        return list(score_with_row_errors(self.engine, groups, label_ids, where))

    def pid(self) -> int:
        return os.getpid()


def score_on_ray(executor: ExecutorConfig, engine: EngineConfig, resolved: ResolvedEngine, model_dir, sinks: Sequence[PartSink],
                 label_ids: Sequence[int] | None, progress: RowProgress, where=None) -> None:
    """Score every sink's remaining groups on its own Ray actor; results go through the sinks.
    `where` (prepare/rows.RowLocations) names a row in its error.

    Side effects: starts a local Ray (or connects to `executor.address`) unless Ray is already
    initialized, and shuts it down again if it started it. Raises RunInterrupted on
    SIGTERM/SIGINT after flushing what is complete.
    """
    ray = _import_ray()
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=executor.address, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)
    actor_cls = ray.remote(num_cpus=executor.cpus_per_worker, num_gpus=executor.gpus_per_worker,
                           max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS)(ScoringWorker)
    actors = {}
    try:
        pending: dict[int, deque] = {}
        ready = []  # each actor's first call: answered once its engine is built
        for sink in sinks:
            if sink.done:
                continue
            actors[sink.worker] = actor_cls.remote(resolved, str(model_dir), engine, int(executor.cpus_per_worker))
            ready.append(actors[sink.worker].pid.remote())
            pending[sink.worker] = deque(
                actors[sink.worker].score.remote(chunk, None if label_ids is None else list(label_ids), where)
                for chunk in _chunks(sink.remaining_groups(), min(TASK_ROWS, sinks[0].part_rows)))
        log.info("ray: %d workers, %d tasks", len(actors), sum(len(q) for q in pending.values()))
        ray.get(ready)  # the engines are loaded (their tasks already queued): scoring time starts here
        progress.start()
        by_worker = {s.worker: s for s in sinks}
        with stop_signals() as stop:
            while any(pending.values()):
                heads = [q[0] for q in pending.values() if q]
                ray.wait(heads, num_returns=1)  # a worker's tasks finish in its submission order
                for worker, queue in pending.items():
                    while queue and ray.wait([queue[0]], timeout=0)[0]:
                        for result in ray.get(queue.popleft()):
                            record(result, by_worker[worker], progress)
                        by_worker[worker].maybe_flush()
                if stop.is_set():
                    for sink in sinks:
                        sink.flush()
                    raise RunInterrupted("interrupted; the scored groups are saved — rerun the same command to resume")
        for sink in sinks:
            sink.flush()
    finally:
        for actor in actors.values():
            ray.kill(actor)
        if started_ray:
            ray.shutdown()


def _chunks(groups, rows_per_task: int):
    """Runs of whole groups with about `rows_per_task` rows each."""
    chunk, rows = [], 0
    for group in groups:
        chunk.append(group)
        rows += len(group.members)
        if rows >= rows_per_task:
            yield chunk
            chunk, rows = [], 0
    if chunk:
        yield chunk
