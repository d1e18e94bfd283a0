"""Job file loading and validation: every problem listed at once, clear messages."""

import pytest

from batchscore.errors import JobConfigError
from batchscore.jobfile import config_from_dict, load_job, parse_set_options

VALID = {
    "input": {"path": "in.parquet"},
    "prompt": {"template": "Q: {query}"},
    "labels": ["Yes", "No"],
    "output": {"path": "out.parquet"},
}


def test_valid_config_has_defaults():
    config = config_from_dict(VALID)
    assert config.engine.kind == "torch"
    assert config.plan.order == "r_group"
    assert config.model == "smollm2-135m-instruct"


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(JobConfigError) as info:
        config_from_dict({**VALID, "engine": {"token_budgte": 10}})
    assert "engine.token_budgte" in str(info.value)
    assert "did you mean engine.token_budget" in str(info.value)


def test_every_problem_is_listed_at_once():
    raw = {"input": {"path": 3, "batch_rows": "many"}, "labels": ["Yes"], "engine": {"kind": "tpu"}}
    with pytest.raises(JobConfigError) as info:
        config_from_dict(raw)
    problems = info.value.problems
    assert any("input.batch_rows" in p for p in problems)
    assert len(problems) >= 1
    # type errors stop semantic checks; fix them and the semantic problems all show together
    with pytest.raises(JobConfigError) as info:
        config_from_dict({"input": {"path": "x"}, "labels": ["Yes"], "engine": {"kind": "tpu"}})
    text = str(info.value)
    assert "labels" in text and "engine.kind" in text and "prompt.template" in text


def test_wrong_types_name_the_key():
    with pytest.raises(JobConfigError, match=r"engine.token_budget: expected an integer"):
        config_from_dict({**VALID, "engine": {"token_budget": "lots"}})
    with pytest.raises(JobConfigError, match=r"prompt.chat: expected true or false"):
        config_from_dict({**VALID, "prompt": {"template": "{a}", "chat": "yes please"}})


def test_unsafe_template_is_a_config_error():
    for template in ["{row.__class__}", "{row[0]}", "{query!r}", "{query:>10}", "{}"]:
        with pytest.raises(JobConfigError, match="prompt.template"):
            config_from_dict({**VALID, "prompt": {"template": template}})


def test_duplicate_labels_rejected():
    with pytest.raises(JobConfigError, match="distinct"):
        config_from_dict({**VALID, "labels": ["Yes", "Yes"]})


def test_malformed_yaml(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("input: [unclosed\n")
    with pytest.raises(JobConfigError, match="malformed YAML"):
        load_job(path)


def test_missing_job_file(tmp_path):
    with pytest.raises(JobConfigError, match="job file not found"):
        load_job(tmp_path / "nope.yaml")


def test_set_overrides_and_relative_paths(tmp_path):
    import yaml

    (tmp_path / "jobs").mkdir()
    path = tmp_path / "jobs" / "job.yaml"
    path.write_text(yaml.safe_dump(VALID))
    config = load_job(path, parse_set_options(["engine.dtype=bfloat16", "engine.token_budget=512"]),
                      output="elsewhere.parquet")
    assert config.engine.dtype == "bfloat16"
    assert config.engine.token_budget == 512
    assert config.input.path == str(tmp_path / "jobs" / "in.parquet")
    assert config.output.path == "elsewhere.parquet"


def test_set_without_equals_is_an_error():
    with pytest.raises(JobConfigError, match="KEY=VALUE"):
        parse_set_options(["engine.dtype"])


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("input: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(JobConfigError, match="malformed YAML"):
        load_job(path)


def test_yes_and_no_labels_stay_text(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("input: {path: in.parquet}\nprompt: {template: '{q}', chat: true}\nlabels: [Yes, No, on, off]\n")
    config = load_job(path)
    assert config.labels == ["Yes", "No", "on", "off"]
    assert config.prompt.chat is True


def test_engine_device_is_checked():
    assert config_from_dict(VALID).engine.device == "auto"
    with pytest.raises(JobConfigError, match=r"engine.device: must be one of cpu, cuda, auto, got 'tpu'"):
        config_from_dict({**VALID, "engine": {"device": "tpu"}})


def test_cuda_without_a_gpu_is_a_clear_error():
    from batchscore.engines.device import gpu_available, resolve_device
    from batchscore.errors import EngineUnavailable

    assert resolve_device("cpu") == "cpu"
    if gpu_available():
        assert resolve_device("auto") == "cuda"
    else:
        assert resolve_device("auto") == "cpu"
        with pytest.raises(EngineUnavailable, match="torch sees no GPU"):
            resolve_device("cuda")


def test_a_model_folder_is_relative_to_the_job_file(tmp_path, monkeypatch):
    jobs = tmp_path / "jobs"
    (jobs / "models" / "m").mkdir(parents=True)
    (jobs / "job.yaml").write_text("input: {path: d.jsonl}\nprompt: {template: '{q}'}\nlabels: [Yes, No]\n"
                                   "model: models/m\noutput: {path: o.parquet}\n")
    monkeypatch.chdir(tmp_path)  # not the job's folder
    config = load_job(jobs / "job.yaml")
    assert config.model == str(jobs / "models" / "m")
    assert load_job(jobs / "job.yaml", {"model": "smollm2-135m-instruct"}).model == "smollm2-135m-instruct"


def test_yaml_alias_bomb_is_refused_quickly():
    import time

    from batchscore.config import safe_load_yaml

    text = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(20))
    started = time.perf_counter()
    with pytest.raises(Exception, match="aliases"):
        safe_load_yaml(text)
    assert time.perf_counter() - started < 1.0
    assert safe_load_yaml("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}  # ordinary aliases work


def test_every_key_with_fixed_values_is_checked_against_the_one_table():
    import copy

    from batchscore.jobfile import ALLOWED
    from batchscore.schema import job_schema

    schema = job_schema()
    for key, allowed in ALLOWED.items():
        raw = copy.deepcopy(VALID)
        *sections, name = key.split(".")
        node = raw
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = "nonsense"
        with pytest.raises(JobConfigError) as info:
            config_from_dict(raw)
        assert any(p.startswith(f"{key}: ") and ", ".join(allowed) in p for p in info.value.problems), key
        # ...and `batchscore schema` lists the same values
        definition = schema
        for section in sections:
            ref = definition["properties"][section]
            ref = next((r for r in ref.get("anyOf", [ref]) if "$ref" in r), ref)
            definition = schema["$defs"][ref["$ref"].rsplit("/", 1)[1]]
        assert definition["properties"][name]["enum"] == list(allowed), key
