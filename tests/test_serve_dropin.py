"""`batchscore serve` as a drop-in for the OpenAI Batch API: the model served under other names
(`--served-model-name`, as vLLM's), the routes' OpenAI shapes (file listing, unknown routes and
methods), a duplicate custom_id's line, no empty output file, and a log that says what the server
does. The slow test drives the real server with the official `openai` client, lines naming
gpt-4o-mini, and runs the shipped batch samples as the docs show them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from batchscore.serve.requests import sort_lines
from batchscore.serve.store import Store
from tests.test_serve import KEY, LABELS, MODEL, Server, _free_port, chat_line, wait_for

REPO = Path(__file__).resolve().parent.parent


def test_served_model_names_are_the_names_requests_may_give(tmp_path):
    from batchscore.errors import JobConfigError
    from batchscore.serve.server import ServeOptions, served_names

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([chat_line("a", "x", model="gpt-4o-mini"), chat_line("b", "x", model="gpt-4o"),
                               chat_line("c", "x", model=None), chat_line("d", "x", model=MODEL)]) + "\n")
    result = sort_lines(path, "in.jsonl", "/v1/chat/completions", ["gpt-4o-mini", "gpt-4o"], ["Yes", "No"], 10)
    assert [sorted(job.lines) for job in result.jobs] == [[1, 2, 3]]
    [refused] = [json.loads(line) for line in result.answered]  # vLLM's rule: the served names only
    assert refused["custom_id"] == "d"
    assert "in.jsonl:4: body.model: \"smollm2-135m-instruct\" is not a model this server serves ('gpt-4o-mini', " \
           "'gpt-4o'" in refused["response"]["body"]["error"]["message"]
    assert served_names(ServeOptions(state_dir="s")) == [MODEL]
    assert served_names(ServeOptions(state_dir="s", served_model_names=["gpt-4o-mini", "b", "gpt-4o-mini"])) == \
        ["gpt-4o-mini", "b"]
    with pytest.raises(JobConfigError, match="may not be empty"):
        served_names(ServeOptions(state_dir="s", served_model_names=[" "]))


def test_answers_show_the_served_name_and_a_repeated_custom_id_its_line(tmp_path):
    from batchscore.serve.results import job_lines

    work = tmp_path / "batch_x"
    (work / "job0").mkdir(parents=True)
    (work / "filename").write_text("in.jsonl")
    answer = {"id": "batch_req_1", "custom_id": "a", "error": None,
              "response": {"status_code": 200, "body": {"object": "chat.completion", "model": MODEL}}}
    (work / "job0" / "output.jsonl").write_text(json.dumps(answer) + "\n")
    ok, _ = job_lines(work, 1, shown_model="gpt-4o-mini")
    assert json.loads(ok[0])["response"]["body"]["model"] == "gpt-4o-mini"
    assert job_lines(work, 1)[0] == [json.dumps(answer)]  # no other name: as the job wrote it

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([chat_line("a", "x"), chat_line("b", "y"), "", chat_line("a", "z")]) + "\n")
    [problem] = sort_lines(path, "in.jsonl", "/v1/chat/completions", MODEL, ["Yes", "No"], 10).problems
    assert problem["code"] == "duplicate_custom_id" and problem["line"] == 4 and "first on line 1" in problem["message"]


def test_routes_list_files_and_answer_unknown_routes_in_openais_shape(tmp_path, caplog):
    from fastapi.testclient import TestClient

    from batchscore.serve.app import Limits, create_app
    from batchscore.serve.worker import Worker, WorkerSettings

    store = Store(tmp_path / "state")
    worker = Worker(store, WorkerSettings(model=MODEL, served_names=["gpt-4o-mini"]))  # not started
    client = TestClient(create_app(store, worker, KEY, "gpt-4o-mini", Limits()))
    auth = {"Authorization": f"Bearer {KEY}"}
    caplog.set_level(logging.INFO, logger="batchscore.serve")
    ids = [client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                       files={"file": (f"in{i}.jsonl", chat_line(f"a{i}", "Yes?") + "\n")}).json()["id"] for i in range(3)]
    listed = client.get("/v1/files", headers=auth).json()
    assert listed["object"] == "list" and [f["id"] for f in listed["data"]] == ids[::-1] and not listed["has_more"]
    page = client.get("/v1/files?limit=2&order=asc&purpose=batch", headers=auth).json()
    assert [f["id"] for f in page["data"]] == ids[:2] and page["has_more"] and page["last_id"] == ids[1]
    assert [f["id"] for f in client.get(f"/v1/files?order=asc&after={ids[1]}", headers=auth).json()["data"]] == ids[2:]
    assert client.get("/v1/files?purpose=batch_output", headers=auth).json()["data"] == []
    assert client.get("/v1/files?limit=0", headers=auth).json()["error"]["param"] == "limit"

    missing = client.get("/v1/nowhere", headers=auth)
    assert missing.status_code == 404 and missing.json() == {"error": {
        "message": "Invalid URL (GET /v1/nowhere)", "type": "invalid_request_error", "param": None, "code": "not_found"}}
    wrong = client.put("/v1/files", headers=auth)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert set(wrong.json()["error"]) == {"message", "type", "param", "code"} and "PUT /v1/files" in wrong.json()["error"]["message"]
    assert wrong.headers["allow"] in wrong.json()["error"]["message"]  # the methods it takes

    batch = client.post("/v1/batches", headers=auth, json={"input_file_id": ids[0], "endpoint": "/v1/chat/completions",
                                                           "completion_window": "24h", "metadata": {"labels": LABELS}})
    assert batch.json()["model"] == "gpt-4o-mini"  # the first served name, as vLLM shows it
    store.update_batch(batch.json()["id"], status="in_progress", request_counts={"total": 1, "completed": 0, "failed": 0})
    said = [r.getMessage() for r in caplog.records]
    assert "GET /v1/nowhere 404" in " ".join(said) and any(m.startswith("POST /v1/files 200") for m in said)
    assert f"batch {batch.json()['id']}: validating (/v1/chat/completions, input {ids[0]})" in said
    assert f"batch {batch.json()['id']}: validating -> in_progress (requests: 1 total, 0 completed, 0 failed)" in said


def test_a_batch_with_no_answered_request_has_no_output_file(tmp_path):
    from batchscore.serve.worker import Worker, WorkerSettings

    store = Store(tmp_path / "state")
    (store.work / "batch_x").mkdir(parents=True)
    worker = Worker(store, WorkerSettings(model=MODEL))
    failed = json.dumps({"id": "batch_req_1", "custom_id": "a", "response": {"status_code": 400, "body": {}}})
    assert worker._result_files("batch_x", [], [failed]) == {"output_file_id": None,
                                                              "error_file_id": "file-x-error"}
    assert worker._result_files("batch_x", [], [])["error_file_id"] is None


TEAMS = ["billing", "shipping", "security", "other"]
ALIASES = ("gpt-4o-mini", "jev-latest", "gpt-6-luna")  # the models the shipped samples name


@pytest.mark.slow  # a real server process, the three shipped batch samples on the real model
def test_the_openai_client_and_the_shipped_samples_run_unchanged_against_serve(tmp_path, tokenizer):
    """As docs/operations.md shows it: `serve --served-model-name gpt-4o-mini ...`, the samples
    uploaded as they are, one batch per file (one endpoint each)."""
    import openai

    extra = [arg for name in ALIASES for arg in ("--served-model-name", name)]
    server = Server(tmp_path / "state", _free_port(), extra=tuple(extra))
    server.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)
    try:
        batches = {}
        for name, endpoint, metadata in [("chat_batch.jsonl", "/v1/chat/completions", {"labels": json.dumps(TEAMS)}),
                                         ("systemone_batch.jsonl", "/v1/systemone", None),
                                         ("decisions_batch.jsonl", "/v1/decisions", None)]:
            upload = client.files.create(file=open(REPO / "sample_data" / name, "rb"), purpose="batch")
            batches[name] = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h",
                                                  **({"metadata": metadata} if metadata else {}))
        assert batches["chat_batch.jsonl"].model == "gpt-4o-mini"
        sent = {json.loads(line)["custom_id"]: json.loads(line)
                for line in (REPO / "sample_data" / "chat_batch.jsonl").read_text().splitlines()}

        done = wait_for(client, batches["chat_batch.jsonl"].id, ("completed", "failed"))
        assert done.status == "completed", done.errors
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
        assert done.error_file_id is None
        answers = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in answers) == sorted(sent)
        for line in answers:
            body = line["response"]["body"]
            assert body["model"] == "gpt-4o-mini" and body["choices"][0]["finish_reason"] == "stop"
            assert body["choices"][0]["message"]["content"] in TEAMS
            prompt = tokenizer.apply_chat_template(sent[line["custom_id"]]["body"]["messages"], tokenize=True,
                                                   add_generation_prompt=True)
            prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
            assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 1
        usage = [x["response"]["body"]["usage"] for x in answers]
        assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usage)  # each prompt once, not per label
        assert 0 < done.usage.input_tokens_details.cached_tokens < done.usage.input_tokens  # the shared system message

        for name, count in [("systemone_batch.jsonl", 6), ("decisions_batch.jsonl", 6)]:
            done = wait_for(client, batches[name].id, ("completed", "failed"))
            assert done.status == "completed", done.errors
            assert (done.request_counts.completed, done.request_counts.failed) == (count, 0), name
            lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
            assert len(lines) == count and all(x["response"]["status_code"] == 200 for x in lines)
            assert {x["response"]["body"]["model"] for x in lines} == {"gpt-4o-mini"}  # vLLM: the first name

        # the server said what it did: where it listens, every request, every batch's moves
        log = (tmp_path / "server.log").read_text()
        assert f"listening on http://127.0.0.1:{server.port}" in log and "POST /v1/batches 200" in log
        for name, batch in batches.items():
            for move in ("validating -> in_progress", "in_progress -> finalizing", "finalizing -> completed"):
                assert f"batch {batch.id}: {move}" in log, (batch.id, move)
            run_log = server.state / "batches" / batch.id / "job0" / "run.log"
            assert " INFO " in run_log.read_text()  # the run's own log, kept beside its job
            assert "built the token store" in run_log.read_text()  # a batch runs the token store's path, as any job
    finally:
        server.stop()


def test_calibration_is_reachable_from_a_batch(tmp_path):
    """A server started with calibration (`--set`), or a batch asking for it in its metadata:
    chat/completions jobs take it, decision jobs (calibrated per question elsewhere) do not."""
    from batchscore.errors import JobConfigError
    from batchscore.serve.requests import JobLines, metadata_calibration
    from batchscore.serve.server import check_job_settings
    from batchscore.serve.worker import Worker, WorkerSettings

    check_job_settings(tmp_path, MODEL, ["score.calibrate=batch"])
    with pytest.raises(JobConfigError) as refused:
        check_job_settings(tmp_path, MODEL, ["score.calibrate=vector"])
    assert "settings-check" not in str(refused.value) and "--model/--set: score.calibrate vector" in str(refused.value)
    assert metadata_calibration({"calibrate": "batch"}, []) == "batch" and metadata_calibration(None, []) is None
    with pytest.raises(ValueError, match="needs a server started with --set calibrate.from"):
        metadata_calibration({"calibrate": "vector"}, [])
    fitted = ["score.calibrate=vector", "calibrate.from=/srv/fits/tickets.parquet", "engine.dtype=float32"]
    assert metadata_calibration({"calibrate": "platt"}, fitted) == "platt"

    store = Store(tmp_path / "state")
    store.add_batch({"id": "batch_c", "status": "validating", "metadata": {"calibrate": "none"}})
    worker = Worker(store, WorkerSettings(model=MODEL, sets=fitted))
    assert worker._job_sets("batch_c", JobLines(["Yes", "No"])) == fitted + ["score.calibrate=none"]  # the batch's wins
    assert worker._job_sets("batch_c", JobLines(None)) == ["engine.dtype=float32"]  # decision lines: not theirs


def test_a_decision_jobs_requests_count_as_their_reads_are_saved(tmp_path):
    """Two System One lines of 3 questions: 6 reads. A line is completed once its 3 reads are in
    parts, failed as soon as one of them failed; not before."""
    import numpy as np
    import yaml

    from batchscore.output.layout import OutputFiles
    from batchscore.output.parts import Manifest, PartStore
    from batchscore.serve.progress import RecordProgress

    folder = tmp_path / "job0"
    (folder / "input").mkdir(parents=True)
    lines = (REPO / "sample_data" / "systemone_batch.jsonl").read_text().splitlines()[:2]
    (folder / "input" / "in.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "job.yaml").write_text(yaml.safe_dump({
        "input": {"path": str(folder / "input" / "in.jsonl"), "format": "openai_batch"}, "model": MODEL,
        "output": {"path": str(folder / "output.jsonl"), "format": "openai_batch"}}))
    output = folder / "output.jsonl"
    progress = RecordProgress(output, folder / "job.yaml")
    assert progress.counts() == (0, 0)
    store = PartStore(OutputFiles(str(output), str(folder / "output.errors.jsonl")))
    manifest = store.start(Manifest(job_hash="h", identity={}, num_groups=1, num_rows=6, worker_rows={"0": 6}),
                           fresh=False, input_errors={})

    def part(rows, errors, start):
        store.write_part(manifest, np.array(rows), [np.array([-0.1, -2.0])] * len(rows), [None] * len(rows),
                         errors, start, start + len(rows))

    part([0, 1], {}, 0)
    assert progress.counts() == (0, 0)  # line 0 has 2 of its 3 reads
    part([2, 3], {3: "not scored"}, 2)
    assert progress.counts() == (1, 1)  # line 0 done; line 1 failed with its first read
    part([4, 5], {}, 4)
    assert progress.counts() == (1, 1)
