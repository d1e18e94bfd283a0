"""A file a run writes inside a folder input is refused when the next run would read it as input:
its suffix is one the registered wire formats read (the caller passes them; output/ never asks
formats/ itself)."""

import pytest

from batchscore.errors import EXIT_CONFIG, WritePathError
from batchscore.formats import suffix_formats
from batchscore.output.write_paths import Protected
from tests.test_hardening import invoke, openai_requests, token_rows, write_job


def test_a_path_with_a_read_suffix_inside_the_input_folder_is_refused(tmp_path):
    protected = Protected(input_path=str(tmp_path), read_suffixes=tuple(suffix_formats()))
    with pytest.raises(WritePathError, match="inside the input folder"):
        protected.check("--metrics", tmp_path / "m.ndjson")
    protected.check("--metrics", tmp_path / "m.txt")  # no format reads .txt: allowed
    Protected(input_path=str(tmp_path)).check("--metrics", tmp_path / "m.ndjson")  # no suffixes given: none read


def test_run_metrics_inside_a_folder_input_is_refused_before_any_work(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    token_rows(folder, name="a.jsonl")
    out = tmp_path / "out.parquet"
    job = write_job(tmp_path, input={"path": str(folder), "token_ids_column": "t", "id_column": "id"},
                    output={"path": str(out)})
    result = invoke("run", job, "-q", "--metrics", folder / "m.json")
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "is inside the input folder" in result.output
    assert not out.exists() and not (tmp_path / "_out.parquet.parts").exists()


def test_an_error_path_inside_a_folder_input_is_refused_before_any_work(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    openai_requests(folder)
    out = tmp_path / "out.jsonl"
    job = write_job(tmp_path, input={"path": str(folder), "format": "openai_batch"},
                    output={"path": str(out), "error_path": str(folder / "errors.jsonl")})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "output.error_path" in result.output and "is inside the input folder" in result.output
    assert not out.exists()
