"""Building a job's token store, and planning a job from it.

`build_store(source, folder)` reads, renders and tokenizes the job's rows exactly as its task's
reader does (the same `prepare_input`, with the store as its sink) and writes them once into
`folder`. A labels job streams: each input batch's rows go to the store and are dropped (token id
columns are read as arrays, prompts rendered and encoded by the tokenizer's batch call, its own
threads on every core); so does a questions job, each batch's reads (its records, the small
objects its output is assembled from, stay in memory). Synthetic rows are read whole as before,
then written to the store: the same tokens, not yet the bounded memory.

`plan_store(source, folder)` is `batchscore plan`'s path: the store, then the metadata plan
(plan/metadata.py), whose statistics and groups equal `build_plan`'s over the same requests.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from batchscore.plan.metadata import MetaPlan, plan_rows
from batchscore.prepare.source import JobSource, PreparedJob, plan_options
from batchscore.store.tokens import StoreWriter, TokenStore, store_folder  # noqa: F401 (run/ names it here)

log = logging.getLogger("batchscore")

_WRITE_BATCH = 8192  # requests written to the store per call when a reader returns them whole


def build_store(source: JobSource, folder, progress: Callable[[int], None] | None = None, reuse: bool = True
                ) -> tuple[PreparedJob, TokenStore]:
    """Tokenize `source`'s rows into a new store in `folder` (anything there is replaced), or, with
    `reuse`, take the complete store already there when it was built from the same content
    (`source.identity`: input, prompt, labels, model and tokenizer files, software): a resumed
    run never tokenizes again. Returns the PreparedJob (ids, kept columns, errors; `input.requests`
    empty when the rows streamed into the store) and the store. Raises what the task's reader raises."""
    config = source.config
    if reuse and source.identity:
        store = TokenStore.reusable(folder, source.identity)
        if store is not None:
            return reused_store(source, store, progress), store
    writer = StoreWriter(folder, source.identity)
    if source.task.read_into is not None and config.input.synthetic is None:  # the rows streamed into the store
        job = source.task.read_into(source, writer, progress)
    else:
        job = source.task.prepare(config, source, True, progress)
        requests = job.input.requests
        for start in range(0, len(requests), _WRITE_BATCH):
            writer.add_requests(requests[start:start + _WRITE_BATCH])
        if job.content_free is not None:
            writer.add_requests([job.content_free])
    writer.add_errors(sorted(job.input.errors.items()))
    store = writer.close(job.input.num_rows, extra={
        "label_ids": job.label_ids, "content_free": job.content_free is not None})
    log.info("built the token store in %s: %d rows, %d tokens", folder, store.num_rows, store.logical_tokens)
    _release_read_buffers()
    return job, store


def _release_read_buffers() -> None:
    """Hand the reader's freed buffers back to the OS (Arrow's pool and the C allocator keep
    them otherwise), so the plan that follows starts from the memory the job holds."""
    import pyarrow as pa

    from batchscore.engines.peak_memory import release_free_memory

    pa.default_memory_pool().release_unused()
    release_free_memory()


def reused_store(source: JobSource, store: TokenStore, progress=None) -> PreparedJob:
    """The PreparedJob of a job whose store is reused: its ids and kept columns read again
    (cheap: no rendering, no tokenizing), its errors, label ids and content-free row from the store."""
    job = source.task.prepare(source.config, source, False, progress)
    job.input.errors = store.errors
    job.label_ids = store.label_ids
    job.content_free = store.request(store.num_rows - 1) if store.manifest.get("content_free") else None
    log.info("reused the token store in %s: %d rows, not tokenized again", store.folder, store.num_rows)
    return job


def plan_store(source: JobSource, folder, progress: Callable[[int], None] | None = None
               ) -> tuple[MetaPlan, TokenStore, PreparedJob]:
    """Plan `source`'s job through a token store built in `folder`: (the metadata plan, the store,
    the PreparedJob). The plan's statistics and groups equal `build_plan`'s over the job's requests."""
    job, store = build_store(source, folder, progress)
    return plan_rows(store, plan_options(source.config, source.kind)), store, job
