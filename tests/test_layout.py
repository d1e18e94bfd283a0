"""The package's shape: no import circle, and the benchmark wing is a leaf production never imports.

Imports are read from the source (every `import`, also those inside functions), so a lazy import
that closes a circle is caught too. A module importing its own parent package is not counted:
Python runs a package's `__init__` before any of its modules anyway.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "batchscore"

# The one place production names the benchmark wing: `batchscore bench` loads its commands lazily.
ALLOWED_INTO_BENCH = {("batchscore.cli", "batchscore.bench.cli"), ("batchscore.cli", "batchscore.bench")}


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.AST:
    """A module's syntax tree, parsed once for all the tests here (they only read it)."""
    return ast.parse(path.read_text(), str(path))


@functools.lru_cache(maxsize=None)
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(_tree(path)))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


@functools.lru_cache(maxsize=None)
def import_graph() -> dict[str, set[str]]:
    """module -> the batchscore modules it imports (a package's `__init__` counts as imported too)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _nodes(path):
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                found = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in found:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                while target.startswith("batchscore"):
                    targets.add(target)
                    target = target.rpartition(".")[0]
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = targets - ancestors - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_imports():
    graph = import_graph()
    assert "batchscore.run.open" in graph["batchscore.run.runner"]
    assert "batchscore.engines.torch.engine" in graph["batchscore.engines.torch.kind"]  # a lazy import counts


def test_no_import_circle():
    assert find_cycle(import_graph()) is None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_production_never_imports_the_bench_wing():
    bad = sorted((source, target) for source, targets in import_graph().items() for target in targets
                 if not source.startswith("batchscore.bench") and target.startswith("batchscore.bench")
                 and (source, target) not in ALLOWED_INTO_BENCH)
    assert not bad, bad


def test_every_error_has_one_base():
    import batchscore.errors as errors

    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert all(issubclass(c, errors.BatchscoreError) for c in classes)
    defined_elsewhere = []
    for name, path in _modules().items():
        if name == "batchscore.errors":
            continue
        for node in _nodes(path):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception", "Mismatch"))
                    for b in node.bases):
                defined_elsewhere.append(f"{name}.{node.name}")
    assert not defined_elsewhere, f"define errors in batchscore/errors.py: {defined_elsewhere}"


def face_imports() -> list[tuple[str, str]]:
    """(module, package) for every import of a name from a package's `__init__` (its face) by a
    module inside that package: `from batchscore.engines import gpu_available` in
    batchscore/engines/vllm/settings.py. Such an import closes a circle as soon as the face
    imports the module back, lazily or not."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        for node in _nodes(path):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            face = node.module
            if modules.get(face, Path()).name != "__init__.py" or not name.startswith(face + "."):
                continue
            if any(f"{face}.{alias.name}" not in modules for alias in node.names):
                found.append((name, face))
    return found


def test_no_module_imports_its_own_package_face():
    assert face_imports() == []


def test_faces_import_only_their_own_modules():
    """A package face re-exports; it never reaches out lazily to build things."""
    graph = import_graph()
    modules = _modules()
    for name, path in modules.items():
        if path.name != "__init__.py":
            continue
        lazy = [node for node in _nodes(path) if isinstance(node, (ast.FunctionDef,))
                and any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node))]
        if name in ("batchscore", "batchscore.report"):
            continue  # the top face loads run_job lazily; report's face is its entry point (write_report)
        assert not lazy, f"{name} imports inside a function: make it a plain face"


def test_config_stays_on_the_ground_floor():
    """config.py holds dataclasses and YAML only: it imports errors, models, yaml and the
    standard library, so every floor above may name its dataclasses."""
    path = PACKAGE / "config.py"
    allowed = {"batchscore.errors", "batchscore.models", "batchscore"}
    imported = set()
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    third_party = {m for m in imported if not m.startswith("batchscore")} - {"yaml"}
    import sys
    assert not {m.split(".")[0] for m in third_party} - set(sys.stdlib_module_names) - {"__future__"}, third_party
    assert {m for m in imported if m.startswith("batchscore")} <= allowed, imported


