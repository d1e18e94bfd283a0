"""Reading a job file: safe YAML, `--set` overrides, complete validation and path resolution.

A job file is validated once, up front, before any model is loaded; every problem found is
reported together in one `JobConfigError`. The dataclasses it fills live in config.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml

from batchscore.config import (CalibrateConfig, EngineConfig, ExecutorConfig, InputConfig, JobConfig, OutOfScopeConfig,
                               OutputConfig, PlanConfig, PromptConfig, ReportConfig, ReviewConfig, ScoreConfig,
                               SpeculativeConfig, SyntheticInput, TableConfig, safe_load_yaml)
from batchscore.engines.registry import engine_problems, kind_names as engine_kind_names, reads_greedy
from batchscore.engines.vllm.kind import vllm_args_problems
from batchscore.engines.shape import DTYPE_BYTES
from batchscore.engines.speculative.kept_tokens import options_problems
from batchscore.errors import JobConfigError, PromptTemplateError
from batchscore.formats.registry import (answers_in_lines, input_names as input_format_names, job_format_problems,
                                         named_input_format, output_format_of, output_names as output_format_names,
                                         requests_in_lines)
from batchscore.io.iceberg_catalog import catalog_relative_to
from batchscore.io.storage import is_url
from batchscore.models import BUILTIN_MODELS
from batchscore.scores.calibration import METHODS as CALIBRATION_METHODS
from batchscore.output.column_names import COLUMN_NAMES, slug_problems
from batchscore.output.layout import COLUMN_SEPARATORS, DEFAULT_ID, label_column
from batchscore.output.table_publish import TABLE_FORMATS, table_problems
from batchscore.output.partitioned import partition_problems
from batchscore.scores.review import CONFIDENCE_METHODS
from batchscore.plan.order import POLICIES as ORDER_POLICIES
from batchscore.prepare.options import NORMALIZE
from batchscore.prepare.prompts import PROMPT_ENGINES, template_fields
from batchscore.prepare.synthetic import WORKLOADS
from batchscore.task import Task, task_for

# Every job key with a fixed set of values -> those values, taken from the module that acts on
# them (a literal where no one module owns the list). The one table: load_job checks against it
# and `batchscore schema` lists it as each key's enum.
ALLOWED: dict[str, tuple[str, ...]] = {
    "input.format": input_format_names(),
    "input.synthetic.workload": tuple(sorted(WORKLOADS)),
    "prompt.engine": PROMPT_ENGINES,
    "score.normalize": NORMALIZE,
    "score.calibrate": CALIBRATION_METHODS,
    "score.confidence": CONFIDENCE_METHODS,
    "engine.kind": engine_kind_names(),
    "engine.dtype": (*DTYPE_BYTES, "auto"),
    "engine.device": ("cpu", "cuda", "auto"),
    "engine.cpu_kernels": ("auto", "torch"),
    "plan.order": ORDER_POLICIES,
    "output.format": output_format_names(),
    "output.column_separator": COLUMN_SEPARATORS,
    "output.column_names": COLUMN_NAMES,
    "output.mode": ("full", "incremental"),
    "output.table.format": TABLE_FORMATS,
    "output.table.mode": ("merge", "append", "overwrite"),
    "executor.kind": ("local", "ray"),
    "executor.tokenize": ("auto", "tasks", "driver"),
}


def load_job(path: str | os.PathLike, overrides: dict[str, str] | None = None,
             output: str | None = None, allow_code: bool = False) -> JobConfig:
    """Read a job file safely, apply `--set` overrides and `--output`, and validate everything.

    Relative paths in the file (input, output, a model folder) are resolved against the job
    file's folder. `allow_code` permits vLLM arguments that load code (the CLI's --allow-code).
    """
    path = Path(path)
    if not path.is_file():
        raise JobConfigError([f"job file not found: {path}" if not path.exists() else f"{path} is not a file"])
    try:
        raw = safe_load_yaml(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise JobConfigError([f"job file is not valid UTF-8: {exc}"], str(path)) from None
    except OSError as exc:
        raise JobConfigError([f"cannot read the job file: {exc.strerror}"], str(path)) from None
    except yaml.YAMLError as exc:
        raise JobConfigError([f"malformed YAML: {exc}"], str(path)) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobConfigError(["the job file must be a mapping of keys (input, prompt, labels, ...)"], str(path))
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, _parse_override_value(value))
    config = config_from_dict(raw, source=str(path), allow_code=allow_code)
    _resolve_relative_paths(config, path.parent)
    if output is not None:  # given on the command line: relative to the working folder
        config.output.path = local_path(output)
    return config


def config_from_dict(raw: dict[str, Any], source: str | None = None, allow_code: bool = False) -> JobConfig:
    """Build and validate a JobConfig from plain data; raises JobConfigError listing all problems."""
    from batchscore.io.readers import lone_surrogate_field

    surrogate = lone_surrogate_field(raw)  # YAML and JSON can write one; no label, path or template can hold it
    if surrogate is not None:
        raise JobConfigError([f"{surrogate}: holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its "
                              "pair), which is not text"], source)
    problems: list[str] = []
    config = _build(JobConfig, raw, "", problems)
    config.source = source
    if not problems:
        problems.extend(_semantic_problems(config))
        problems.extend(vllm_args_problems(config.engine.vllm_args, allow_code))  # the vllm kind's rules
    if problems:
        raise JobConfigError(problems, source)
    config.input.path = local_path(config.input.path)
    config.output.path = local_path(config.output.path)
    config.output.error_path = local_path(config.output.error_path)
    config.calibrate.from_ = local_path(config.calibrate.from_)
    config.calibrate.truth_columns = {str(k): v for k, v in (config.calibrate.truth_columns or {}).items()}
    truths = [config.calibrate.truth_column] + list(config.calibrate.truth_columns.values())
    for truth in dict.fromkeys(t for t in truths if t is not None):
        if truth not in config.output.keep_columns:
            config.output.keep_columns.append(truth)  # truth columns are copied into the output
    # partition values are text (a YAML date such as 2026-11-25 included)
    config.input.filter = {str(k): [str(v) for v in want] if isinstance(want, list) else str(want)
                           for k, want in config.input.filter.items()}
    wire = named_input_format(config)
    if wire is not None and wire.request_id and config.input.id_column is None:
        config.input.id_column = wire.request_id  # each request's own id (OpenAI Batch: custom_id)
    return config


def local_path(path: str | None) -> str | None:
    """A `file://` URL as the local path it names; anything else as it is."""
    if path is not None and path.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(path).path)
    return path


def parse_set_options(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Turn `--set key=value` strings into a dict; raises JobConfigError on a missing '='."""
    result, problems = {}, []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected KEY=VALUE, e.g. --set engine.dtype=bfloat16")
        else:
            result[key.strip()] = value
    if problems:
        raise JobConfigError(problems)
    return result


