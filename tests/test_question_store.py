"""The questions task's reads through the fast paths: labels tokenized after each read's prompt
tail (prepare/tail_tokens.py) give the ids of the full encode, on a `questions:` table job and on
a batch file of System One, OpenAI Decisions, chat, forged and broken lines."""

from __future__ import annotations

import json

import pytest

from batchscore.jobfile import load_job
from batchscore.prepare.prompts import PromptRenderer
from batchscore.run.open import open_job
from tests.test_decisions import TICKETS, batch_lines, table_job, write_yaml


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
    lines = batch_lines(tokenizer)
    source = folder / "decisions_in.jsonl"
    source.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
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
