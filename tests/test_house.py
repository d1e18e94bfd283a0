"""The house's shape, checked: a run opens its job once (run/open.py: the task decided by one
`task_for`, the output's files named once) and no task calls back into the stages that call it."""

from __future__ import annotations

import sys

from batchscore import task as task_module
from batchscore.output.layout import OutputFiles

from .test_layout import import_graph


def _count_calls(monkeypatch, original, name: str) -> list:
    """Replace `original` (a module function called `name`) wherever a batchscore module holds it,
    by a wrapper that records each call; returns the record."""
    calls: list = []

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for module in list(sys.modules.values()):
        if (getattr(module, "__name__", "") or "").startswith("batchscore") and getattr(module, name, None) is original:
            monkeypatch.setattr(module, name, counted)
    return calls


def test_a_run_decides_its_task_once_and_names_its_output_files_once(monkeypatch, small_input, job_factory):
    import batchscore.run.runner  # noqa: F401  (every stage imported before the count starts)
    from batchscore.jobfile import load_job
    from batchscore.run.runner import run_job

    config = load_job(job_factory(small_input))
    task_calls = _count_calls(monkeypatch, task_module.task_for, "task_for")
    named = []
    for_job = OutputFiles.for_job.__func__
    monkeypatch.setattr(OutputFiles, "for_job", classmethod(lambda cls, job, error_file: named.append(job)
                                                             or for_job(cls, job, error_file)))
    summary = run_job(config, progress=False)
    assert summary.complete and summary.rows == 12
    assert len(task_calls) == 1, f"task_for called {len(task_calls)} times in one run"
    assert len(named) == 1, f"OutputFiles.for_job called {len(named)} times in one run"


def test_a_job_file_is_checked_with_one_task_for(monkeypatch, small_input, job_factory):
    from batchscore.jobfile import load_job

    calls = _count_calls(monkeypatch, task_module.task_for, "task_for")
    load_job(job_factory(small_input))
    assert len(calls) == 1


def test_no_task_reaches_back_into_the_stages_that_call_it():
    """`prepare_job` (run/open.py) calls `task.prepare`, and the job-file reader calls a task's
    checks: nothing a task imports, however indirectly, leads back to prepare/job.py or jobfile.py."""
    graph = import_graph()

    def reachable(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for target in graph.get(stack.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        return seen

    tasks = [m for m in graph if m.startswith("batchscore.tasks")]
    assert len(tasks) > 5 and "batchscore.prepare.read" in reachable("batchscore.tasks.labels")  # the walk sees imports
    back = {m: sorted(hit) for m in tasks if (hit := reachable(m) & {"batchscore.prepare.job", "batchscore.jobfile"})}
    assert not back, back
