"""Models by Hub id, resolved by huggingface_hub from a Hugging Face cache laid out in tmp."""

import os

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import JobConfigError
from batchscore.errors import EXIT_CONFIG, ModelError
from batchscore.jobfile import config_from_dict
from batchscore.models import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = '{"model_type": "llama", "vocab_size": 32}'  # what models.py checks a config.json for


def fake_hub_model(cache, repo_id, files, commit=COMMIT):
    """The cache layout huggingface_hub writes: blobs linked from snapshots/<commit>/, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, source in files.items():
        blob = repo / "blobs" / f"blob-{name}"
        if isinstance(source, str):
            blob.write_text(source)
        else:
            os.symlink(source, blob)  # a real model's file, without copying it
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache):
    snapshot = fake_hub_model(hub_cache, "Org/Name", {"config.json": CONFIG})
    assert resolve_model("Org/Name") == snapshot
    # model_download: true does not touch the network for a model already cached
    assert resolve_model("Org/Name", download=True) == snapshot


def test_the_snapshot_follows_refs_main(hub_cache):
    fake_hub_model(hub_cache, "Org/Name", {"config.json": CONFIG}, commit="a" * 40)
    newer = hub_cache / "models--Org--Name" / "snapshots" / ("b" * 40)
    newer.mkdir()
    (newer / "config.json").write_text(CONFIG)
    (hub_cache / "models--Org--Name" / "refs" / "main").write_text("b" * 40)
    assert resolve_model("Org/Name") == newer


def test_a_missing_model_lists_what_was_searched(hub_cache):
    with pytest.raises(ModelError) as info:
        resolve_model("Org/Missing")
    text = str(info.value)
    assert str(hub_cache) in text and "models--Org--Missing" in text
    assert "smollm2-135m-instruct" in text  # the built-in names
    assert os.path.abspath("Org/Missing") in text  # the local path
    assert "model_download: true" in text


def test_a_snapshot_without_config_is_refused(hub_cache):
    fake_hub_model(hub_cache, "Org/Tokenizer-only", {"tokenizer.json": "{}"})
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model("Org/Tokenizer-only")


def test_a_local_folder_still_wins_over_the_cache(hub_cache, tmp_path, monkeypatch):
    fake_hub_model(hub_cache, "Org/Name", {"config.json": CONFIG})
    local = tmp_path / "Org" / "Name"
    local.mkdir(parents=True)
    (local / "config.json").write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("Org/Name").resolve() == local


def test_model_download_is_a_checked_job_key():
    base = {"input": {"path": "x.parquet"}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"]}
    assert config_from_dict(base).model_download is False
    assert config_from_dict({**base, "model_download": True}).model_download is True
    with pytest.raises(JobConfigError, match="model_download: expected true or false"):
        config_from_dict({**base, "model_download": "yes"})


def test_a_job_runs_on_a_model_named_by_hub_id(hub_cache, model_dir, job_factory, small_input, tmp_path):
    files = {p.name: p.resolve() for p in model_dir.iterdir() if p.is_file()}
    fake_hub_model(hub_cache, "HuggingFaceTB/SmolLM2-135M-Instruct", files)
    job = job_factory(small_input, model="HuggingFaceTB/SmolLM2-135M-Instruct")
    result = CliRunner().invoke(main, ["run", str(job), "-q"])
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pandas()
    assert len(out) == 12 and (out["status"] == "ok").all()


def test_cli_names_the_cache_for_an_unknown_hub_id(hub_cache, job_factory, small_input):
    result = CliRunner().invoke(main, ["run", str(job_factory(small_input, model="Org/Missing")), "-q"])
    assert result.exit_code == EXIT_CONFIG
    assert "Traceback" not in result.output and str(hub_cache) in result.output
