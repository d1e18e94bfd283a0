"""Durable, resumable results: part files plus a manifest in a staging folder beside the output.

Layout, for `output.path = out/scores.parquet` (the files beside the output are named in
output/layout.py):

    out/_scores.parquet.lock             # held for the whole run (output/lock.py)
    out/_scores.parquet.parts/
        run.manifest.json                # run identity + which rows each part covers
        run-input-errors.part            # row_id, error of rows refused before scoring
        run-part-001-000000.part         # attempt 1, part 0: row_id, raw option totals and tokens, error
        shard-1-of-3.manifest.json       # a static shard writes its own manifest and parts
        ...
    out/_scores.parquet.complete.json    # written after the output: a rerun is a no-op

Every file is written under a temporary name, fsynced and renamed when complete, and a manifest
is rewritten (atomically) after each part, so a run killed at any moment leaves a consistent
folder. The placement gives every worker a list of groups in plan order; a worker's members, in
that order, are its *positions*, and a part covers a contiguous run of them — whole groups or
any rows inside one — so a stop never waits for a group to end. Resuming skips the positions its
parts cover (the state is O(parts), never O(rows)); each part is checked against the size and
checksum recorded when it was written, and a damaged or missing part is scored again. Parts of
another format version are never mixed in: they are dropped (the log names them) and scored again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.errors import ResumeMismatch
from batchscore.faults import fault_point
from batchscore.io.atomic import atomic_write, refuse_link
from batchscore.io.storage import file_size, list_files, remove_file, remove_tree
from batchscore.output import partitioned
from batchscore.output.identity import describe_changes
from batchscore.output.layout import RUN_WRITER, OutputFiles
from batchscore.output.raw_scores import RowScores
from batchscore.row_errors import FAILED, INPUT, kind_of, typed

log = logging.getLogger("batchscore")

# 3: parts cover row positions, carry checksums; identity by content; 4: option totals;
# 5: raw totals only (no label_mass: scores/normalize.py derives it at assembly)
MANIFEST_VERSION = 5
# Parts are Parquet files named `.part`: a `**/*.parquet` glob over the output's folder (DuckDB's,
# which does not skip `_` folders) never reads a running job's parts as rows of the output.
PART_SUFFIX = ".part"


@dataclass
class PartRecord:
    file: str
    start: int  # first position covered in its worker's member order (inclusive)
    end: int  # exclusive
    worker: int = 0
    sha256: str = ""
    size: int = 0

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass
class Manifest:
    job_hash: str  # identity + number of workers
    identity: dict  # config, input, model, software, engine (output/identity.py)
    num_groups: int
    num_rows: int
    worker_rows: dict[str, int] = field(default_factory=dict)  # worker -> members it must score
    parts: list[PartRecord] = field(default_factory=list)
    input_errors_file: str | None = None  # rows refused before scoring (row_id, error)
    carried_file: str | None = None  # output.mode incremental: rows carried from the previous night, as a part
    attempt: int = 1  # incremented by each run that continues this manifest
    version: int = MANIFEST_VERSION

    def rows_done(self, worker: int = 0) -> int:
        """Positions of `worker`'s member order covered by parts (a worker's parts are contiguous)."""
        return max((p.end for p in self.parts if p.worker == worker), default=0)

    @property
    def complete(self) -> bool:
        return all(self.rows_done(int(w)) >= n for w, n in self.worker_rows.items())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        return cls(**{**data, "parts": [PartRecord(**p) for p in data.get("parts", [])]})


def write_completion_marker(files: OutputFiles, output_hash: str, summary: dict) -> None:
    """Record that the output is the complete output of the job `output_hash` identifies; the
    output is named by its content (sha256), so another file of the same size never passes."""
    size = output_size(files.path)
    text = json.dumps({"output_hash": output_hash, "output_size": size, "output_sha256": _output_digest(files.path),
                       "summary": summary}, indent=2)
    atomic_write(files.marker, lambda tmp: Path(tmp).write_text(text))


def completed_summary(files: OutputFiles, output_hash: str) -> dict | None:
    """The recorded summary when the output is already this job's complete output, else None."""
    marker = _read_marker(files)
    return marker["summary"] if marker is not None and marker.get("output_hash") == output_hash else None


