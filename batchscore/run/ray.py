"""Scale out on Ray: one engine per Ray actor, groups placed by the planner, results streamed back.

Workers read their own rows: an actor is given its share of the plan (run/ranges.py: its rows'
store positions and its groups' prefix lengths, a few integers a row) and the token store's
folder, opens the store memory-mapped and builds each group as it runs it; a task names a run of
the share's groups by index. No token array leaves the driver, and the driver holds the plan and
the parts writer only. On a cluster the store's folder (in the output's parts folder, or for an
object-store output under $BATCHSCORE_HOME: run/runner.token_folder) must be on a file system
every node mounts at the same path; an actor that cannot open it says so by name.

The driver keeps the durable-parts writer, so resume works across workers. Ray's own fault
tolerance re-runs a lost worker: actors restart (`max_restarts`) and their unfinished tasks are
retried (`max_task_retries`); a task is a run of whole groups, so a retried task rescores whole
groups and nothing is written twice (parts are written by the driver only, in order).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from batchscore.config import EngineConfig, ExecutorConfig
from batchscore.engines.factory import ResolvedEngine, create_engine
from batchscore.engines.base import RawScores
from batchscore.errors import EngineUnavailable, RunInterrupted
from batchscore.run.local import score_with_row_errors, stop_signals
from batchscore.run.ranges import StoreGroups
from batchscore.run.sinks import PartSink, RowProgress, record
from batchscore.plan.metadata import MetaPlan
from batchscore.store.tokens import TokenStore

log = logging.getLogger("batchscore")

TASK_ROWS = 64  # most rows per task: small enough to stream and to lose little when a worker dies
IN_FLIGHT = 16  # tasks queued on an actor at once: it never waits for the driver, and the driver holds few
MAX_RESTARTS = 3


def _import_ray():
    try:
        import ray
    except ImportError:
        raise EngineUnavailable("executor.kind: ray needs Ray; install it with pip install 'batchscore[ray]'") from None
    return ray


class ScoringWorker:
    """A Ray actor holding one engine (created in the actor's own process)."""

    def __init__(self, resolved: ResolvedEngine, model_dir: str, engine: EngineConfig, threads: int,
                 share: "Share"):
        import torch

        torch.set_num_threads(max(1, threads))
        self.engine = create_engine(resolved, model_dir, engine)
        self.share = share
        self._groups: StoreGroups | None = None

    def score_share(self, first: int, end: int, skip: int) -> list[RawScores]:
        """Groups [first, end) of this actor's share, the first one's first `skip` members left
        out (a resume inside it), built from the token store as they run."""
        if self._groups is None:  # opened here, in the actor's process: a memory map, not a copy
            self._groups = self.share.groups()
        groups = self._groups.from_member(first, skip)[: end - first]
        return list(score_with_row_errors(self.engine, groups, self.share.label_ids, self.share.where))

    def pid(self) -> int:
        return os.getpid()


@dataclass
class Share:
    """What an actor that reads its own rows is given once: the store's folder, its share of the
    plan (run/ranges.place_shares: store positions and prefix lengths, no tokens), the job's
    one-token label ids and where each row was read (to name a row in its error)."""

    folder: str
    plan: MetaPlan
    label_ids: list[int] | None
    where: object | None

    @classmethod
    def of(cls, groups: StoreGroups, label_ids, where) -> "Share":
        plan = replace(groups.meta, stats=None)  # the whole plan's statistics stay with the driver
        folder = str(groups.store.folder.resolve())  # an actor's working folder is not the driver's
        return cls(folder, plan, None if label_ids is None else list(label_ids), where)

    def groups(self) -> StoreGroups:
        try:
            store = TokenStore.open(self.folder)
        except FileNotFoundError:
            import socket

            raise EngineUnavailable(
                f"a Ray worker on {socket.gethostname()} cannot read the token store at {self.folder}: on a "
                "cluster it must be on a file system every node mounts at that path (the output's folder; for "
                "an object-store output, $BATCHSCORE_HOME)") from None
        return StoreGroups.range(self.plan, store, 0, len(self.plan))


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
        todo: dict[int, Iterator] = {}  # each worker's tasks not yet submitted, in order
        pending: dict[int, deque] = {}
        ready = []  # each actor's first call: answered once its engine is built
        rows_per_task = min(TASK_ROWS, sinks[0].part_rows) if sinks else TASK_ROWS
        for sink in sinks:
            if sink.done:
                continue
            actor = actors[sink.worker] = actor_cls.remote(resolved, str(model_dir), engine,
                                                           int(executor.cpus_per_worker),
                                                           Share.of(sink.groups, label_ids, where))
            todo[sink.worker] = _submitted(actor.score_share, share_tasks(sink.remaining_groups(), rows_per_task))
            ready.append(actor.pid.remote())
            pending[sink.worker] = deque(itertools.islice(todo[sink.worker], IN_FLIGHT))
        if actors:
            log.info("ray: %d workers, reading their rows from %s", len(actors), sinks[0].groups.store.folder)
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
                        queue.extend(itertools.islice(todo[worker], 1))
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


def _submitted(method, tasks) -> Iterator:
    """Each task's call of the actor's `method`, submitted as the iterator is read."""
    return (method.remote(*task) for task in tasks)


def share_tasks(groups: StoreGroups, rows_per_task: int) -> Iterator[tuple[int, int, int]]:
    """A share's remaining groups in runs of whole groups of about `rows_per_task` rows, as (first
    group, end group, members of the first to skip), indices into the share: what a task sends
    instead of the groups."""
    first, rows = 0, 0
    sizes = groups.sizes.tolist()
    for k, size in enumerate(sizes):
        rows += size
        if rows >= rows_per_task:
            yield int(groups.indices[first]), int(groups.indices[k]) + 1, groups.skip if first == 0 else 0
            first, rows = k + 1, 0
    if first < len(sizes):
        yield int(groups.indices[first]), int(groups.indices[-1]) + 1, groups.skip if first == 0 else 0