def _parse_override_value(value: str) -> Any:
    try:
        return safe_load_yaml(value)
    except yaml.YAMLError:
        return value


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


_SCALAR_TYPES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
# A number as YAML 1.2 writes it (1e-12, 5E3, .5): PyYAML (YAML 1.1) keeps an exponent without a dot as text.
_FLOAT_TEXT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")


def _build(cls, raw: Any, prefix: str, problems: list[str]):
    """Build dataclass `cls` from `raw`, appending every problem found to `problems`."""
    where = prefix.rstrip(".") or "the job file"
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping, got {type(raw).__name__}")
        return cls()
    # by the key a job file spells (a field's metadata "key": `calibrate.from` is the field from_)
    fields = {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls) if f.name != "source"}
    values = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            problems.append(f"unknown key {name!r}{hint}")
            continue
        values[fields[key].name] = _convert(fields[key].type, value, name, problems)
    return cls(**{k: v for k, v in values.items() if v is not _INVALID})


_INVALID = object()


def _convert(type_str: str, value: Any, name: str, problems: list[str]) -> Any:
    nested = {"InputConfig": InputConfig, "PromptConfig": PromptConfig, "EngineConfig": EngineConfig,
              "PlanConfig": PlanConfig, "OutputConfig": OutputConfig, "ExecutorConfig": ExecutorConfig,
              "ReportConfig": ReportConfig, "TableConfig | None": TableConfig,
              "ScoreConfig": ScoreConfig, "CalibrateConfig": CalibrateConfig, "ReviewConfig | None": ReviewConfig,
              "OutOfScopeConfig | None": OutOfScopeConfig,
              "SyntheticInput | None": SyntheticInput, "SpeculativeConfig | None": SpeculativeConfig}
    optional = type_str.endswith("| None")
    if value is None:
        if optional:
            return None
        problems.append(f"{name}: must not be empty")
        return _INVALID
    if type_str in nested:
        return _build(nested[type_str], value, f"{name}.", problems)
    base = type_str.replace(" | None", "")
    if base == "float | str":  # a number or a word (output.out_of_scope.min_label_mass: 0.3 | auto)
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            problems.append(f"{name}: expected a number or a word, got {value!r}")
            return _INVALID
        return float(value) if isinstance(value, int) or (isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip())) \
            else value
    if base == "list[str]":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
            problems.append(f"{name}: expected a list of strings, got {value!r}")
            return _INVALID
        return [str(v) for v in value]
    if base == "dict[str, Any]":
        if not isinstance(value, dict):
            shown = type(value).__name__ if name.endswith("storage_options") else repr(value)  # may hold a secret
            problems.append(f"{name}: expected a mapping, got {shown}")
            return _INVALID
        return value
    expected = {"int": int, "float": float, "bool": bool, "str": str}[base]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is float and isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
        return float(value)  # 1e-12: YAML 1.1 reads an exponent without a dot as text
    if expected is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        problems.append(f"{name}: expected {_SCALAR_TYPES[expected]}, got {value!r}")
        return _INVALID
    return value


