"""Inputs through pyarrow.dataset: column projection, hive partitions, input.filter, schemas
unified across files — and the readers' guarantees kept (row errors, no row dropped, the file
and row named)."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import InputError
from batchscore.formats import discover_files, iter_batches
from batchscore.io.readers import input_base
from batchscore.jobfile import config_from_dict
from tests.conftest import write_job

WIDE_ROWS = 4000


@pytest.fixture
def wide_parquet(tmp_path):
    """200 text columns, ~12 MB: a wide table of which a job needs four."""
    columns = {f"c{i:03d}": [f"value {i} of row {r} " * 3 for r in range(WIDE_ROWS)] for i in range(200)}
    path = tmp_path / "wide.parquet"
    pq.write_table(pa.table(columns), path, row_group_size=1000, compression="none")
    return path


def _bytes_read() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


def test_a_job_asks_the_reader_for_its_columns_only(wide_parquet, monkeypatch, tokenizer):
    import batchscore.prepare.read as prepare

    asked = []

    def spy(files, batch_rows, columns=None, base=None, json_columns=(), only=None):
        asked.append(columns)
        return iter_batches(files, batch_rows, columns=columns, base=base, json_columns=json_columns, only=only)

    monkeypatch.setattr(prepare, "iter_batches", spy)
    config = config_from_dict({"input": {"path": str(wide_parquet), "id_column": "c000"},
                               "prompt": {"template": "{c007} / {c123}"}, "labels": ["Yes", "No"],
                               "output": {"keep_columns": ["c199"]}})
    prepared = prepare.prepare_input(config, discover_files(str(wide_parquet)),
                                     prepare.make_renderer(config, tokenizer), max_length=10_000)
    assert asked == [["c000", "c199", "c007", "c123"]]
    assert prepared.num_rows == WIDE_ROWS and len(prepared.requests) == WIDE_ROWS
    assert prepared.kept.column_names == ["c199"]
    # merge reads only the id and kept columns
    prepare.prepare_input(config, discover_files(str(wide_parquet)), tokenize=False)
    assert asked[-1] == ["c000", "c199"]


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="bytes read are counted by Linux's /proc/self/io")
def test_projection_reads_a_fraction_of_the_bytes(wide_parquet):
    size = wide_parquet.stat().st_size
    files = discover_files(str(wide_parquet))
    before = _bytes_read()
    rows = sum(b.table.num_rows for b in iter_batches(files, 1024, columns=["c000", "c007", "c123", "c199"]))
    projected = _bytes_read() - before
    before = _bytes_read()
    sum(b.table.num_rows for b in iter_batches(files, 1024))
    everything = _bytes_read() - before
    assert rows == WIDE_ROWS
    assert everything > 0.9 * size
    assert projected < 0.05 * size, (projected, size)  # 4 of 200 columns, plus the footer


def _partitioned(root):
    """date=2026-11-24 and date=2026-11-25 as Parquet (different schemas), date=2026-11-26 as JSONL."""
    (root / "date=2026-11-24").mkdir(parents=True)
    (root / "date=2026-11-25").mkdir()
    (root / "date=2026-11-26").mkdir()
    pq.write_table(pa.table({"id": ["a", "b"], "query": ["shoes", "boots"], "n": pa.array([1, 2], pa.int32()),
                             "score": [1, 2]}), root / "date=2026-11-24" / "part-0.parquet")
    pq.write_table(pa.table({"id": ["c", "d", "e"], "query": ["socks", None, "hats"],
                             "n": pa.array([3, 4, 5], pa.int64()), "score": ["high", "low", "mid"],
                             "region": ["eu", "us", "eu"]}), root / "date=2026-11-25" / "part-0.parquet")
    (root / "date=2026-11-26" / "part-0.jsonl").write_text(
        json.dumps({"id": "f", "query": "gloves"}) + "\nnot json\n" + json.dumps({"id": "h", "query": "caps"}) + "\n")
    return root


def test_hive_partitions_become_columns_and_schemas_are_unified(tmp_path):
    root = _partitioned(tmp_path / "data")
    files = discover_files(str(root))
    batches = list(iter_batches(files, 100, base=input_base(str(root))))
    parquet = [b for b in batches if b.file.suffix == ".parquet"]
    assert len({b.table.schema for b in parquet}) == 1  # one schema for every Parquet file
    first, second = (b.table.to_pydict() for b in parquet)
    assert first["date"] == ["2026-11-24"] * 2 and second["date"] == ["2026-11-25"] * 3
    assert first["region"] == [None, None]  # a column missing from one file is null there
    assert parquet[0].table.schema.field("n").type == pa.int64()  # int32 + int64 promoted
    assert first["score"] == ["1", "2"] and second["score"] == ["high", "low", "mid"]  # int vs text: text
    jsonl = batches[-1]
    assert jsonl.table.column("date").to_pylist() == ["2026-11-26"] * 3
    assert jsonl.row_errors[1].endswith("part-0.jsonl:2: not valid JSON (Expecting value at column 1)")
    # projection applies to partition columns too
    (only,) = {tuple(b.table.column_names) for b in iter_batches(files, 100, columns=["id", "date"],
                                                                  base=input_base(str(root)))}
    assert only == ("id", "date")


def test_filter_selects_partitions_and_names_what_is_wrong(tmp_path):
    root = _partitioned(tmp_path / "data")
    chosen = discover_files(str(root), filter={"date": ["2026-11-25", "2026-11-26"]})
    assert [f.parent.name for f, _ in chosen] == ["date=2026-11-25", "date=2026-11-26"]
    assert [f.parent.name for f, _ in discover_files(str(root / "date=*" / "*"), filter={"date": "2026-11-24"})] \
        == ["date=2026-11-24"]
    with pytest.raises(InputError, match=r"\['day'\] are not partition columns.*\['date'\]"):
        discover_files(str(root), filter={"day": "x"})
    with pytest.raises(InputError, match="no file of .* is in those partitions"):
        discover_files(str(root), filter={"date": "1999-01-01"})


def test_a_yaml_date_in_the_filter_is_text():
    config = config_from_dict({"input": {"path": "d", "filter": {"date": __import__("datetime").date(2026, 11, 25)}},
                               "prompt": {"template": "{q}"}, "labels": ["Yes", "No"]})
    assert config.input.filter == {"date": "2026-11-25"}


def test_a_job_on_filtered_partitions_keeps_every_row_in_order(tmp_path):
    root = _partitioned(tmp_path / "data")
    job = write_job(tmp_path, f"file://{root}",
                    input={"path": f"file://{root}", "id_column": "id",
                           "filter": {"date": ["2026-11-25", "2026-11-26"]}},
                    prompt={"template": "Query: {query} ({date})\nRelevant? Answer Yes or No.", "system": None},
                    output={"path": str(tmp_path / "out.parquet"), "keep_columns": ["date", "region"],
                            "max_error_rate": 0.5})
    result = CliRunner().invoke(main, ["run", str(job), "-q"])
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["id"] for r in out] == ["c", "d", "e", "f", None, "h"]
    assert [r["date"] for r in out] == ["2026-11-25"] * 3 + ["2026-11-26"] * 3
    assert [r["region"] for r in out] == ["eu", "us", "eu", None, None, None]
    assert [r["status"] for r in out] == ["ok", "error", "ok", "ok", "error", "ok"]
    assert "date=2026-11-25/part-0.parquet:2: field 'query' is null or missing" in out[1]["error"]
    assert "part-0.jsonl:2: not valid JSON" in out[4]["error"]


def test_a_damaged_file_or_a_column_no_file_has_is_an_input_error(tmp_path, tokenizer):
    from batchscore.prepare.read import make_renderer, prepare_input

    root = _partitioned(tmp_path / "data")
    config = config_from_dict({"input": {"path": str(root)}, "prompt": {"template": "{qeury}"}, "labels": ["Yes", "No"]})
    with pytest.raises(InputError, match=r"column\(s\) \['qeury'\] not found.*'date'.*'query'.*'region'"):
        prepare_input(config, discover_files(str(root)), make_renderer(config, tokenizer))
    (root / "date=2026-11-24" / "part-0.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match=r"date=2026-11-24/part-0.parquet: not a readable Parquet file"):
        list(iter_batches(discover_files(str(root)), 100))
