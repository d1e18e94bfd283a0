"""Incremental runs (`output.mode: incremental`): rows the previous night scored are carried, not
scored again.

A row is carried when its *content* matches a row of the previous output scored under the same
scoring identity: the same prompt tokens and option tokens (a 128-bit digest of them), the same
model, engine, software and scoring keys (the run identity less its input). The id does not take
part, so a prompt repeated under another id is carried too. A carried row gets the previous
row's raw results (its option totals, top token, greedy flags), so its scores are the previous
night's bits; the assembly normalizes them as it normalizes every row.

What the next night reads is `_<output>.rows` beside the output (Parquet, named in
output/layout.py), one line per scored row — its digest and raw results — with the scoring key in
its metadata. It is written into the parts folder with the output and moved into place after the
completion marker: until then the previous night's file is what a resumed run carries from (the
same rows, so the same partial run); a run killed between the marker and the move leaves no new
file, and the next night carries from the older one (matched by content, as valid) or scores
every row. Rows of the previous night that tonight's input no longer holds are dropped (counted in
the summary).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.io.atomic import atomic_write
from batchscore.io.storage import as_path
from batchscore.output.identity import identity_hash
from batchscore.output.raw_scores import combined

log = logging.getLogger("batchscore")

DIGEST = np.dtype([("hi", "<u8"), ("lo", "<u8")])  # a row's 128-bit content digest, sortable
NEXT_ROWS = "rows.next"  # in the parts folder: the rows file until the output's marker is written
KEY_METADATA = b"batchscore.scoring_key"
_RESULTS = pa.schema([("digest", pa.binary(16)), ("logp", pa.list_(pa.float64())),
                      ("option_tokens", pa.list_(pa.int32())), ("top_logp", pa.float64()),
                      ("top_token", pa.int64()), ("greedy", pa.list_(pa.bool_()))])


def scoring_key(identity: dict) -> str:
    """The run identity less what tonight's input is: two nights of one key score a row alike."""
    return identity_hash({k: v for k, v in identity.items() if k not in ("input", "model_path")})


def row_digest(tokens: np.ndarray, options=None) -> bytes:
    """16 bytes naming a row's scoring content: its prompt tokens and its options' tokens."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    if options is not None:
        digest.update(b"|" + np.ascontiguousarray(options.tokens, dtype="<i4").tobytes())
        digest.update(b"|" + np.ascontiguousarray(options.lengths, dtype="<i8").tobytes())
    return digest.digest()


def store_digests(store, num_rows: int) -> np.ndarray:
    """[num_rows] DIGEST of every row of a token store (zero for rows it does not hold)."""
    out = np.zeros(num_rows, dtype=DIGEST)
    view = out.view(np.uint8).reshape(num_rows, 16)
    flat, sets = store.flat, store.option_set
    options = store.option_sets()
    for position, row in enumerate(np.asarray(store.row_ids)):
        index = int(sets[position])
        view[row] = np.frombuffer(row_digest(flat.row(position), options[index] if index >= 0 else None), np.uint8)
    return out


@dataclass
class Previous:
    """The previous night's scored rows: their digests, sorted, and their raw results."""

    digests: np.ndarray  # [M] DIGEST, sorted
    results: pa.Table  # [M] _RESULTS, in the order of `digests`
    path: str

    @classmethod
    def load(cls, path, key: str) -> Previous | None:
        """The rows file at `path` when it exists and was scored under `key` (None otherwise, with
        the reason logged)."""
        where = as_path(path)
        if not where.exists():
            log.info("incremental: no previous rows at %s: every row is scored", where)
            return None
        with where.open("rb") as handle:
            table = pq.read_table(handle)
        recorded = (table.schema.metadata or {}).get(KEY_METADATA, b"").decode()
        if recorded != key:
            log.warning("incremental: %s was scored under another model, engine, software or scoring keys: "
                        "every row is scored", where)
            return None
        table = table.select(_RESULTS.names).cast(_RESULTS)
        digests = np.frombuffer(table.column("digest").combine_chunks().buffers()[1], dtype=DIGEST,
                                count=table.num_rows) if table.num_rows else np.zeros(0, DIGEST)
        order = np.argsort(digests, order=("hi", "lo"), kind="stable")
        return cls(digests[order], table.take(pa.array(order)), str(where))