def _semantic_problems(config: JobConfig) -> list[str]:
    """Cross-field checks that need the whole config."""
    problems = []
    inp = config.input
    if inp.path is None and inp.synthetic is None and inp.identifier is None:
        problems.append("input.path: required (a .parquet/.jsonl file, a folder, a glob or a Delta table's folder; "
                        "an Iceberg table: input.catalog and input.identifier)")
    problems.extend(_not_allowed(config, "input.format"))
    named = named_input_format(config)
    if (inp.catalog or inp.identifier or inp.version is not None) and getattr(named, "open_input", None) is None:
        problems.append("input.catalog / identifier / version: read a table; set input.format: delta or iceberg")
    if inp.batch_rows < 1:
        problems.append("input.batch_rows: must be ≥ 1")
    for key, want in inp.filter.items():
        values = want if isinstance(want, list) else [want]
        if not values or any(isinstance(v, (dict, list)) or v is None for v in values):
            problems.append(f"input.filter.{key}: a partition value or a list of them, got {want!r}")
    if inp.synthetic is not None and inp.synthetic.workload not in ALLOWED["input.synthetic.workload"]:
        problems.append(f"input.synthetic.workload: unknown {inp.synthetic.workload!r}; "
                        f"available: {', '.join(ALLOWED['input.synthetic.workload'])}")
    has_tokens = inp.token_ids_column is not None or inp.synthetic is not None
    problems.extend(job_format_problems(config))  # the input and output formats' own rules (formats/)
    if not requests_in_lines(config) and not has_tokens and not config.prompt.template \
            and not config.prompt.state_columns:
        problems.append("prompt.template: required unless input.token_ids_column is given "
                        "(e.g. 'Query: {query}\\nAnswer Yes or No.')")
    if engine_problem := _not_allowed(config, "prompt.engine"):
        problems.extend(engine_problem)
    elif config.prompt.template:
        try:
            template_fields(config.prompt.template, config.prompt.engine)
        except PromptTemplateError as exc:
            problems.append(f"prompt.template: {exc}")
    task = task_for(config)  # from the job file alone (run/open.py decides it again with the input's files)
    problems.extend(task.job_problems(config))
    if config.engine.speculative is not None and inp.choices_column:
        problems.append("engine.speculative: speculative prefill scores one-token labels shared by every row, "
                        "not input.choices_column")
    problems.extend(_output_column_problems(config, task))
    problems.extend(_quality_problems(config, task))
    for key in ("engine.kind", "engine.dtype", "engine.device", "engine.cpu_kernels"):
        problems.extend(_not_allowed(config, key))
    if config.engine.token_budget < 16:
        problems.append(f"engine.token_budget: must be ≥ 16, got {config.engine.token_budget}")
    if config.engine.hybrid_chunk is not None and config.engine.hybrid_chunk < 16:
        problems.append(f"engine.hybrid_chunk: must be ≥ 16 tokens, got {config.engine.hybrid_chunk}")
    if config.engine.memory_budget is not None and config.engine.memory_budget < 2**20:
        problems.append(f"engine.memory_budget: bytes, must be ≥ 1 MiB (1048576), got {config.engine.memory_budget}")
    if config.engine.speculative is not None:
        spec = config.engine.speculative
        problems.extend(options_problems(spec.keep, spec.speculator, spec.chunk, spec.pool))
    problems.extend(engine_problems(config.engine))  # the named kind's rules: what it honours, what it refuses
    if config.engine.threads is not None and config.engine.threads < 1:
        problems.append("engine.threads: must be ≥ 1")
    if config.engine.max_length is not None and config.engine.max_length < 1:
        problems.append("engine.max_length: must be ≥ 1")
    problems.extend(_not_allowed(config, "plan.order"))
    if config.plan.min_prefix_tokens < 1:
        problems.append("plan.min_prefix_tokens: must be ≥ 1")
    if config.plan.block_size is not None and config.plan.block_size < 1:
        problems.append("plan.block_size: must be ≥ 1")
    problems.extend(_not_allowed(config, "output.format"))
    problems.extend(_not_allowed(config, "output.column_separator"))
    problems.extend(_not_allowed(config, "output.column_names"))
    if config.output.column_names == "slug":
        problems.extend(slug_problems(config.labels) if config.labels else [] if config.questions is not None else [
            "output.column_names slug: names the columns of fixed labels (p_<label>) or of a job's questions' "
            "options (<id>.p.<option>); this job has neither"])
    problems.extend(partition_problems(config, output_format_of(config)))
    problems.extend(_not_allowed(config, "output.mode"))
    if config.output.table is not None:
        problems.extend(_not_allowed(config, "output.table.format") + _not_allowed(config, "output.table.mode"))
        problems.extend(table_problems(config.output.table))
        if not getattr(output_format_of(config), "dataset", False):  # read back as one Arrow table to commit
            problems.append(f"output.table: publishes a Parquet output; output.format is {config.output_format}")
    if config.output.mode == "incremental" and (not task.incremental or requests_in_lines(config)
                                                 or config.input.synthetic is not None):
        problems.append("output.mode incremental: for labels and choices jobs over rows of a table or JSON Lines "
                        "(not questions jobs, OpenAI Batch lines or synthetic rows)")
    if config.output.previous is not None and config.output.mode != "incremental":
        problems.append("output.previous: the previous night's output an incremental run carries rows from; "
                        "set output.mode: incremental")
    if not 0.0 <= config.output.max_error_rate <= 1.0:
        problems.append(f"output.max_error_rate: must be between 0 and 1, got {config.output.max_error_rate}")
    problems.extend(_not_allowed(config, "executor.kind"))
    problems.extend(_not_allowed(config, "executor.tokenize"))
    if config.executor.num_workers < 1:
        problems.append("executor.num_workers: must be ≥ 1")
    if config.executor.gpus_per_worker < 0 or config.executor.cpus_per_worker <= 0:
        problems.append("executor.gpus_per_worker must be ≥ 0 and executor.cpus_per_worker > 0")
    if config.output.part_rows < 1:
        problems.append("output.part_rows: must be ≥ 1")
    if config.output.part_seconds <= 0:
        problems.append("output.part_seconds: must be > 0")
    if config.output.top_token and (not task.top_token or answers_in_lines(config)):
        problems.append("output.top_token: for labels and choices jobs written as Parquet or JSON Lines (questions "
                        "jobs write <id>.argmax_is_label; an openai_batch response has no such column)")
    if config.output.greedy and (not inp.choices_column or not reads_greedy(config.engine.kind)
                                 or answers_in_lines(config)):
        problems.append("output.greedy: writes greedy_choices for input.choices_column jobs on the torch engine, "
                        "written as Parquet or JSON Lines (the other engines do not read each option token's argmax)")
    if config.output.audit_rows is not None and config.output.audit_rows < 0:
        problems.append(f"output.audit_rows: must be ≥ 0 (0 turns the exactness audit off), "
                        f"got {config.output.audit_rows}")
    if config.output.audit_seed < 0:
        problems.append(f"output.audit_seed: must be ≥ 0, got {config.output.audit_seed}")
    if config.output.audit_max_dp is not None and not 0.0 < config.output.audit_max_dp <= 1.0:
        problems.append(f"output.audit_max_dp: a |ΔP| bound between 0 (exclusive) and 1, "
                        f"got {config.output.audit_max_dp}")
    return problems


