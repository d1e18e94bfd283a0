"""The questions task's reads through the fast paths, on the shipped decisions job, a `questions:`
table job and a batch file of System One, OpenAI Decisions, chat, forged and broken lines: labels
tokenized after each read's prompt tail (prepare/tail_tokens.py) give the ids of the full encode,
and the token store built streaming (each input batch's reads written, then dropped) equals the
store written from the whole read."""

from __future__ import annotations

import numpy as np
import pytest

from batchscore.jobfile import load_job, parse_set_options
from batchscore.prepare.prompts import PromptRenderer
from batchscore.run.open import open_job
from batchscore.store.build import build_store
from batchscore.store.tokens import StoreWriter
from tests.conftest import REPO
from tests.test_decisions import TICKETS, batch_lines, table_job, write_batch_input, write_yaml


def _reads(job):
    """(each read's row id, prompt ids and option ids; the read errors) of `job`."""
    config = load_job(str(job), {})
    source = open_job(config, for_output=False)
    prepared = source.task.prepare(config, source, True, None).input
    requests = [(r.row_id, r.token_ids.tolist(), None if r.options is None else
                 (r.options.tokens.tolist(), r.options.offsets.tolist())) for r in prepared.requests]
    return requests, dict(prepared.errors)


@pytest.fixture(scope="module")
def question_jobs(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("question_store")
    source = write_batch_input(folder, batch_lines(tokenizer))
    batch = write_yaml(folder / "batch.yaml", {
        "input": {"path": str(source), "format": "openai_batch"}, "labels": ["Yes", "No"],
        "model": "smollm2-135m-instruct", "output": {"path": str(folder / "out.jsonl")}})
    rows = [dict(t, ticket_id=f"{t['ticket_id']}-{i}", body=t["body"] + " again" * i)
            for i, t in enumerate(TICKETS * 3)]
    return {"table": table_job(folder / "table", rows, 4096), "batch": batch}


@pytest.mark.parametrize("kind", ["table", "batch"])
def test_labels_after_the_prompt_tail_equal_the_full_encode(question_jobs, kind, monkeypatch):
    taken = []
    encode_cuts = PromptRenderer.encode_cuts

    def counted(self, prompts):
        ids, cuts = encode_cuts(self, prompts)
        taken.extend(c is not None for c in cuts)
        return ids, cuts

    monkeypatch.setattr(PromptRenderer, "encode_cuts", counted)
    fast = _reads(question_jobs[kind])
    assert sum(taken) >= len(taken) - 2 > 0  # every read but the forged ones took the tail path
    monkeypatch.setattr(PromptRenderer, "encode_cuts", lambda self, prompts: (encode_cuts(self, prompts)[0],
                                                                              [None] * len(prompts)))
    full = _reads(question_jobs[kind])
    assert fast == full and len(fast[0]) > 10


def _whole_read_store(source, folder):
    """The store as it was written before streaming: every read in memory, then written."""
    job = source.task.prepare(source.config, source, True, None)
    writer = StoreWriter(folder, source.identity)
    requests, record_of = job.input.requests, job.input.record_of
    for start in range(0, len(requests), 8192):  # a record's reads, cut between calls too, share its state once
        batch = requests[start:start + 8192]
        writer.add_requests(batch, groups=[int(record_of[r.row_id]) for r in batch])
    writer.add_errors(sorted(job.input.errors.items()))
    return job, writer.close(job.input.num_rows, extra={"label_ids": job.label_ids, "content_free": False})


@pytest.mark.parametrize("kind, batch_rows, per_call", [("shipped", 8192, 8192), ("table", 2, 8192),
                                                      ("table", 8192, 4), ("batch", 3, 5)])
def test_the_store_built_streaming_equals_the_whole_read(question_jobs, kind, batch_rows, per_call, tmp_path,
                                                         monkeypatch):
    """`per_call`: reads tokenized at once while streaming (a batch's reads cut into calls)."""
    from batchscore.tasks.questions import reads

    job_file = REPO / "jobs" / "decisions.yaml" if kind == "shipped" else question_jobs[kind]
    config = load_job(str(job_file), parse_set_options((f"input.batch_rows={batch_rows}",)))
    source = open_job(config, for_output=False)
    with monkeypatch.context() as patch:
        patch.setattr(reads, "READS_PER_CALL", per_call)
        streamed, store = build_store(source, tmp_path / "streamed", reuse=False)
    whole, reference = _whole_read_store(source, tmp_path / "whole")
    assert streamed.input.requests == [] and len(whole.input.requests) == store.num_rows > 10
    for name in ("tokens.u16", "tokens.i32", "offsets.i64", "row_ids.i64", "option_set.i32", "errors.jsonl", "head_starts.i64",
                 "head_lengths.i32", "manifest.json"):
        assert (store.folder / name).exists() == (reference.folder / name).exists(), name
        if (store.folder / name).exists():
            assert (store.folder / name).read_bytes() == (reference.folder / name).read_bytes(), name
    with np.load(store.folder / "option_sets.npz") as a, np.load(reference.folder / "option_sets.npz") as b:
        assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    # what the output is assembled from: records, ids, kept columns, each read's prompt length, errors
    mine, theirs = streamed.input, whole.input
    assert mine.errors == theirs.errors and mine.num_rows == theirs.num_rows
    assert np.array_equal(mine.record_of, theirs.record_of)
    assert mine.task_input.records == theirs.task_input.records
    assert mine.task_input.ids.equals(theirs.task_input.ids) and mine.task_input.kept.equals(theirs.task_input.kept)
    assert mine.task_input.read_tokens == theirs.task_input.read_tokens


def test_a_questions_table_job_scores_from_the_store(tmp_path, monkeypatch):
    """The run path: a `questions:` job with a table output is planned and scored from the token
    store (built once), a record's error kept by name beside the scored records."""
    import pyarrow.parquet as pq

    import batchscore.run.runner as runner
    from batchscore.run.runner import run_job

    broken = {"ticket_id": "broken", "subject": "x", "body": "a lone \ud83d surrogate"}  # the record's error
    job_file = table_job(tmp_path, TICKETS + [broken], 4096)
    built = []
    monkeypatch.setattr(runner, "build_store", lambda *a, **k: built.append(1) or build_store(*a, **k))
    job = load_job(str(job_file), {"output.max_error_rate": "0.5"}, output=str(tmp_path / "store.parquet"))
    summary = run_job(job, progress=False)
    assert (summary.rows, summary.rows_error) == (3, 1)
    output = pq.read_table(tmp_path / "store.parquet")
    assert built == [1] and output.num_rows == 3 \
        and "tickets.jsonl:3: field 'body'" in output.column("error")[2].as_py()
    assert output.column("status").to_pylist()[:2] == ["ok", "ok"]

def _records_and_suffixes(store, record_of) -> int:
    """What a record's reads hold once written as a person would: each record's own tokens (its
    reads' common prefix) once, plus each read's tokens after it."""
    total = 0
    row_records = np.asarray(record_of)[np.asarray(store.row_ids)]
    for record in np.unique(row_records):
        rows = [store.tokens_of(int(p)) for p in np.flatnonzero(row_records == record)]
        common = min(len(r) for r in rows)
        for row in rows[1:]:
            differ = np.flatnonzero(row[:common] != rows[0][:common])
            common = int(differ[0]) if len(differ) else common
        total += common + sum(len(r) - common for r in rows)
    return total


def _question_store(folder, records: int):
    rows = [dict(TICKETS[i % 2], ticket_id=f"t{i}", body=TICKETS[i % 2]["body"] + f" (order {i})") for i in range(records)]
    config = load_job(str(table_job(folder, rows, 4096)), {})
    return build_store(open_job(config, for_output=False), folder / "store", reuse=False)


@pytest.mark.parametrize("records", [40, pytest.param(2000, marks=pytest.mark.slow)])
def test_a_record_s_state_is_stored_once(tmp_path, records):
    """A questions job's store holds each record's chat header and state once and each read's own
    tokens beside it (3 questions: the rows hold ~1.7x that), and every read still reads whole."""
    job, store = _question_store(tmp_path, records)
    assert store.num_rows == 3 * records
    expected = _records_and_suffixes(store, job.input.record_of)
    assert store.stored_tokens == expected  # <= 1.2x is the bound; written once it is exactly 1x
    assert store.logical_tokens == int(store.lengths.sum()) > 1.5 * store.stored_tokens
    assert store.tokens_path.stat().st_size == 2 * store.stored_tokens  # ids below 65,536: 2 bytes each
    # the reads are what tokenizing each prompt whole gives (the whole-read store holds them that way)
    source = open_job(load_job(str(tmp_path / "job.yaml"), {}), for_output=False)
    reads = source.task.prepare(source.config, source, True, None).input.requests
    assert [r.token_ids.tolist() for r in reads] == [store.tokens_of(p).tolist() for p in range(store.num_rows)]