@dataclass
class Carried:
    """Tonight's rows found in the previous night's: `rows` (input row ids) and, for each, its
    index in `Previous.results`; `dropped`: previous rows no row of tonight's matched."""

    rows: np.ndarray
    found: np.ndarray
    dropped: int

    def part(self, previous: Previous) -> pa.Table:
        """The carried rows as a part file's table (output/parts.py): their previous results."""
        results = previous.results.take(pa.array(self.found))
        n = len(self.rows)
        return pa.table({"row_id": pa.array(self.rows, type=pa.int64()), "logp": results.column("logp"),
                         "option_tokens": results.column("option_tokens"), "error": pa.nulls(n, pa.string()),
                         "error_kind": pa.nulls(n, pa.string()), "top_logp": results.column("top_logp"),
                         "top_token": results.column("top_token"), "greedy": results.column("greedy")})


def match(digests: np.ndarray, previous: Previous | None) -> Carried:
    """Tonight's rows (non-zero digests) whose digest the previous night scored."""
    if previous is None or not len(previous.digests):
        return Carried(np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    present = np.flatnonzero((digests["hi"] != 0) | (digests["lo"] != 0))
    at = np.searchsorted(previous.digests, digests[present])
    at = np.minimum(at, len(previous.digests) - 1)
    hit = previous.digests[at] == digests[present]
    found = at[hit]
    dropped = len(previous.digests) - len(np.unique(found))
    return Carried(present[hit].astype(np.int64), found.astype(np.int64), int(dropped))


def write_rows_file(path, key: str, digests: np.ndarray, windows) -> int:
    """Write the rows file the next night reads: every scored row's digest and raw results, from
    the output's `windows` (output/row_merge.Window, in row order); returns the rows written."""
    written = 0

    def write(tmp: str) -> None:
        nonlocal written
        schema = _RESULTS.with_metadata({KEY_METADATA: key.encode()})
        with pq.ParquetWriter(tmp, schema) as writer:
            for window in windows:
                scores = window.scores
                ok = np.ones(window.rows, dtype=bool)
                ok[[row - window.start for row in window.errors]] = False
                ok &= np.asarray(scores.logp.is_valid().to_numpy(zero_copy_only=False))
                ok[scores.unscored()] = False
                keep = np.flatnonzero(ok)
                window_digests = digests[window.start:window.end][keep]
                keep = keep[(window_digests["hi"] != 0) | (window_digests["lo"] != 0)]
                take = pa.array(keep)
                raw = np.ascontiguousarray(digests[window.start:window.end][keep]).view(np.uint8).tobytes()
                columns = [pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), len(keep), [None, pa.py_buffer(raw)]),
                           scores.logp.take(take), _or_nulls(scores.tokens, take, pa.list_(pa.int32())),
                           _or_nulls(scores.top_logp, take, pa.float64()),
                           _or_nulls(scores.top_token, take, pa.int64()),
                           _or_nulls(scores.greedy, take, pa.list_(pa.bool_()))]
                writer.write_table(pa.table(columns, schema=schema))
                written += len(keep)

    atomic_write(as_path(path), write)
    return written


def move_rows_file(written, final) -> None:
    """Put the rows file written with the output (`written`, in the parts folder) in its place
    beside the output; nothing when there is none (not an incremental run)."""
    source = as_path(written)
    if not source.exists():
        return
    target = as_path(final)
    if isinstance(source, type(target)) and hasattr(source, "replace"):
        try:
            source.replace(target)  # one file system: an atomic rename
            return
        except (OSError, NotImplementedError):
            pass
    atomic_write(target, lambda tmp: as_path(tmp).write_bytes(source.read_bytes()))


def _or_nulls(array, take, value_type):
    if array is None:
        return pa.nulls(len(take), value_type)
    return combined(array).take(take).cast(value_type)


def rows_digest(carried: Carried) -> str:
    """Which rows are carried, in 16 hex digits (a resume must carry the same rows)."""
    return hashlib.sha256(np.ascontiguousarray(carried.rows, dtype="<i8").tobytes()).hexdigest()[:16]


__all__ = ["Carried", "DIGEST", "NEXT_ROWS", "Previous", "match", "move_rows_file", "row_digest",
           "rows_digest", "scoring_key", "store_digests", "write_rows_file"]