def _not_allowed(config: JobConfig, key: str) -> list[str]:
    """The problem of the job's value of `key` when it is not one of ALLOWED[key] (else none)."""
    *sections, name = key.split(".")
    owner = config
    for section in sections:
        owner = getattr(owner, section)
    value = getattr(owner, name)
    registered = {"engine.kind": engine_kind_names, "input.format": input_format_names,
                  "output.format": output_format_names}  # kinds and formats registered since import too
    allowed = registered[key]() if key in registered else ALLOWED[key]
    return [] if value in allowed else [f"{key}: must be one of {', '.join(allowed)}, got {value!r}"]


def _output_column_problems(config: JobConfig, task: Task) -> list[str]:
    """Two labels that would share one `p_<label>` column, or a kept input column that the scores
    would overwrite: refused up front rather than losing a column silently."""
    problems = []
    by_column: dict[str, list[str]] = {}
    for label in config.labels:
        by_column.setdefault(label_column(label), []).append(label)
    for column, labels in by_column.items():
        if len(labels) > 1:
            problems.append(f"labels: {labels} would all be written to the column {column!r}; make them differ "
                            "by more than surrounding spaces")
    sep = config.output.column_separator
    dotted = [label_column(label) for label in config.labels if "." in label_column(label)]
    if sep != "." and dotted:  # the separator's promise, as for a questions job: no column name holds a dot
        problems.append(f"output.column_separator {sep!r}: the column {dotted[0]!r} would still hold a dot (a label "
                        "with one); rename the label, or keep the separator '.'")
    id_name = config.input.id_column or DEFAULT_ID
    generated, column_problems = task.output_columns(config)
    problems.extend(column_problems)
    generated = generated | ({id_name} if config.input.id_column is None else set())
    truths = config.calibrate.truth_columns if isinstance(config.calibrate.truth_columns, dict) else {}
    kept = {name: "output.keep_columns" for name in config.output.keep_columns}
    kept.update({v: f"calibrate.truth_columns.{k}" for k, v in truths.items() if isinstance(v, str)})
    for name, key in kept.items():
        if name in generated and name != config.input.id_column:
            shown = sorted(generated)
            shown = ", ".join(shown[:12]) + (f", … ({len(shown)} in all)" if len(shown) > 12 else "")
            problems.append(f"{key}: {name!r} is also a column batchscore writes ({shown}); rename the input "
                            "column or drop it from the job")
    return problems


