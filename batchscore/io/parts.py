"""Durable, resumable results: part files plus a manifest in a staging folder beside the output.

Layout, for `output.path = out/scores.parquet`:

    out/scores.parquet.parts/
        run.manifest.json            # job identity + which groups each part covers
        run-part-000000.parquet      # row_id, label log-probs, label_mass, error of whole groups
        shard-1-of-3.manifest.json   # a static shard writes its own manifest and parts
        ...

Every file is written under a temporary name and renamed when complete, and a manifest is
rewritten (atomically) after each part, so a run killed at any moment leaves a consistent
folder. The placement gives every worker a list of groups in plan order; a part covers a
contiguous run of one worker's list, so resuming skips the groups its parts cover and the
resume state is O(parts), never O(rows).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.errors import ResumeMismatch
from batchscore.io.atomic import atomic_write

log = logging.getLogger("batchscore")

MANIFEST_VERSION = 2  # 2: rows that could not be read or tokenized are kept in an input-errors file


@dataclass
class PartRecord:
    file: str
    group_start: int  # first group covered, as a position in its worker's list (inclusive)
    group_end: int  # exclusive
    rows: int
    worker: int = 0


@dataclass
class Manifest:
    job_hash: str  # config + input fingerprint + model + engine
    input_fingerprint: list[dict]
    model: str
    engine: str
    num_groups: int
    num_rows: int
    worker_groups: dict[str, int] = field(default_factory=dict)  # worker -> groups it must score
    parts: list[PartRecord] = field(default_factory=list)
    input_errors_file: str | None = None  # rows refused before scoring (row_id, error)
    version: int = MANIFEST_VERSION

    def groups_done(self, worker: int = 0) -> int:
        """Groups of `worker`'s list covered by parts (a worker's parts are written in order)."""
        return max((p.group_end for p in self.parts if p.worker == worker), default=0)

    @property
    def complete(self) -> bool:
        return all(self.groups_done(int(w)) >= n for w, n in self.worker_groups.items())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        data["parts"] = [PartRecord(**p) for p in data.get("parts", [])]
        return cls(**data)


def input_fingerprint(files: list[Path]) -> list[dict]:
    """Identity of the input files: path, size and modification time (cheap, no reading)."""
    result = []
    for path in files:
        stat = Path(path).stat()
        result.append({"file": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return result


def job_hash(config_dict: dict, fingerprint: list[dict], model: str, engine: str) -> str:
    """A stable hash of everything that decides the scores and the plan."""
    payload = json.dumps({"config": config_dict, "input": fingerprint, "model": model, "engine": engine},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def staging_dir(output_path: str | os.PathLike) -> Path:
    output_path = Path(output_path)
    return output_path.with_name(output_path.name + ".parts")


class PartStore:
    """Reads and writes one writer's manifest and parts in the staging folder of an output.

    `name` tells writers apart: "run" for a whole run (one process, or a Ray driver), or
    "shard-I-of-N" for a static shard; each writer owns its own manifest file.
    """

    def __init__(self, output_path: str | os.PathLike, name: str = "run"):
        self.output_path = Path(output_path)
        self.name = name
        self.folder = staging_dir(output_path)
        self.manifest_path = self.folder / f"{name}.manifest.json"

    def load_manifest(self) -> Manifest | None:
        """The existing manifest, or None when there is nothing to resume."""
        if not self.manifest_path.exists():
            return None
        try:
            manifest = Manifest.from_json(self.manifest_path.read_text())
        except (ValueError, TypeError, KeyError):
            return None  # unreadable manifest: start over rather than trust it
        if manifest.version != MANIFEST_VERSION:
            log.warning("%s is from another batchscore version; starting over", self.manifest_path)
            return None
        return manifest

    def start(self, manifest: Manifest, fresh: bool, input_errors: dict[int, str] | None = None) -> Manifest:
        """Open the staging folder for `manifest`'s job; returns the manifest to continue.

        Side effects: with `fresh`, deletes an existing staging folder; otherwise keeps a
        matching one and raises ResumeMismatch for one that belongs to another job. A new
        manifest records `input_errors` (rows refused before scoring) in a file of its own, so
        assembling the output (`batchscore merge` too) never needs to tokenize the input again.
        """
        existing = None if fresh else self.load_manifest()
        if fresh:
            self._remove_own_files()
        if existing is not None:
            if existing.job_hash != manifest.job_hash:
                raise ResumeMismatch(
                    f"{self.folder} holds a partial run of a different job configuration or input "
                    f"(manifest {existing.job_hash}, this job {manifest.job_hash}); rerun with --fresh "
                    "to discard it and start over"
                )
            self._remove_strays(existing)
            return existing
        self._remove_own_files()  # leftovers without a readable manifest
        self.folder.mkdir(parents=True, exist_ok=True)
        errors = input_errors or {}
        manifest.input_errors_file = f"{self.name}-input-errors.parquet"
        table = pa.table({"row_id": pa.array(list(errors), type=pa.int64()),
                          "error": pa.array(list(errors.values()), type=pa.string())})
        atomic_write(self.folder / manifest.input_errors_file, lambda tmp: pq.write_table(table, tmp))
        self.write_manifest(manifest)
        return manifest

    def write_part(self, manifest: Manifest, row_ids: np.ndarray, log_probs: np.ndarray,
                   label_mass: np.ndarray, errors: dict[int, str], group_start: int, group_end: int,
                   worker: int = 0) -> None:
        """Write one part (atomically), then record it in the manifest (atomically).

        row_ids: [R]; log_probs: [R, L]; label_mass: [R]; errors: row_id -> engine error message.
        """
        name = f"{self.name}-part-{len(manifest.parts):06d}.parquet"
        table = pa.table({
            "row_id": pa.array(row_ids, type=pa.int64()),
            "log_probs": pa.FixedSizeListArray.from_arrays(
                pa.array(np.asarray(log_probs, dtype=np.float64).reshape(-1)), log_probs.shape[1]),
            "label_mass": pa.array(label_mass, type=pa.float64()),
            "error": pa.array([errors.get(int(r)) for r in row_ids], type=pa.string()),
        })
        atomic_write(self.folder / name, lambda tmp: pq.write_table(table, tmp))
        manifest.parts.append(PartRecord(name, group_start, group_end, len(row_ids), worker))
        self.write_manifest(manifest)

    def write_manifest(self, manifest: Manifest) -> None:
        atomic_write(self.manifest_path, lambda tmp: Path(tmp).write_text(manifest.to_json()))

    def read_results(self, manifests: list[Manifest], num_rows: int,
                     num_labels: int) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
        """Gather every part, reading each once: ([num_rows, L] log-probs, [num_rows] mass, NaN
        where unscored) and the rows that were not scored (refused before scoring, or by the
        engine), with the reason."""
        log_probs = np.full((num_rows, num_labels), np.nan)
        mass = np.full(num_rows, np.nan)
        errors: dict[int, str] = {}
        for name in {m.input_errors_file for m in manifests if m.input_errors_file}:
            table = pq.read_table(self.folder / name)
            errors.update(zip(table.column("row_id").to_pylist(), table.column("error").to_pylist()))
        for part in (p for m in manifests for p in m.parts):
            table = pq.read_table(self.folder / part.file)
            rows = table.column("row_id").to_numpy()
            log_probs[rows] = np.asarray(table.column("log_probs").combine_chunks().flatten()).reshape(-1, num_labels)
            mass[rows] = table.column("label_mass").to_numpy()
            for row_id, message in zip(rows.tolist(), table.column("error").to_pylist()):
                if message is not None:
                    errors[row_id] = message
        return log_probs, mass, errors

    def sibling_manifests(self, names: list[str]) -> list[Manifest | None]:
        """The manifests of the writers `names` in the same folder (None where missing)."""
        return [PartStore(self.output_path, name).load_manifest() for name in names]

    def finish(self) -> None:
        """Remove the staging folder once the final output is in place."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def _own_files(self):
        if not self.folder.exists():
            return []
        return [p for p in self.folder.iterdir()
                if p.name.startswith(f"{self.name}-part-") or p.name.startswith(f".{self.name}")
                or p.name == f"{self.name}-input-errors.parquet"
                or p.name == self.manifest_path.name]

    def _remove_own_files(self) -> None:
        for path in self._own_files():
            path.unlink(missing_ok=True)

    def _remove_strays(self, manifest: Manifest) -> None:
        # Temporary files and parts written after the last manifest update are not trusted.
        known = {p.file for p in manifest.parts} | {self.manifest_path.name, manifest.input_errors_file}
        for path in self._own_files():
            if path.name not in known:
                path.unlink()

