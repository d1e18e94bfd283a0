"""Typed row errors (batchscore/row_errors.py): a row's error is its message with a kind beside it,
kept through the parts, and the kind (never the text) picks a failed request's HTTP status."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from batchscore.formats.openai_batch import ERROR_STATUS, error_response
from batchscore.plan.validate import prompt_problem
from batchscore.row_errors import FAILED, INPUT, KINDS, NOT_SCORED, TOO_LONG, RowError, kind_of, no_result


def test_a_row_error_is_its_message_with_a_kind():
    error = RowError(TOO_LONG, "prompt is 9 tokens, longer than the maximum 8")
    assert error == "prompt is 9 tokens, longer than the maximum 8" and error.kind == TOO_LONG
    assert error.at("in.jsonl:3") == "in.jsonl:3: prompt is 9 tokens, longer than the maximum 8"
    assert error.at("in.jsonl:3").kind == TOO_LONG
    assert pickle.loads(pickle.dumps(error)).kind == TOO_LONG  # Ray workers send results back pickled
    assert json.dumps({"error": error}) == json.dumps({"error": str(error)})
    assert kind_of("a plain message") == INPUT and kind_of(None) is None
    with pytest.raises(ValueError, match="unknown row error kind"):
        RowError("typo", "x")


def test_prompt_problem_says_which_kind():
    assert prompt_problem(9, 8).kind == TOO_LONG
    assert prompt_problem(0, 8).kind == INPUT
    assert prompt_problem(3, 8, largest_token=50, vocab_size=10).kind == INPUT
    assert prompt_problem(3, 8) is None


def test_the_kind_picks_the_status_not_the_text():
    assert set(ERROR_STATUS) == set(KINDS)
    statuses = {kind: error_response("k", RowError(kind, "not scored: no result from the engine longer than the maximum"))
                for kind in KINDS}
    assert statuses[TOO_LONG]["status_code"] == 400
    assert statuses[TOO_LONG]["body"]["error"]["code"] == "context_length_exceeded"
    assert statuses[NOT_SCORED]["status_code"] == 500 and statuses[NOT_SCORED]["body"]["error"]["code"] == "not_scored"
    assert statuses[FAILED]["status_code"] == 500 and statuses[FAILED]["body"]["error"]["code"] == "scoring_failed"
    assert statuses[INPUT]["status_code"] == 400 and statuses[INPUT]["body"]["error"]["code"] == "invalid_request"
    assert error_response("k", no_result())["body"]["error"]["message"] == "not scored: no result from the engine"


def test_parts_keep_each_errors_kind(tmp_path):
    from batchscore.output.layout import OutputFiles
    from batchscore.output.parts import Manifest, PartStore

    store = PartStore(OutputFiles(str(tmp_path / "out.parquet")))
    manifest = store.start(Manifest("h", {}, 2, 4, {"0": 4}), fresh=True,
                           input_errors={1: RowError(TOO_LONG, "in.jsonl:2: too long"), 3: "bad"})
    store.write_part(manifest, np.array([0, 2]), [np.array([np.nan, np.nan]), np.log([0.5, 0.5])], [None, None],
                     {0: "engine refused it"}, start=0, end=2)
    _, errors = store.read_results([manifest], 4)
    assert errors == {1: "in.jsonl:2: too long", 3: "bad", 0: "engine refused it"}
    assert {row: error.kind for row, error in errors.items()} == {1: TOO_LONG, 3: INPUT, 0: FAILED}
