"""`batchscore schema`: the job file's JSON Schema accepts every shipped job, refuses what
`load_job` refuses by structure (unknown keys, values outside a fixed set), and describes keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.config import safe_load_yaml
from batchscore.errors import JobConfigError
from batchscore.jobfile import ALLOWED, load_job

jsonschema = pytest.importorskip("jsonschema")
JOBS = sorted((Path(__file__).resolve().parent.parent / "jobs").glob("*.yaml"))


@pytest.fixture(scope="module")
def schema(tmp_path_factory):
    out = tmp_path_factory.mktemp("schema") / "job.schema.json"
    result = CliRunner().invoke(main, ["schema", "-o", str(out)])
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    jsonschema.Draft202012Validator.check_schema(document)
    return document


@pytest.mark.parametrize("job", JOBS, ids=[p.name for p in JOBS])
def test_every_shipped_job_is_valid(schema, job):
    load_job(job)  # the job is valid for batchscore...
    jsonschema.validate(safe_load_yaml(job.read_text()), schema)  # ...and for the schema (read as load_job reads it)


def test_refuses_what_load_job_refuses(schema, tmp_path):
    job = safe_load_yaml(JOBS[0].read_text())
    for bad in ({**job, "engine": {**job.get("engine", {}), "kindd": "torch"}},
                {**job, "engine": {**job.get("engine", {}), "kind": "tensorrt"}},
                {**job, "output": {**job.get("output", {}), "part_rows": "many"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(JobConfigError):
            load_job(path)


def test_keys_are_described_with_their_allowed_values(schema):
    engine = schema["$defs"]["EngineConfig"]["properties"]
    assert engine["kind"]["enum"] == list(ALLOWED["engine.kind"])
    assert "tokens per forward batch" in engine["token_budget"]["description"]
    assert "s3://" in schema["$defs"]["InputConfig"]["properties"]["path"]["description"]
    assert "source" not in schema["properties"]  # set by load_job, not a job key
    assert {"type": "string"} in schema["properties"]["labels"]["anyOf"]  # `labels: Yes` is allowed too
    undescribed = [(name, key) for name, d in [("job", schema), *schema["$defs"].items()]
                   for key, prop in d.get("properties", {}).items() if "description" not in prop]
    assert undescribed == []


def test_schema_on_stdout():
    result = CliRunner().invoke(main, ["schema"])
    assert result.exit_code == 0
    assert json.loads(result.output)["title"] == "batchscore job file"
