"""Input discovery and reading: Parquet, JSONL, folders, globs; bad lines become row errors."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore.errors import InputError
from batchscore.formats import discover_files, iter_batches


def test_folder_and_glob(tmp_path):
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "x.parquet")
    (tmp_path / "y.jsonl").write_text('{"a": 3}\n{"a": 4}\n')
    files = discover_files(str(tmp_path))
    assert [f.name for f, _ in files] == ["x.parquet", "y.jsonl"]
    assert [fmt for _, fmt in discover_files(str(tmp_path / "*.jsonl"))] == ["jsonl"]
    rows = [r for b in iter_batches(files, 1) for r in b.table.column("a").to_pylist()]
    assert rows == [1, 2, 3, 4]


def test_missing_file_and_empty_glob(tmp_path):
    with pytest.raises(InputError, match="file not found"):
        discover_files(str(tmp_path / "missing.parquet"))
    with pytest.raises(InputError, match="no files match"):
        discover_files(str(tmp_path / "*.parquet"))


def test_bad_jsonl_lines_become_row_errors(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"q": "ok"}\nnot json\n[1, 2]\n\xff\xfe\n{"q": "fine"}\n')
    (batch,) = list(iter_batches([(path, "jsonl")], 100))
    assert batch.table.num_rows == 5
    errors = batch.row_errors
    assert errors[0] is None and errors[4] is None
    assert "in.jsonl:2: not valid JSON" in errors[1]
    assert "expected a JSON object" in errors[2]
    assert "invalid UTF-8" in errors[3]


def test_mixed_types_in_a_jsonl_column_are_kept_as_text(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"q": 1}, {"q": "two"}]))
    (batch,) = list(iter_batches([(path, "jsonl")], 100))
    assert batch.table.column("q").to_pylist() == ["1", "two"]


def test_a_key_twice_in_a_line_read_as_json_is_that_lines_error(tmp_path):
    """Where a column is kept as its line's own JSON (per-row questions), a key written twice in
    one object would silently keep the last definition: the line is refused naming the key. Plain
    table lines read as they always were."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 1, "qs": {"team": {"type": "noul"}}}\n'
                    '{"id": 2, "qs": {"team": {"type": "noul"}, "team": {"type": "choice"}}}\n')
    (batch,) = list(iter_batches([(path, "jsonl")], 100, json_columns=("qs",)))
    assert batch.row_errors[0] is None
    assert batch.row_errors[1] == (f"{path}:2: key 'team' appears twice in one JSON object; a JSON reader keeps "
                                   "only the last, so the line is refused")
    assert batch.table.column("id").to_pylist() == [1, 2]  # the line keeps its place and id
    (plain,) = list(iter_batches([(path, "jsonl")], 100))
    assert plain.row_errors == [None, None]
