"""Every engine kind, registered by its own module: its name, the packages it needs, how `auto`
ranks it, its KV block size and how it is built.

A kind is one module that builds an `EngineKind` and calls `register` (the built-in ones are
listed in `BUILT_IN` and imported on first use); `factory.py` and the job file's allowed values
read this table and never name a kind. Importing this module imports neither torch nor vllm.

`engine.kind: auto` is decided by evidence (`choose_auto`): the kinds the machine has the
packages for are tried in rank order (lower first), and the first whose `refuses` finds nothing
against the job runs it; the reason is kept and recorded in the run summary.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from batchscore.config import EngineConfig
from batchscore.errors import EngineUnavailable
from batchscore.registry import Registry

BUILT_IN = ("batchscore.engines.torch.kind", "batchscore.engines.vllm.kind")


@dataclass(frozen=True)
class Machine:
    """What `auto` may rely on: visible GPUs and the importable top-level packages asked about."""

    gpus: int
    installed: frozenset[str]

    @classmethod
    def detect(cls, packages: set[str]) -> Machine:
        from batchscore.engines.device import gpu_count

        return cls(gpu_count(), frozenset(p for p in packages if importlib.util.find_spec(p) is not None))


@dataclass(frozen=True)
class JobFacts:
    """What `auto` knows of the job: its `engine:` section and the model's config.json (None when
    the model is not at hand, e.g. merging parts)."""

    engine: EngineConfig
    model_config: dict[str, Any] | None
    machine: Machine


@dataclass(frozen=True)
class EngineKind:
    """One engine kind.

    `packages`: top-level imports it needs; `install_hint`: how to get them. `auto_rank`: lower is
    tried first by `auto`; `refuses(facts)`: why this kind cannot run the job (None: it can).
    `choose_reason(facts)`: one line saying why `auto` picked it. `block_size()`: KV block a
    shared prefix is aligned to. `device(engine)`: the device it runs on. `build(resolved,
    model_dir, engine)`: the engine. `distributions`: package names whose versions join the run
    identity. `output_tokens`: tokens the engine counts against the context besides the prompt.
`decide_compile`: whether to compile its layers (kinds that never compile leave it None).
    `honours`: which of the `engine:` section's SHARED_KNOBS it acts on (a job that sets another is
    refused by name, never silently ignored); `job_problems(engine)`: its own rules on the
    `engine:` section (e.g. what it cannot combine). `reads_greedy`: it can write
    `output.greedy`'s column.
    """

    name: str
    packages: tuple[str, ...]
    install_hint: str
    auto_rank: int
    refuses: Callable[[JobFacts], str | None]
    build: Callable[[Any, str | Path, EngineConfig], Any]  # (ResolvedEngine, model dir, engine:) -> Engine
    block_size: Callable[[], int] = lambda: 1
    device: Callable[[EngineConfig], str] | None = None
    choose_reason: Callable[[JobFacts], str] = lambda facts: "it can run the job"
    distributions: tuple[str, ...] = ()
    output_tokens: int = 0
    decide_compile: Callable[..., tuple[bool, str]] | None = None  # (engine, dtype, device, **plan) -> (on, why)
    explicit_only: bool = field(default=False)  # never chosen by auto (e.g. a test kind)
    honours: frozenset[str] = frozenset()  # the SHARED_KNOBS it acts on; the others it refuses by name
    job_problems: Callable[[EngineConfig], list[str]] = lambda engine: []  # what else it refuses of `engine:`
    reads_greedy: bool = False  # it reads whether each option token is the argmax (output.greedy)


_KINDS: Registry[EngineKind] = Registry(BUILT_IN, lambda kind: kind.build.__module__)

# The `engine:` keys an engine kind may or may not act on, each with the values that leave it unset
# (a kind that does not honour a key refuses it when set: `knob_problems`).
SHARED_KNOBS: dict[str, tuple] = {"threads": (None,), "compile": (None, False), "hybrid_chunk": (None,),
                                  "memory_budget": (None,), "speculative": (None,), "batch_invariant": (False,),
                                  "cpu_kernels": ("auto",)}


def knob_problems(kind: EngineKind, engine: EngineConfig) -> list[str]:
    """The job's `engine:` keys `kind` does not honour, refused by name (naming the kinds that do),
    then the kind's own rules."""
    problems = []
    for knob, unset in SHARED_KNOBS.items():
        if getattr(engine, knob) not in unset and knob not in kind.honours:
            honouring = [k.name for k in kinds().values() if knob in k.honours]
            where = (f" ({' or '.join(honouring)} engine only); set engine.kind: {honouring[0]}" if honouring
                     else "")
            problems.append(f"engine.{knob}: the {kind.name} engine does not honour it{where}")
    return problems + kind.job_problems(engine)


def engine_problems(engine: EngineConfig) -> list[str]:
    """What the job's named engine kind refuses of its `engine:` section (none for `auto`, whose
    kind is checked once chosen, nor for an unknown kind, which the job file names already)."""
    kind = _KINDS.get(engine.kind) if engine.kind != "auto" else None
    return [] if kind is None else knob_problems(kind, engine)


def register(kind: EngineKind) -> EngineKind:
    """Add (or replace) an engine kind; returns it. `auto` is not a kind name."""
    if kind.name == "auto":
        raise ValueError("'auto' is not an engine kind name")
    return _KINDS.register(kind)


def unregister(name: str) -> None:
    _KINDS.unregister(name)


def reads_greedy(name: str) -> bool:
    """Whether the job's `engine.kind` reads each option token's argmax (`output.greedy`); `auto`
    does where it picks the torch engine, its first choice wherever that can run the job."""
    kind = _KINDS.get(name) if name != "auto" else None
    return name == "auto" or (kind is not None and kind.reads_greedy)


def kinds() -> dict[str, EngineKind]:
    """Every registered kind by name: the built-in ones first, in `BUILT_IN`'s order (whichever
    module was imported first), then the others in the order they registered."""
    return _KINDS.entries()


def kind_names() -> tuple[str, ...]:
    """The values `engine.kind` takes: every registered kind, then `auto`."""
    return (*kinds(), "auto")


def get_kind(name: str) -> EngineKind:
    found = _KINDS.get(name)
    if found is None:
        raise EngineUnavailable(f"unknown engine kind {name!r} (known: {', '.join(kinds())})")
    return found


def missing_packages(kind: EngineKind, machine: Machine) -> list[str]:
    return [p for p in kind.packages if p not in machine.installed]


@dataclass(frozen=True)
class AutoChoice:
    kind: str
    reason: str


def choose_auto(facts: JobFacts) -> AutoChoice:
    """The kind `auto` runs: the best-ranked kind that is installed and does not refuse the job.
    Raises EngineUnavailable (every kind's reason) when none can."""
    passed_over = []
    for kind in sorted(kinds().values(), key=lambda k: (k.auto_rank, k.name)):
        if kind.explicit_only:
            continue
        missing = missing_packages(kind, facts.machine)
        why_not = f"{', '.join(missing)} not installed" if missing else kind.refuses(facts)
        if why_not is None:
            reason = kind.choose_reason(facts)
            if passed_over:
                reason += f" ({'; '.join(passed_over)})"
            return AutoChoice(kind.name, f"engine.kind auto -> {kind.name}: {reason}")
        passed_over.append(f"{kind.name}: {why_not}")
    raise EngineUnavailable(f"engine.kind auto: no engine kind can run this job ({'; '.join(passed_over)})")
