"""A run's own figures when it scores part of a job: a static shard's share of the rows, tokens
and errors (its summary counts its own night; the merge counts the set), and the tokens of an
incremental night's carried rows (what carrying saved, output/cost.py).

A record (an input row; a questions job reads each once per question) belongs to the shard that
scores its first read; rows refused before scoring (input errors) belong to shard 0, so the
shards' rows add up to the set's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from batchscore.output.parts import Manifest, PartStore
from batchscore.plan.metadata import MetaPlan
from batchscore.store.tokens import TokenStore


def logical_tokens_at(store: TokenStore, positions: np.ndarray) -> int:
    """The logical tokens of the store's `positions` (prompts, and multi-token options as plain
    forwards would compute them), as the plan counts its rows'."""
    plain_extra, _ = store.option_counts(positions)
    return int(np.asarray(store.lengths)[positions].sum()) + plain_extra


def processed_tokens_of(share: MetaPlan, store: TokenStore) -> int:
    """The tokens `share`'s groups compute: each prefix once, each member's suffix, the option
    positions (a group cut between shards computes its prefix in each)."""
    _, option_rows = store.option_counts(share.rows)
    return int(np.sum(share.group_tokens)) + option_rows


@dataclass(frozen=True)
class ShareRows:
    """What a shard's summary counts as its rows (records) and reads."""

    rows: int  # the records it owns (its first reads', and shard 0 the input errors')
    rows_error: int  # of them, those with an error (refused before scoring, or by the engine)
    reads: int  # the reads (store rows) it scores


def share_rows(shares: list[MetaPlan], index: int, store: TokenStore, store_part: PartStore, manifest: Manifest,
               input_errors: dict[int, str], record_of: np.ndarray | None, num_records: int) -> ShareRows:
    """Shard `index`'s rows of the set `shares` (every shard's plan over `store`), its errors
    read back from its own parts (`manifest`: every part it and its earlier attempts wrote)."""
    share = shares[index]
    failed = np.concatenate([_error_rows(store_part, manifest),
                             np.fromiter(input_errors if index == 0 else (), dtype=np.int64)])
    if record_of is None:  # the rows are the records: no per-row array needed
        own = len(share.rows) + (len(input_errors) if index == 0 else 0)
        return ShareRows(own, len(np.unique(failed)), len(share.rows))
    owner = _record_owners(shares, store, np.asarray(record_of), num_records)
    failed_records = np.unique(np.asarray(record_of)[failed]) if len(failed) else np.zeros(0, np.int64)
    return ShareRows(int(np.sum(owner == index)), int(np.sum(owner[failed_records] == index)), len(share.rows))


def _record_owners(shares: list[MetaPlan], store: TokenStore, record_of: np.ndarray, num_records: int) -> np.ndarray:
    """[records] the shard that scores each record's first read (0 for a record with none planned)."""
    row_shard = np.full(len(record_of), -1, dtype=np.int32)
    row_ids = np.asarray(store.row_ids)
    for shard, share in enumerate(shares):
        row_shard[row_ids[share.rows]] = shard
    planned = np.flatnonzero(row_shard >= 0)  # in row order: a record's reads are numbered in order
    records, first = np.unique(record_of[planned], return_index=True)
    owner = np.zeros(num_records, dtype=np.int32)
    owner[records] = row_shard[planned[first]]
    return owner


def _error_rows(store: PartStore, manifest: Manifest) -> np.ndarray:
    """The row ids the engine could not score in `manifest`'s parts (their row and error columns only)."""
    found = []
    for part in manifest.parts:
        with (store.folder / part.file).open("rb") as handle:
            table = pq.read_table(handle, columns=["row_id", "error"])
        failed = table.column("error").is_valid().to_numpy(zero_copy_only=False)
        found.append(table.column("row_id").to_numpy()[failed])
    return np.concatenate(found) if found else np.zeros(0, np.int64)
