"""How far a running job has got: its rows done so far, read from the parts `batchscore run`
saves as it scores (the manifest, then each new part's `row_id` and `error` columns, read once).
A row with an error there failed; every other row a part holds was scored. The parts are the
run's own record of what is done (a resume skips exactly those rows), so the counts a poll sees
are the rows that will be in the output, never an estimate."""

from __future__ import annotations

from pathlib import Path

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