def recorded_summary(files: OutputFiles) -> dict | None:
    """The summary recorded by the run that wrote the output (its completion marker), or None
    when there is no marker or the output changed since (`batchscore report` reads it)."""
    marker = _read_marker(files)
    return marker["summary"] if marker is not None else None


def marker_problem(files: OutputFiles) -> str:
    """Why `recorded_summary(files)` finds no summary, in words: no marker, an unreadable one, one
    written by an older batchscore (no content digest), or an output that changed since."""
    try:
        text = files.marker.read_text()
    except FileNotFoundError:
        return f"has no completion marker ({files.marker.name}): it is not the output of a finished run"
    except OSError as exc:
        return f"has a completion marker that cannot be read ({files.marker.name}: {exc.strerror or exc})"
    try:
        marker = json.loads(text)
    except ValueError:
        return f"has a completion marker that is not JSON ({files.marker.name})"
    if not isinstance(marker, dict) or not isinstance(marker.get("summary"), dict):
        return f"has a completion marker without a run summary ({files.marker.name})"
    if "output_sha256" not in marker:
        return (f"has a completion marker written by an older batchscore ({files.marker.name} names its output by "
                "size only, not by content, so it cannot vouch for this file); rerun the job that wrote it with "
                "this version")
    return f"changed since its completion marker was written ({files.marker.name} names another file's content)"


def _read_marker(files: OutputFiles) -> dict | None:
    try:
        marker = json.loads(files.marker.read_text())
        if (output_size(files.path) == marker["output_size"] and isinstance(marker["summary"], dict)
                and _output_digest(files.path) == marker["output_sha256"]):  # the size first: it costs no read
            return marker
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def output_size(path) -> int | None:
    """The output's bytes: its file's, or a partitioned output's files' (output/partitioned.py)."""
    return partitioned.output_size(path) if partitioned.is_partitioned(path) else file_size(path)


def _output_digest(path) -> str:
    """The output's content digest: its file's sha256, or over a partitioned output's files."""
    return partitioned.output_digest(path) if partitioned.is_partitioned(path) else _digest(path)


