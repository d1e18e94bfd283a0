"""How far a running job has got: its rows (or, for a decision job, its request lines: every
read of a line saved) done so far, read from the parts `batchscore run` saves as it scores (the
manifest, then each new part's `row_id` and `error` columns, read once). A row with an error there failed; every other row a part holds was scored. The parts are the
run's own record of what is done (a resume skips exactly those rows), so the counts a poll sees
are the rows that will be in the output, never an estimate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchscore.output.layout import OutputFiles
from batchscore.output.parts import PartStore


class JobProgress:
    """The rows of one job's output done so far: `(completed, failed)`."""

    def __init__(self, output: Path):
        self._store = PartStore(OutputFiles(str(output)))
        self._read: dict[str, tuple[int, int]] = {}  # part file -> (scored, failed): parts never change
        self.last = (0, 0)

    def counts(self) -> tuple[int, int]:
        """The rows scored and failed so far (the last counts seen while the parts cannot be
        read: not started yet, or removed as the run finished)."""
        manifest = self._store.load_manifest()
        if manifest is None:
            return self.last
        scored = failed = 0
        for name in [manifest.input_errors_file, *(part.file for part in manifest.parts)]:
            if name is None:
                continue
            if name not in self._read:
                try:
                    table = pq.read_table(self._store.folder / name, columns=["row_id", "error"])
                except (OSError, pa.ArrowException):
                    return self.last
                requests = pc.less(table.column("row_id"), manifest.num_rows)  # not calibration's extra rows
                errors = pc.and_(requests, table.column("error").is_valid())
                n, bad = pc.sum(requests).as_py() or 0, pc.sum(errors).as_py() or 0
                self._read[name] = (n - bad, bad)
            scored += self._read[name][0]
            failed += self._read[name][1]
        self.last = (scored, failed)
        return self.last


class RecordProgress:
    """The requests of one decision job done so far: `(completed, failed)`. Its parts hold reads
    (one per question), so a request line is done once every read of it is saved, and failed
    when any of them failed (its answer is then an error line, never a part of one); which reads
    make up which line is read from the job's own input, as the run reads it."""

    def __init__(self, output: Path, job_file: Path):
        self._store = PartStore(OutputFiles(str(output)))
        self._job_file = job_file
        self._lines: np.ndarray | None = None  # read -> the line (record) it answers
        self._sizes: np.ndarray | None = None  # reads per line
        self._seen: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # part file -> (reads saved, reads failed)
        self.last = (0, 0)

    def _load(self) -> None:
        from batchscore.formats import discover_files
        from batchscore.jobfile import load_job
        from batchscore.task import task_for

        config = load_job(self._job_file)
        files = discover_files(config.input.path, config.input.format)
        self._sizes = task_for(config, files).record_reads(config, files)
        self._lines = np.repeat(np.arange(len(self._sizes)), self._sizes)

    def counts(self) -> tuple[int, int]:
        manifest = self._store.load_manifest()
        if manifest is None:
            return self.last
        if self._lines is None:
            self._load()
        for name in [manifest.input_errors_file, *(part.file for part in manifest.parts)]:
            if name is None or name in self._seen:
                continue
            try:
                table = pq.read_table(self._store.folder / name, columns=["row_id", "error"])
            except (OSError, pa.ArrowException):
                return self.last
            reads = table.column("row_id").to_numpy()
            failed = table.column("error").is_valid().to_numpy(zero_copy_only=False)
            keep = reads < len(self._lines)  # not calibration's extra rows
            self._seen[name] = (reads[keep], reads[keep & failed])
        saved = np.zeros(len(self._lines), dtype=np.int64)
        bad = np.zeros(len(self._lines), dtype=np.int64)
        for reads, failed in self._seen.values():
            saved[reads] = 1
            bad[failed] = 1
        per_line = np.bincount(self._lines, weights=saved, minlength=len(self._sizes))
        bad_per_line = np.bincount(self._lines, weights=bad, minlength=len(self._sizes))
        failed_lines = int((bad_per_line > 0).sum())
        self.last = (int(((per_line == self._sizes) & (bad_per_line == 0)).sum()), failed_lines)
        return self.last
