"""The task registry: every stage asks the job's task (task.py) instead of telling labels and
questions jobs apart itself, and a new task is one module plus its registration."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from batchscore.errors import JobConfigError
from batchscore.formats import discover_files
from batchscore.jobfile import config_from_dict, load_job
from batchscore.task import Task, TaskPage, get_task, page_for_output, register, task_for, tasks, unregister

ROOT = Path(__file__).resolve().parent.parent


def test_the_built_in_tasks_and_which_job_each_runs():
    assert list(tasks()) == ["questions", "labels"]
    assert get_task("labels").default and not get_task("questions").default
    assert task_for(load_job(ROOT / "jobs" / "sample.yaml")).name == "labels"
    assert task_for(load_job(ROOT / "jobs" / "decisions.yaml")).name == "questions"
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        get_task("nope")


def test_decision_lines_make_an_openai_batch_job_a_questions_job_once_its_files_are_known(tmp_path):
    """The job file alone says nothing of an openai_batch file's lines: its checks run the labels
    task's (labels optional); reading its files finds the decision lines, and the questions task runs it."""
    lines = tmp_path / "batch.jsonl"
    lines.write_text((ROOT / "sample_data" / "decisions_batch.jsonl").read_text().splitlines()[0] + "\n")
    config = config_from_dict({"input": {"path": str(lines), "format": "openai_batch"},
                               "output": {"path": str(tmp_path / "out.jsonl")}})
    assert task_for(config).name == "labels"
    assert task_for(config, discover_files(str(lines), "openai_batch")).name == "questions"
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    chat_config = config_from_dict({"input": {"path": str(chat), "format": "openai_batch"}, "labels": ["Yes", "No"],
                                    "output": {"path": str(tmp_path / "out2.jsonl")}})
    assert task_for(chat_config, discover_files(str(chat), "openai_batch")).name == "labels"


def _toy_page_render(path, table, metrics, note, *, previous=None, truth=None) -> str:
    return "<html>toy</html>"


def _toy_task() -> Task:
    """A task that claims jobs whose labels are [ping, pong], and refuses them (its own check)."""
    labels = get_task("labels")

    def claims(config, files) -> bool:
        return list(config.labels) == ["ping", "pong"]

    def job_problems(config) -> list[str]:
        return ["labels: the toy task refuses ping and pong"]

    page = TaskPage(owns=lambda columns: "toy.answer" in columns, render=_toy_page_render, table=lambda t: t,
                    owns_line=lambda line: False, lines_table=lambda lines, failed: None,
                    lines_left_out=lambda count: "")
    return Task(name="toy", claims=claims, job_problems=job_problems, output_columns=labels.output_columns,
                quality_problems=labels.quality_problems, check_calibration_source=labels.check_calibration_source,
                prepare=labels.prepare, assemble=labels.assemble, summary=labels.summary, row_name=labels.row_name,
                page=page)


def test_a_new_task_is_asked_by_the_job_file_and_the_report_without_touching_them(tmp_path):
    raw = {"input": {"path": str(ROOT / "sample_data" / "relevance.parquet")}, "prompt": {"template": "{query}"},
           "output": {"path": str(tmp_path / "out.parquet")}}
    register(_toy_task())
    try:
        assert list(tasks())[-1] == "toy"  # after the built-in ones
        with pytest.raises(JobConfigError, match="the toy task refuses ping and pong"):
            config_from_dict({**raw, "labels": ["ping", "pong"]})
        assert task_for(config_from_dict({**raw, "labels": ["Yes", "No"]})).name == "labels"
        assert page_for_output(["id", "toy.answer"]).render(None, pa.table({}), None, "") == "<html>toy</html>"
        assert page_for_output(["id", "p_yes", "p_no", "label", "status"]) is None  # a labels output: the report's own page
    finally:
        unregister("toy")
    assert "toy" not in tasks()
    config_from_dict({**raw, "labels": ["ping", "pong"]})  # the labels task has nothing against them