def _quality_problems(config: JobConfig, task: Task) -> list[str]:
    """score.calibrate, score.confidence, the calibrate section, output.review and output.out_of_scope."""
    problems = _not_allowed(config, "score.calibrate") + _not_allowed(config, "score.confidence")
    method, cal = config.score.calibrate, config.calibrate
    review, scope = config.output.review, config.output.out_of_scope
    if problems:
        return problems
    asked = [key for key, on in (("score.calibrate", method != "none"),
                                 ("score.confidence", config.score.confidence != "top"),
                                 ("calibrate.truth_column", cal.truth_column is not None),
                                 ("calibrate.from", cal.from_ is not None), ("output.review", review is not None),
                                 ("output.out_of_scope", scope is not None)) if on]
    return problems + task.quality_problems(config, asked)


def _resolve_relative_paths(config: JobConfig, base: Path) -> None:
    """Make input/output paths, and a model given as a relative path that exists there, relative
    to the job file's folder (changes `config` in place)."""
    model = os.path.expanduser(str(config.model))
    if config.model not in BUILTIN_MODELS and not os.path.isabs(model) and (base / model).exists():
        config.model = os.path.normpath(base / model)
    spec = config.engine.speculative
    if spec is not None and not spec.speculator.startswith("layers:") and spec.speculator not in BUILTIN_MODELS:
        speculator = os.path.expanduser(spec.speculator)
        if not os.path.isabs(speculator) and (base / speculator).exists():  # a speculator model folder
            spec.speculator = os.path.normpath(base / speculator)
    def relative(path: str | None) -> str | None:  # an object-store URL stays as it is
        if not path or is_url(path) or os.path.isabs(os.path.expanduser(path)):
            return path
        return os.path.normpath(base / path)

    config.input.path = relative(config.input.path)
    config.input.catalog = catalog_relative_to(config.input.catalog, base)
    config.output.path = relative(config.output.path)
    config.output.error_path = relative(config.output.error_path)
    config.output.previous = relative(config.output.previous)
    if config.output.table is not None:
        config.output.table.path = relative(config.output.table.path)
        config.output.table.catalog = catalog_relative_to(config.output.table.catalog, base)
    config.calibrate.from_ = relative(config.calibrate.from_)
