"""`JobSource` (a job opened: every variant decided, no rows read) and `PreparedJob` (its rows read).

`run/open.py` builds the one JobSource of a run (`open_job`): the task, the input and output wire
formats, the resolved engine and the output's files are decided there, once, and every later
stage (reading, planning, scoring, assembly, re-deriving) takes them from here instead of asking
`task_for`, `get_format` or `OutputFiles.for_job` again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchscore.config import JobConfig
from batchscore.engines.factory import ResolvedEngine, kv_block_size
from batchscore.engines.registry import EngineKind, get_kind
from batchscore.formats.registry import WireFormat
from batchscore.output.layout import OutputFiles
from batchscore.plan import PlanOptions
from batchscore.plan.types import Request
from batchscore.prepare.rows import PreparedInput
from batchscore.task import Task


@dataclass
class JobSource:
    """A job opened for a run (`run/open.open_job`): where its rows and model are, which adapters
    run it, and what its output depends on (no rows read yet)."""

    config: JobConfig
    task: Task  # the task that runs the job (task.py), decided once from the job and its input files
    engine: ResolvedEngine  # kind, device, dtype, compile: resolved once
    input_files: list[tuple[Path, str]]  # (input file, format name), discovered once
    input_format: WireFormat | None  # the format every input file is read as; None: synthetic rows or mixed formats
    output_format: WireFormat | None  # output.format with `auto` resolved; None when opened for planning only
    output: OutputFiles | None  # the output and the files beside it, named once; None when planning only
    model_dir: Path | None  # None when not needed (merge, planning without tokens)
    identity: dict  # config, input, model, software, engine: see output/identity.py ({} when planning)
    assembly_input: list = dataclasses.field(default_factory=list)  # the truth and kept columns, by content

    @property
    def kind(self) -> str:
        """The resolved engine kind's name."""
        return self.engine.kind

    @property
    def engine_kind(self) -> EngineKind:
        """The resolved engine kind's adapter (engines/registry.py)."""
        return get_kind(self.engine.kind)

    @property
    def files(self) -> list[tuple[Path, str]]:
        """The input files (the name before `input_files`; kept one step for callers in progress)."""
        return self.input_files


@dataclass
class PreparedJob:
    """A job after reading (and tokenizing) its input: everything but the plan (plan/metadata.plan_rows
    over its token store) and the scores."""

    source: JobSource
    label_ids: list[int] | None  # one-token labels shared by every row; None: each request's own options
    input: PreparedInput
    content_free: Request | None = None  # score.calibrate contextual: scored beside the rows, never an output row
    tokens: Any = None  # the token store (store/tokens.TokenStore) the rows were read into; None: not tokenized

    @property
    def task(self) -> Task:
        return self.source.task

    @property
    def config(self) -> JobConfig:
        return self.source.config

    @property
    def kind(self) -> str:
        return self.source.kind

    @property
    def files(self) -> list[tuple[Path, str]]:
        return self.source.input_files

    @property
    def model_dir(self) -> Path | None:
        return self.source.model_dir


def plan_options(config: JobConfig, engine_kind: str) -> PlanOptions:
    block = config.plan.block_size or kv_block_size(engine_kind)
    return PlanOptions(min_prefix_tokens=config.plan.min_prefix_tokens, block_size=block,
                       order=config.plan.order, enlarge=config.plan.enlarge)