def _digest(path) -> str:
    """sha256 of a file (local or in an object store), read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _row_errors(table: pa.Table, default: str) -> list:
    """A part's (or the input-errors file's) `error` column as typed row errors (row_errors.py),
    with their recorded kinds (`default` for a parts folder written before the kinds were)."""
    messages = table.column("error").to_pylist()
    kinds = table.column("error_kind").to_pylist() if "error_kind" in table.column_names else [None] * len(messages)
    return [typed(message, kind, default) for message, kind in zip(messages, kinds)]


def _read_parquet(path):
    with path.open("rb") as handle:  # a local file or an object (io/storage.py)
        return pq.read_table(handle)


class PartStore:
    """Reads and writes one writer's manifest and parts in the staging folder of an output.

    `name` tells writers apart: "run" for a whole run (one process, or a Ray driver), or
    "shard-I-of-N" for a static shard; each writer owns its own manifest file.
    """

    def __init__(self, files: OutputFiles, name: str = RUN_WRITER, guard: Callable[[], None] | None = None):
        self.files = files
        self.name = name
        self.guard = guard or (lambda: None)  # raises when this writer may no longer write (a lost lease)
        self.folder = files.parts
        self.manifest_path = self.folder / f"{name}.manifest.json"

    def load_manifest(self) -> Manifest | None:
        """The existing manifest, or None when there is nothing to resume."""
        return self._read_manifest()[0]

    def _read_manifest(self) -> tuple[Manifest | None, str | None]:
        """(the manifest, None); (None, why it cannot be continued); (None, None) when there is none."""
        try:
            data = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return None, None
        except ValueError:
            return None, "its manifest is unreadable"  # start over rather than trust it
        version = data.get("version", MANIFEST_VERSION) if isinstance(data, dict) else None
        if version != MANIFEST_VERSION:  # never mixed: its parts may hold other values
            return None, f"its parts are format version {version}, this batchscore writes version {MANIFEST_VERSION}"
        try:
            return Manifest.from_dict(data), None
        except (TypeError, KeyError, AttributeError):
            return None, "its manifest is unreadable"

    def start(self, manifest: Manifest, fresh: bool, input_errors: dict[int, str] | None = None,
              carried: pa.Table | None = None) -> Manifest:
        """Open the staging folder for `manifest`'s job; returns the manifest to continue.

        Side effects: with `fresh`, deletes this writer's files first; otherwise keeps a matching
        manifest (parts checked: a damaged or missing one and the worker's later parts are dropped,
        to be scored again) and raises ResumeMismatch, naming what changed, for one that belongs
        to another job. The files of a manifest that cannot be continued (unreadable, or of
        another parts format version) are deleted, the log naming them. A new manifest records
        `input_errors` (rows refused before scoring) in a file of its own, so assembling the
        output never needs to tokenize the input again, and `carried` (an incremental run's rows
        carried from the previous night, a part's columns) in another.
        The caller holds the output's lock.
        """
        refuse_link(self.folder, "the parts folder")  # its parts would be written into the linked folder
        existing, stale = (None, None) if fresh else self._read_manifest()
        if fresh:
            self._remove_own_files()
        if existing is not None and existing.job_hash != manifest.job_hash:
            changed = "; ".join(describe_changes(existing.identity, manifest.identity))
            raise ResumeMismatch(
                f"{self.folder} holds a partial run of this output made with a different job: changed "
                f"since: {changed}. Rerun with --fresh to discard it and start over")
        if existing is not None and self._input_errors_readable(existing):
            self._drop_damaged_parts(existing)
            self._remove_strays(existing)
            existing.attempt += 1
            self.write_manifest(existing)
            return existing
        self._remove_own_files(stale)  # leftovers without a usable manifest
        errors = input_errors or {}
        manifest.input_errors_file = f"{self.name}-input-errors{PART_SUFFIX}"
        table = pa.table({"row_id": pa.array(list(errors), type=pa.int64()),
                          "error": pa.array(list(errors.values()), type=pa.string()),
                          "error_kind": pa.array([kind_of(e) for e in errors.values()], type=pa.string())})
        atomic_write(self.folder / manifest.input_errors_file, lambda tmp: pq.write_table(table, tmp))
        if carried is not None and carried.num_rows:
            manifest.carried_file = f"{self.name}-carried{PART_SUFFIX}"
            atomic_write(self.folder / manifest.carried_file, lambda tmp: pq.write_table(carried, tmp))
        self.write_manifest(manifest)
        return manifest

    def write_part(self, manifest: Manifest, row_ids: np.ndarray, logp: list[np.ndarray],
                   option_tokens: list[np.ndarray | None], errors: dict[int, str],
                   start: int, end: int, worker: int = 0, top_logp: list[float] | None = None,
                   top_token: list[int] | None = None, greedy: list[np.ndarray | None] | None = None) -> None:
        """Write one part (atomically), then record it in the manifest (atomically).

        row_ids: [R]; logp: R arrays of each option's raw total log-probability, as the engine
        returned it (NaN: not scored); option_tokens: R arrays of tokens per option (None: one
        token each); errors: row_id -> engine error message; top_logp: R of the vocabulary's largest
        log-probability at each row's read position (NaN: not read); top_token: R of that token's id
        (-1: not read); greedy: R of whether each option is the greedy continuation (None: not read);
        [start, end): the positions of the worker's member order the part covers (R = end - start).
        """
        self.guard()
        name = f"{self.name}-part-{manifest.attempt:03d}-{len(manifest.parts):06d}{PART_SUFFIX}"
        table = pa.table({
            "row_id": pa.array(row_ids, type=pa.int64()),
            "logp": pa.array([np.asarray(v, dtype=np.float64) for v in logp], type=pa.list_(pa.float64())),
            "option_tokens": pa.array([None if t is None else np.asarray(t, dtype=np.int32) for t in option_tokens],
                                      type=pa.list_(pa.int32())),
            "error": pa.array([errors.get(int(r)) for r in row_ids], type=pa.string()),
            "error_kind": pa.array([kind_of(errors.get(int(r)), FAILED) for r in row_ids], type=pa.string()),
            "top_logp": pa.array(np.full(len(row_ids), np.nan) if top_logp is None else np.asarray(top_logp, np.float64),
                                 type=pa.float64()),
            "top_token": pa.array(np.full(len(row_ids), -1) if top_token is None else np.asarray(top_token, np.int64),
                                  type=pa.int64()),
            "greedy": pa.array([None] * len(row_ids) if greedy is None else
                               [None if g is None else np.asarray(g, dtype=bool) for g in greedy],
                               type=pa.list_(pa.bool_())),
        })
        written = {}

        def write(tmp: str) -> None:  # checksum the finished file before it moves (no read-back from a store)
            pq.write_table(table, tmp)
            written.update(sha256=_digest(Path(tmp)), size=Path(tmp).stat().st_size)

        atomic_write(self.folder / name, write)
        fault_point("part")
        manifest.parts.append(PartRecord(name, start, end, worker, written["sha256"], written["size"]))
        self.write_manifest(manifest)

    def write_manifest(self, manifest: Manifest) -> None:
        self.guard()
        atomic_write(self.manifest_path, lambda tmp: Path(tmp).write_text(manifest.to_json()))

    def read_results(self, manifests: list[Manifest], num_rows: int, only: np.ndarray | None = None
                     ) -> tuple[RowScores, dict[int, str]]:
        """Gather every part, reading each once: every row's raw option totals and tokens (in row
        order; null lists where no part holds the row) and the rows that were not scored (refused
        before scoring, or by the engine), with the reason. Raises RuntimeError when any row has
        two results (parts that overlap, or a part that scored a row refused before scoring):
        exactly once, or not at all.

        `only` (sorted distinct row ids): keep just those rows, as the audit does with its sample:
        the scores are then in the order of `only` (index i is row only[i]), errors stay keyed by
        row id, and what is held is the sample's, not every row's (a part is read at a time)."""
        row_chunks, logp_chunks, token_chunks, top_chunks, top_id_chunks, greedy_chunks = [], [], [], [], [], []
        errors: dict[int, str] = {}
        kept = None if only is None else np.asarray(only, dtype=np.int64)
        seen = np.zeros(num_rows if kept is None else len(kept), dtype=np.int64)

        def counted(rows: np.ndarray) -> np.ndarray:
            """Count `rows`; with `only`, return the mask of the kept ones (and count those)."""
            if kept is None:
                np.add.at(seen, rows, 1)
                return None
            at = np.minimum(np.searchsorted(kept, rows), max(len(kept) - 1, 0))
            mask = kept[at] == rows if len(kept) else np.zeros(len(rows), dtype=bool)
            np.add.at(seen, at[mask], 1)
            return mask

        for name in {m.input_errors_file for m in manifests if m.input_errors_file}:
            table = _read_parquet(self.folder / name)
            rows = table.column("row_id").to_numpy()
            mask = counted(rows)
            if mask is not None:
                table, rows = table.filter(pa.array(mask)), rows[mask]
            errors.update(zip(rows.tolist(), _row_errors(table, INPUT)))
        carried = [(m.carried_file, None) for m in manifests if m.carried_file]
        for file, expected in carried + [(p.file, p.rows) for m in manifests for p in m.parts]:
            table = _read_parquet(self.folder / file)
            rows = table.column("row_id").to_numpy()
            if expected is not None and len(rows) != expected:
                raise RuntimeError(f"{file} holds {len(rows)} rows, its manifest says {expected}")
            mask = counted(rows)
            ids = rows
            if mask is not None:
                table, ids = table.filter(pa.array(mask)), rows[mask]
                rows = np.searchsorted(kept, ids)  # the place in `only` stands for the row in the scores
            row_chunks.append(rows)
            logp_chunks.append(table.column("logp").combine_chunks())
            token_chunks.append(table.column("option_tokens").combine_chunks())
            top_chunks.append(table.column("top_logp").combine_chunks())
            top_id_chunks.append(table.column("top_token").combine_chunks() if "top_token" in table.column_names
                                 else pa.array(np.full(len(rows), -1), type=pa.int64()))  # parts from before the column
            greedy_chunks.append(table.column("greedy").combine_chunks() if "greedy" in table.column_names
                                 else pa.nulls(len(rows), pa.list_(pa.bool_())))
            for row_id, message in zip(ids.tolist(), _row_errors(table, FAILED)):
                if message is not None:
                    errors[row_id] = message
        twice = np.flatnonzero(seen > 1)
        if twice.size:
            twice = twice if kept is None else kept[twice]
            raise RuntimeError(f"rows {twice[:5].tolist()} have more than one result in {self.folder}; "
                               "refusing to write an output that could mix them (rerun with --fresh)")
        position = np.full(len(seen), -1, dtype=np.int64)  # row -> its place among the parts' rows
        if row_chunks:
            found = np.concatenate(row_chunks)
            position[found] = np.arange(len(found))
        take = pa.array(position, mask=position < 0)

        def in_row_order(chunks, value_type):
            values = pa.concat_arrays(chunks) if chunks else pa.array([], type=pa.list_(value_type))
            return values.take(take)

        tops = pa.concat_arrays(top_chunks) if top_chunks else pa.array([], type=pa.float64())
        top_ids = pa.concat_arrays(top_id_chunks) if top_id_chunks else pa.array([], type=pa.int64())
        scores = RowScores(in_row_order(logp_chunks, pa.float64()), in_row_order(token_chunks, pa.int32()),
                           tops.take(take), top_ids.take(take), in_row_order(greedy_chunks, pa.bool_()))
        return scores, errors

    def sibling_manifests(self, names: list[str]) -> list[Manifest | None]:
        """The manifests of the writers `names` in the same folder (None where missing)."""
        return [PartStore(self.files, name).load_manifest() for name in names]

    def finish(self) -> None:
        """Remove the staging folder once the final output is in place."""
        remove_tree(self.folder)

    def _own_files(self):
        return [p for p in list_files(self.folder)
                if p.name.startswith(f"{self.name}-part-") or p.name.startswith(f".{self.name}")
                or p.name in (f"{self.name}-input-errors{PART_SUFFIX}", f"{self.name}-carried{PART_SUFFIX}")
                or p.name == self.manifest_path.name]

    def _remove_own_files(self, reason: str | None = None) -> None:
        """Delete this writer's files; with `reason` (why they cannot be continued), log which."""
        paths = self._own_files()
        if reason and paths:
            log.warning("%s: %s; dropping %s — their rows will be scored again", self.folder, reason,
                        ", ".join(sorted(p.name for p in paths)))
        for path in paths:
            remove_file(path)

    def _input_errors_readable(self, manifest: Manifest) -> bool:
        try:
            _read_parquet(self.folder / manifest.input_errors_file)
            return True
        except (OSError, TypeError, pa.ArrowException):
            log.warning("%s: the input-errors file is damaged or missing; starting this output over", self.folder)
            return False

    def _drop_damaged_parts(self, manifest: Manifest) -> None:
        """Keep each worker's parts up to its first damaged or missing one (later ones would leave
        a gap: a worker's parts must be contiguous); the dropped positions are scored again."""
        kept, broken = [], set()
        for part in manifest.parts:
            path = self.folder / part.file
            ok = part.worker not in broken and file_size(path) == part.size and _digest(path) == part.sha256
            if ok:
                kept.append(part)
            else:
                if part.worker not in broken:
                    log.warning("%s: part %s is damaged or missing; rows %d.. of worker %d will be scored again",
                                self.folder, part.file, part.start, part.worker)
                broken.add(part.worker)
        manifest.parts = kept

    def _remove_strays(self, manifest: Manifest) -> None:
        # Temporary files and parts written after the last manifest update are not trusted.
        known = {p.file for p in manifest.parts} | {self.manifest_path.name, manifest.input_errors_file,
                                                     manifest.carried_file}
        for path in self._own_files():
            if path.name not in known:
                remove_file(path)