def test_engines_layout():
    """engines/ is a face, device.py, factory.py, base.py, shape.py, cpu_features.py, peak_memory.py
    and three sub-packages; nothing flat is told apart by a prefix."""
    flat = sorted(p.name for p in (PACKAGE / "engines").glob("*.py"))
    assert flat == ["__init__.py", "base.py", "cpu_features.py", "device.py", "factory.py", "fallback.py",
                    "peak_memory.py", "registry.py", "shape.py"], flat
    assert sorted(p.name for p in (PACKAGE / "engines").iterdir() if p.is_dir() and p.name != "__pycache__") == [
        "speculative", "torch", "vllm"]


def make_recipe(target: str) -> list[str]:
    """The commands of a Makefile target (its tab-indented lines)."""
    lines = (PACKAGE.parent / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_make_test_is_the_quick_tier_and_test_all_runs_everything():
    import tomllib

    options = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(m.startswith("slow:") for m in options["markers"]) and "--strict-markers" in options["addopts"]
    quick = [c for c in make_recipe("test") if "pytest" in c]
    assert quick and all('-m "not slow"' in c for c in quick), quick
    everything = [c for c in make_recipe("test-all") if "pytest" in c]
    assert everything and all(" -m " not in c for c in everything), everything  # slow tests included
    # the whole fault suite, over every test file (pytest's options only, no file or -k selection)
    assert any("BATCHSCORE_FAULTS=all" in c and ("test_faults.py" in c or all(
        word.startswith("-") or word in ("loadfile", "$(TEST_WORKERS)") for word in c.split("pytest", 1)[1].split()))
               for c in everything), everything
    commands = [line.strip() for line in (PACKAGE.parent / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert "make test-all" in commands, commands
    held = [c for c in make_recipe("test-avx2") if "pytest" in c]  # the quick tier on an AVX2-only CPU's kernels
    assert held and all("ONEDNN_MAX_CPU_ISA=AVX2" in c and "ATEN_CPU_CAPABILITY=avx2" in c for c in held), held
    assert "make test-avx2" in commands, commands


def test_the_module_map_names_every_module():
    """docs/design.md ends with the module map: a newcomer's index of the code, kept true."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    missing = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                     if "__pycache__" not in p.parts and f"`{p.relative_to(PACKAGE.parent)}`" not in text)
    assert not missing, f"add these to the module map in docs/design.md: {missing}"


def folder_graph() -> dict[str, set[str]]:
    """folder -> the folders its modules import (`batchscore/<folder>/`; top-level modules left out)."""
    folders: dict[str, set[str]] = {}
    for source, targets in import_graph().items():
        parts = source.split(".")
        if len(parts) < 3 or not (PACKAGE / parts[1]).is_dir():
            continue
        for target in targets:
            other = target.split(".")
            if len(other) >= 2 and (PACKAGE / other[1]).is_dir() and other[1] != parts[1]:
                folders.setdefault(parts[1], set()).add(other[1])
    return folders


def test_the_folder_graph_is_acyclic():
    """No two folders import each other, however indirectly: the stage folders are shared
    machinery below the adapters (tasks/ above prepare/, output/ and report/, which reach a task
    only through the registry in task.py)."""
    folders = folder_graph()
    assert "prepare" in folders["tasks"] and "report" in folders["tasks"]  # the graph sees the tasks' imports
    assert find_cycle(folders) is None


def test_no_variant_imports_a_sibling_variant():
    """A wire format's module never imports another format's, nor an engine kind's package another
    kind's, nor a task's module another task's: each is an adapter behind its registry, and shares
    only the stage folders."""
    from batchscore.engines.registry import BUILT_IN as KINDS
    from batchscore.formats.registry import BUILT_IN as FORMATS
    from batchscore.task import BUILT_IN as TASKS

    graph = import_graph()
    kind_packages = {module.rpartition(".")[0] for module in KINDS}  # batchscore.engines.torch, …vllm
    task_roots = {".".join(module.split(".")[:3]) for module in TASKS}  # batchscore.tasks.labels, …questions
    assert len(task_roots) == len(TASKS) >= 2
    crossing = []
    for module in FORMATS:
        crossing += [(module, t) for t in graph[module] if t in FORMATS and t != module]
    for roots in (kind_packages, task_roots):
        for package in roots:
            for source in (m for m in graph if m == package or m.startswith(package + ".")):
                crossing += [(source, t) for t in graph[source] for other in roots - {package}
                             if t == other or t.startswith(other + ".")]
    assert not crossing, crossing


QUESTIONS_TASK = PACKAGE / "tasks" / "questions"


def question_column_names(source: str, parts: set[str]) -> list[str]:
    """The places in `source` that build a questions column's name: an f-string `{key}.<part>`
    (`{key}.p_yes`, `{q.key}.p.{option}`) or a suffix literal `".<part>"` / `".<part>."`, for the
    parts a question's columns have."""
    suffixes = {f".{p}" for p in parts} | {f".{p}." for p in parts}
    tree = ast.parse(source)
    in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for before, after in zip(node.values, node.values[1:]):
                part = re.match(r"\.(\w+)", str(after.value)) if isinstance(after, ast.Constant) else None
                if isinstance(before, ast.FormattedValue) and part and part.group(1) in parts:
                    found.append(f"line {node.lineno}: f-string {{…}}{after.value}")
        elif isinstance(node, ast.Constant) and id(node) not in in_fstrings and node.value in suffixes:
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_the_detector_finds_a_questions_column():
    parts = {"p_yes", "status", "p"}
    assert question_column_names('name = f"{key}.p_yes"', parts) == ['line 1: f-string {…}.p_yes']
    assert question_column_names('names = [f"{q.key}.p.{o}" for o in options]', parts)
    assert question_column_names('SUFFIXES = (".status", ".p.")', parts) == ["line 1: '.status'", "line 1: '.p.'"]
    assert question_column_names('note = f"{q.key}.status is what it says"', parts)
    assert question_column_names('x = f"{path}.{key}"; y = f"{name}.manifest.json"; z = ".json"', parts) == []


def test_nothing_outside_the_questions_task_names_its_columns():
    """A questions output's columns (`<id>.<part>`) are named by tasks/questions/columns.py alone:
    no module elsewhere builds one, so their layout can change in one place."""
    from batchscore.tasks.questions import columns

    parts = {value for name, value in vars(columns).items()
             if name.isupper() and isinstance(value, str) and name != "NOT_ASKED"}
    assert {"status", "p_yes", "choice", "p", "p_cal"} <= parts
    found = {str(path.relative_to(PACKAGE.parent)): hits for path in PACKAGE.rglob("*.py")
             if QUESTIONS_TASK not in path.parents and (hits := question_column_names(path.read_text(), parts))}
    assert not found, f"name questions columns through batchscore/tasks/questions/columns.py: {found}"
    inside = [hit for path in QUESTIONS_TASK.glob("*.py") if path.name != "columns.py"
              for hit in question_column_names(path.read_text(), parts)]
    assert not inside, f"tasks/questions/ names its columns with columns.column(): {inside}"


# ---------------------------------------------------------------------------- variants live in their adapters

def _docstring_ids(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def compared_names(tree: ast.AST, names: set[str]) -> list[str]:
    """The places a comparison (==, !=, in, not in) names one of `names` as a string literal."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found += [f"line {node.lineno}: {v.value!r}" for v in values
                          if isinstance(v, ast.Constant) and v.value in names]
    return found


def written_literal(tree: ast.AST, text: str) -> list[str]:
    """The places the string literal `text` is written (docstrings aside)."""
    docs = _docstring_ids(tree)
    return [f"line {n.lineno}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value == text and id(n) not in docs]


def _modules_outside(*folders: str) -> dict[str, ast.AST]:
    return {str(p.relative_to(PACKAGE.parent)): _tree(p) for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts and not any((PACKAGE / f) in p.parents for f in folders)}


def test_the_variant_detectors_find_what_they_count():
    tree = ast.parse('"""custom_id"""\na = x == "jsonl"; b = fmt in ("parquet", "csv"); c = {"custom_id": 1}')
    assert compared_names(tree, {"jsonl", "parquet"}) == ["line 2: 'jsonl'", "line 2: 'parquet'"]
    assert written_literal(tree, "custom_id") == ["line 2"]  # the docstring is prose, not a key


def test_variant_names_stay_in_their_adapters():
    """Wire formats and engine kinds answer what the stages ask of them (formats/registry.py,
    engines/registry.py): outside formats/ (and the benchmarks) at most two modules compare a format
    name or write the Batch API's "custom_id"; outside engines/ at most one compares an engine kind."""
    from batchscore.engines.registry import kinds
    from batchscore.formats.registry import formats

    outside_formats = _modules_outside("formats", "bench")
    custom_id = {m: hits for m, tree in outside_formats.items() if (hits := written_literal(tree, "custom_id"))}
    assert len(custom_id) <= 2, custom_id
    format_names = {m: hits for m, tree in outside_formats.items() if (hits := compared_names(tree, set(formats())))}
    assert len(format_names) <= 2, format_names
    outside_engines = _modules_outside("engines", "bench")
    kind_names = {m: hits for m, tree in outside_engines.items() if (hits := compared_names(tree, set(kinds())))}
    assert len(kind_names) <= 1, kind_names


def test_one_version_string():
    """batchscore/version.py holds the version pyproject.toml declares (the package's metadata)."""
    import tomllib

    from batchscore.version import __version__

    declared = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["version"]
    assert __version__ == declared


def task_name_comparisons(tree: ast.AST, names: set[str]) -> list[str]:
    """The places a task's name (`<…>.task.name`, `task_name`) is compared with a task's name:
    a stage asking which task it serves instead of asking the task (task.py's attributes)."""
    def is_task_name(node) -> bool:
        return ((isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Attribute)
                 and node.value.attr == "task") or (isinstance(node, ast.Attribute) and node.attr == "task_name")
                or (isinstance(node, ast.Name) and node.id == "task_name"))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(is_task_name(side) for side in [node.left, *node.comparators]):
            found += [f"line {node.lineno}" for side in [node.left, *node.comparators]
                      for v in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side])
                      if isinstance(v, ast.Constant) and v.value in names]
    return found


def test_no_stage_compares_a_task_name():
    """Outside tasks/ no module compares a task's name: the stages ask the task (`read_into`,
    `window_columns`, `read_segment`, …; task.py)."""
    from batchscore.task import tasks

    names = set(tasks())
    assert task_name_comparisons(ast.parse('a = job.task.name == "labels"; b = source.task.name in ("questions",)'),
                                 names) == ["line 1", "line 1"]
    found = {m: hits for m, tree in _modules_outside("tasks").items() if (hits := task_name_comparisons(tree, names))}
    assert not found, found


def test_stages_reach_tasks_through_the_registry():
    """No module outside tasks/ (and the bench wing, which measures tasks' own pieces) imports a
    task module: the stages ask the job's task (task.py), so a new task is one module."""
    bad = sorted((source, target) for source, targets in import_graph().items() for target in targets
                 if target.startswith("batchscore.tasks") and not source.startswith(("batchscore.tasks",
                                                                                      "batchscore.bench")))
    assert not bad, bad


def calls_named(tree: ast.AST, names: set[str]) -> list[str]:
    """The lines that call a function of one of `names` (`f(…)` or `module.f(…)`)."""
    return [f"line {node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Call)
            and ((isinstance(node.func, ast.Name) and node.func.id in names)
                 or (isinstance(node.func, ast.Attribute) and node.func.attr in names))]


def test_one_planner_runs_jobs():
    """Every job plans through the metadata planner (plan/metadata.plan_rows over the token store);
    the tree planner (`build_plan`) is the oracle the tests hold it to and a benchmark's reference,
    never called by a stage. No run chooses between two data paths any more."""
    assert calls_named(ast.parse("p = build_plan(r)\nq = plan.build_plan(r, o)"), {"build_plan"}) == ["line 1", "line 2"]
    outside = {name: path for name, path in _modules().items()
               if not name.startswith(("batchscore.plan", "batchscore.bench"))}
    found = {m: hits for m, path in outside.items() if (hits := calls_named(_tree(path), {"build_plan"}))}
    assert not found, found
    assert not [m for m, path in _modules().items() if "reads_from_store" in path.read_text()]
