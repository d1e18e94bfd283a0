"""A symbolic link planted at a path batchscore makes (the output's lock, its parts folder, its
completion marker, the metrics files, the error file, the report, the output itself) is never
written through: the lock and the parts folder refuse it by name (exit 6), and every file
written whole replaces the link itself (io/atomic.py renames over it), so whatever it points to
is left as it was. One test per path, then the run end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from batchscore.errors import EXIT_OUTPUT, OutputError
from batchscore.output.layout import OutputFiles
from tests.test_hardening import invoke, openai_requests, token_job, write_job

VICTIM = b"precious: not batchscore's to write\n"


def _plant(link: Path, target: Path) -> Path:
    target.write_bytes(VICTIM)
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)
    return target


def _replaced(link: Path, victim: Path) -> None:
    """The file was written at `link`'s path, the link gone, its target untouched."""
    assert not link.is_symlink() and link.is_file()
    assert victim.read_bytes() == VICTIM


def test_a_lock_link_is_refused(tmp_path):
    from batchscore.output.lock import FileLock

    files = OutputFiles(str(tmp_path / "out.parquet"))
    victim = _plant(Path(files.lock()), tmp_path / "victim.txt")
    with pytest.raises(OutputError, match="lock file .* is a symbolic link"):
        FileLock(Path(files.lock())).acquire()
    assert victim.read_bytes() == VICTIM
    os.unlink(files.lock())
    os.symlink(tmp_path / "missing", files.lock())  # a dangling link would be created through
    with pytest.raises(OutputError, match="symbolic link"):
        FileLock(Path(files.lock())).acquire()
    assert not (tmp_path / "missing").exists()


def test_a_parts_folder_link_is_refused(tmp_path):
    from batchscore.output.parts import Manifest, PartStore

    files = OutputFiles(str(tmp_path / "out.parquet"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, files.parts)
    manifest = Manifest(job_hash="h", identity={}, num_groups=1, num_rows=2, worker_rows={"0": 2})
    with pytest.raises(OutputError, match="parts folder .* is a symbolic link"):
        PartStore(files).start(manifest, fresh=False)
    assert list(elsewhere.iterdir()) == []


def test_a_marker_link_is_replaced_not_followed(tmp_path):
    from batchscore.output.parts import write_completion_marker

    files = OutputFiles(str(tmp_path / "out.parquet"))
    (tmp_path / "out.parquet").write_bytes(b"scores")  # the marker names the output's digest
    victim = _plant(Path(files.marker), tmp_path / "victim.txt")
    write_completion_marker(files, "hash", {"rows": 2})
    _replaced(Path(files.marker), victim)


@pytest.mark.parametrize("option", ["metrics", "metrics_prom"])
def test_a_metrics_link_is_replaced_not_followed(tmp_path, option):
    from batchscore.run.run_files import RunFiles

    path = tmp_path / "m.out"
    victim = _plant(path, tmp_path / "victim.txt")
    run_files = RunFiles(**{option: str(path)})
    run_files.checked = True  # as after checking against the job's paths
    run_files.write({"status": "ok", "exit_code": 0})
    _replaced(path, victim)


def test_an_error_file_and_output_links_are_replaced_not_followed(tmp_path):
    from batchscore.formats.lines import write_lines

    for name in ("out.jsonl", "out.errors.jsonl"):
        victim = _plant(tmp_path / name, tmp_path / f"victim-{name}")
        write_lines(tmp_path / name, ['{"custom_id": "a"}'])
        _replaced(tmp_path / name, victim)


def test_a_parquet_output_link_is_replaced_not_followed(tmp_path):
    import pyarrow as pa

    from batchscore.output.table import write_parquet_atomic

    victim = _plant(tmp_path / "out.parquet", tmp_path / "victim.parquet")
    write_parquet_atomic(pa.table({"a": [1]}), tmp_path / "out.parquet")
    _replaced(tmp_path / "out.parquet", victim)


def test_a_report_link_is_replaced_not_followed(tmp_path):
    from batchscore.report.html import write_html

    victim = _plant(tmp_path / "_out.parquet.report.html", tmp_path / "victim.html")
    write_html("<!DOCTYPE html><p>report</p>", tmp_path / "_out.parquet.report.html")
    _replaced(tmp_path / "_out.parquet.report.html", victim)


def test_a_run_refuses_a_lock_link_to_its_own_input(tmp_path):
    """The attack as found: `ln -s in.jsonl _out.parquet.lock` replaced the job's input with the
    lock record, then read it back as input (exit 3). Now: exit 6 naming the link, input kept."""
    data, out, job = token_job(tmp_path)
    before = data.read_bytes()
    os.symlink(data, tmp_path / "_out.parquet.lock")
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_OUTPUT, result.output
    assert "is a symbolic link" in result.output and "_out.parquet.lock" in result.output
    assert data.read_bytes() == before and not out.exists()


def test_a_run_writes_beside_planted_links_and_leaves_their_targets(tmp_path):
    """One run with links planted at its marker, error file, metrics and output: each is
    replaced by the run's file, each target left as it was; then a parts-folder link is refused."""
    requests = openai_requests(tmp_path)
    out, errors = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    job = write_job(tmp_path, input={"path": str(requests), "format": "openai_batch"},
                    output={"path": str(out), "max_error_rate": 1.0})
    links = {path: _plant(path, tmp_path / f"victim{k}") for k, path in enumerate(
        [out, errors, tmp_path / "_out.jsonl.complete.json", tmp_path / "m.json", tmp_path / "m.prom"])}
    result = invoke("run", job, "-q", "--metrics", tmp_path / "m.json", "--metrics-prom", tmp_path / "m.prom")
    assert result.exit_code == 0, result.output
    for link, victim in links.items():
        _replaced(link, victim)
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == ["req-0", "req-1"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "_out.jsonl.parts")
    result = invoke("run", job, "-q", "--fresh")
    assert result.exit_code == EXIT_OUTPUT and "is a symbolic link" in result.output, result.output
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("where", ["parts", "store"])
def test_a_link_at_a_folder_the_run_fills_is_refused_before_anything_is_written(tmp_path, where):
    """`<output>.parts` or its token store `<output>.parts/tokens` a link to a foreign folder: the
    run is refused by name (exit 6) before it builds anything, and the foreign folder's files are
    all still there (the store's writer used to delete `<target>/tokens` first)."""
    data, out, job = token_job(tmp_path)
    foreign = tmp_path / "foreign"
    (foreign / "tokens").mkdir(parents=True)
    (foreign / "tokens" / "keep.txt").write_bytes(VICTIM)
    (foreign / "keep.txt").write_bytes(VICTIM)
    parts = Path(OutputFiles(str(out)).parts)
    if where == "parts":
        os.symlink(foreign, parts)
    else:
        parts.mkdir()
        os.symlink(foreign / "tokens", parts / "tokens")
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_OUTPUT, result.output
    named = "the parts folder" if where == "parts" else "the token store's folder"
    assert f"{named} " in result.output and "is a symbolic link" in result.output
    assert (foreign / "tokens" / "keep.txt").read_bytes() == VICTIM and (foreign / "keep.txt").read_bytes() == VICTIM
    assert sorted(p.name for p in foreign.iterdir()) == ["keep.txt", "tokens"]
    assert not out.exists()
