"""A static shard's completion manifest: the record that its share is finished, which the merge reads.

A shard's running manifest (`shard-I-of-N.manifest.json`, output/parts.py) is rewritten after
every part. Once the whole share is scored the shard writes, beside it in the parts folder,
`shard-I-of-N.complete.json` — written once, whole (one put in an object store) — holding its index,
the set's count N, the rows it scored, the job it belongs to (the identity digest with N:
`job_hash`), the digest of the token store it planned from, and every file it wrote with its size
and sha256. The parts folder (`_<output>.parts`) starts with `_`, so dataset readers skip it.

The set needs nothing else in common: no shared file system, only the parts folder, which may be
in an object store. Each shard tokenizes and plans the set's rows on its own machine; the shares
are the placement of that plan (run/ranges.place_shares), so they are the same on every machine
only when every machine tokenized the same tokens — the recorded token digest says so, and a merge
of shards that planned from other tokens is refused, naming them, before any row is written twice
or not at all.

`unfinished_shards` says, per shard index, why the set cannot be assembled yet; the shard that
completes the set and `batchscore merge` both ask it.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections import Counter
from pathlib import Path

from batchscore.io.atomic import atomic_write
from batchscore.io.storage import as_path, file_size, remove_file
from batchscore.output.parts import Manifest, PartStore

COMPLETION_SUFFIX = ".complete.json"


def completion_path(store: PartStore, writer: str):
    """Where `writer` (a shard's name) records its finished share: in the parts folder."""
    return store.folder / f"{writer}{COMPLETION_SUFFIX}"


def write_completion(store: PartStore, manifest: Manifest, index: int, count: int, tokens_digest: str,
                     share_tokens: tuple[int, int] = (0, 0)) -> dict:
    """Record `store`'s writer (shard `index` of `count`) as finished: its share of `manifest` is
    scored; `share_tokens`: its share's (logical, processed) tokens, which the merge adds up."""
    files = [{"file": p.file, "size": p.size, "sha256": p.sha256} for p in manifest.parts]
    for extra in (manifest.input_errors_file, manifest.carried_file):  # small: read back once for their digest
        if extra:
            files.append({"file": extra, "size": file_size(store.folder / extra), "sha256": _sha256(store.folder / extra)})
    record = {"shard": index, "count": count, "rows": sum(manifest.worker_rows.values()),
              "input_rows": manifest.num_rows, "job_hash": manifest.job_hash, "tokens": tokens_digest,
              "logical_tokens": int(share_tokens[0]), "processed_tokens": int(share_tokens[1]),
              "files": files, "host": socket.gethostname(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    text = json.dumps(record, indent=1)
    store.guard()  # written only while this shard still holds its lock (a lease can be lost)
    atomic_write(completion_path(store, store.name), lambda tmp: Path(tmp).write_text(text))
    return record


def forget_completion(store: PartStore) -> None:
    """A shard (re)starting its share: until it finishes again, its old record does not count."""
    remove_file(completion_path(store, store.name))


def set_tokens(store: PartStore, names: list[str]) -> tuple[int, int]:
    """The (logical, processed) tokens of a finished set: its shards' recorded shares added up."""
    records = [read_completion(store, name) or {} for name in names]
    return (sum(int(r.get("logical_tokens", 0)) for r in records),
            sum(int(r.get("processed_tokens", 0)) for r in records))


def read_completion(store: PartStore, writer: str) -> dict | None:
    """`writer`'s completion record, or None when there is none (or it cannot be read)."""
    try:
        record = json.loads(completion_path(store, writer).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def unfinished_shards(store: PartStore, count: int, expected_hash: str, name_of,
                      every_file: bool = True) -> dict[int, str]:
    """The shards of `count` the set still waits for, by index, and why each one: never started,
    its rows so far, finished but unrecorded, parts of other content, a recorded file missing or
    changed since, or planned from other tokens than the rest of the set. `name_of(i)`: shard i's
    writer name. Empty: every share is recorded finished and the output can be assembled.
    `every_file` False (a shard that just finished): the recorded files are listed only once every
    record is in, so N shards finishing do not each list every part of the set."""
    unfinished: dict[int, str] = {}
    records: dict[int, dict] = {}
    for index in range(count):
        record = read_completion(store, name_of(index))
        if record is not None and record.get("job_hash") == expected_hash and record.get("count") == count:
            records[index] = record
        else:
            unfinished[index] = _why_unfinished(store.sibling_manifests([name_of(index)])[0], expected_hash)
    if every_file or not unfinished:
        for index, record in records.items():
            problem = _file_problem(store, record)
            if problem is not None:
                unfinished[index] = f"{problem} (rerun it: it scores those rows again)"
    tokens = Counter(r.get("tokens") for r in records.values()).most_common(1)
    for index, record in records.items():
        if record.get("tokens") != tokens[0][0] and index not in unfinished:
            unfinished[index] = (f"planned from other tokens than the rest of the set (on {record.get('host')}: "
                                 "another tokenizer?); rerun it with --fresh where the others ran")
    return dict(sorted(unfinished.items()))


def _why_unfinished(manifest: Manifest | None, expected_hash: str) -> str:
    if manifest is None:
        return "not started"
    if manifest.job_hash != expected_hash:
        return "holds parts of other content (rerun it with --fresh)"
    done = sum(manifest.rows_done(int(w)) for w in manifest.worker_rows)
    total = sum(manifest.worker_rows.values())
    if manifest.complete:  # stopped between its last part and its completion record
        return f"scored all {total:,} rows but recorded no completion (rerun it: it only records it)"
    return f"unfinished ({done:,} of {total:,} rows)"


def _file_problem(store: PartStore, record: dict) -> str | None:
    """A file the record names that is gone or of another size now (its size only: no read of the
    data; the assembly checks each part's row count as it reads it, the shard's resume its checksum)."""
    for entry in record.get("files", []):
        if not isinstance(entry, dict) or file_size(store.folder / str(entry.get("file"))) != entry.get("size"):
            name = entry.get("file") if isinstance(entry, dict) else entry
            return f"its recorded file {name} is missing or changed"
    return None


def _sha256(path) -> str:
    with as_path(path).open("rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()
