"""`batchscore schema`: the job file's JSON Schema, for editor completion and for checking job
files in CI (e.g. the YAML language server: `# yaml-language-server: $schema=job.schema.json`).

pydantic builds it from the JobConfig dataclasses — the one definition of the keys, their types
and defaults — and this module adds what the dataclasses say in words: each key's description
(its comment in config.py), the allowed values of the keys that have a fixed set (jobfile.ALLOWED,
the table `load_job` checks against), and unknown keys refused, as `load_job` refuses them.

The validation itself stays in jobfile.py: pydantic's messages for unknown keys carry no
did-you-mean, and its coercions differ from the job file's (a single label given as a string,
numbers written where text is meant), so a replacement would have made the messages worse.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

from batchscore import config as job_config
from batchscore.jobfile import ALLOWED

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _section_class(dotted: str) -> str:
    """The dataclass holding a dotted job key's last part: `engine.kind` -> EngineConfig."""
    cls = job_config.JobConfig
    for part in dotted.split(".")[:-1]:
        type_name = next(f.type for f in dataclasses.fields(cls) if f.name == part)
        cls = getattr(job_config, type_name.replace(" | None", ""))
    return cls.__name__


# (dataclass, key) -> the allowed values, as jobfile.py checks them
ALLOWED_VALUES = {(_section_class(dotted), dotted.rpartition(".")[2]): values for dotted, values in ALLOWED.items()}
INTERNAL_KEYS = {("JobConfig", "source")}  # set by load_job, not written in a job file
WORD_VALUES = {("OutOfScopeConfig", "min_label_mass"): ("auto",)}  # number-or-word keys: the words allowed

_FIELD_COMMENT = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$")


def job_schema() -> dict:
    """The JSON Schema of a job file (a dict, ready for json.dumps)."""
    from pydantic import TypeAdapter

    schema = TypeAdapter(job_config.JobConfig).json_schema()
    _describe("JobConfig", job_config.JobConfig, schema)  # the top level is JobConfig's definition
    for name, definition in schema["$defs"].items():
        _describe(name, getattr(job_config, name), definition)
    return {"$schema": SCHEMA_DIALECT, "$id": "https://batchscore.dev/job.schema.json",
            "title": "batchscore job file", **schema}


def _describe(name: str, cls: type, definition: dict) -> None:
    """Add descriptions, allowed values and `additionalProperties: false` to one dataclass's definition."""
    comments = _field_comments(cls)
    properties = definition.get("properties", {})
    for key in [k for k in properties if (name, k) in INTERNAL_KEYS]:
        del properties[key]
    for field in dataclasses.fields(cls):  # a key the job file spells otherwise (calibrate.from: field from_)
        if "key" in field.metadata and field.name in properties:
            comments[field.metadata["key"]] = comments.pop(field.name, "")
            definition["properties"] = properties = {field.metadata["key"] if k == field.name else k: v
                                                     for k, v in properties.items()}
    for key, prop in properties.items():
        prop.pop("title", None)
        if key in comments:
            prop["description"] = comments[key]
        if (name, key) in ALLOWED_VALUES:
            prop["enum"] = list(ALLOWED_VALUES[(name, key)])
        if (name, key) in WORD_VALUES:  # a number or one word (min_label_mass: 0.3 | auto)
            prop["anyOf"] = [{"type": "number", "minimum": 0, "maximum": 1}, {"enum": list(WORD_VALUES[(name, key)])}]
        if prop.get("type") == "array" and prop.get("items", {}).get("type") == "string":
            properties[key] = {**{k: v for k, v in prop.items() if k not in ("type", "items")},
                               "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]}
    if cls.__doc__ and not cls.__doc__.startswith(f"{name}("):  # not the dataclass's generated signature
        definition["description"] = inspect.cleandoc(cls.__doc__)
    definition.pop("title", None)
    definition["additionalProperties"] = False


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's trailing comment in its dataclass's source."""
    names = {f.name for f in dataclasses.fields(cls)}
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        match = _FIELD_COMMENT.match(line)
        if match and match[1] in names:
            comments[match[1]] = match[2].strip()
    return comments


__all__ = ["job_schema"]
