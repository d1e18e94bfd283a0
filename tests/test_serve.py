"""`batchscore serve`: the OpenAI Batch API over batchscore's jobs. The quick tests check the
store, the key rules, the sorting of a batch's lines and the routes' shapes in process; the
slow one starts the server as a real process and drives it with the official `openai` package."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from batchscore.errors import APIError, JobConfigError
from batchscore.serve.auth import authorized, resolve_key
from batchscore.serve.requests import metadata_labels, sort_lines
from batchscore.serve.store import Store

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
KEY = "test-key-0123"
LABELS = json.dumps(["Yes", "No"])


def chat_line(custom_id: str, text: str, model: str | None = MODEL, url="/v1/chat/completions") -> str:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    if model is not None:
        body["model"] = model
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# --- quick: store, keys, lines, routes ---------------------------------------------------------


def test_store_keeps_files_and_batches_across_a_reopen(tmp_path):
    store = Store(tmp_path / "state")
    upload = store.incoming_path()
    upload.write_bytes(b'{"a": 1}\n')
    file = store.add_file(upload, "in.jsonl", "batch")
    assert not upload.exists() and store.file_path(file["id"]).read_bytes() == b'{"a": 1}\n'
    assert file["object"] == "file" and file["bytes"] == 9 and file["purpose"] == "batch"
    for i in range(5):
        store.add_batch({"id": f"batch_{i}", "status": "validating", "in_progress_at": None, "cancelled_at": None})
    assert store.update_batch("batch_1", only_from=("validating",), status="in_progress")["in_progress_at"] > 0
    assert store.update_batch("batch_1", only_from=("validating",), status="cancelled") is None  # moved first
    store.close()

    store = Store(tmp_path / "state")  # a restart sees the same state
    assert store.file(file["id"])["filename"] == "in.jsonl"
    assert store.batch("batch_1")["status"] == "in_progress"
    assert [b["id"] for b in store.batches_in(("validating",))] == ["batch_0", "batch_2", "batch_3", "batch_4"]
    page, more = store.list_batches(2, None)  # newest first, then after the last id shown
    assert [b["id"] for b in page] == ["batch_4", "batch_3"] and more
    page, more = store.list_batches(2, "batch_3")
    assert [b["id"] for b in page] == ["batch_2", "batch_1"] and more
    page, more = store.list_batches(2, "batch_1")
    assert [b["id"] for b in page] == ["batch_0"] and not more
    with pytest.raises(APIError) as missing:
        store.batch("batch_9")
    assert missing.value.status == 404 and missing.value.body()["error"]["code"] == "not_found"
    assert store.delete_file(file["id"])["deleted"] is True
    with pytest.raises(APIError):
        store.file(file["id"])


def test_key_rules(tmp_path):
    assert resolve_key(None, False, "0.0.0.0", environ={"BATCHSCORE_API_KEY": " k "}) == "k"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_key(str(key_file), False, "0.0.0.0", environ={"BATCHSCORE_API_KEY": "env"}) == "from-file"
    assert resolve_key(None, True, "127.0.0.1", environ={}) is None
    with pytest.raises(JobConfigError, match="no API key"):
        resolve_key(None, False, "127.0.0.1", environ={})
    with pytest.raises(JobConfigError, match="only with --host 127.0.0.1"):
        resolve_key(None, True, "0.0.0.0", environ={})
    with pytest.raises(JobConfigError, match="give one or the other"):
        resolve_key(None, True, "127.0.0.1", environ={"BATCHSCORE_API_KEY": "k"})
    key_file.write_text("")
    with pytest.raises(JobConfigError, match="empty"):
        resolve_key(str(key_file), False, "127.0.0.1", environ={})
    assert authorized("k", "/v1/batches", "Bearer k") and authorized("k", "/v1/batches", "bearer  k")
    assert not authorized("k", "/v1/batches", None) and not authorized("k", "/v1/batches", "Bearer x")
    assert not authorized("k", "/v1/files", "Basic k") and authorized("k", "/health", None)
    assert authorized(None, "/v1/batches", None)


def test_lines_are_sorted_into_jobs_and_answers(tmp_path):
    lines = [chat_line("a", "Yes or No?"), chat_line("b", "x", model="gpt-4o"), chat_line("c", "x", model=None),
             "", chat_line("d", "x", url="/v1/completions"), "{broken", chat_line("e", "y")]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = sort_lines(path, "in.jsonl", "/v1/chat/completions", MODEL, ["Yes", "No"], max_requests=10)
    assert result.total == 6 and not result.problems
    assert [(job.labels, sorted(job.lines)) for job in result.jobs] == [(["Yes", "No"], [1, 3, 7])]
    answered = {json.loads(line)["custom_id"]: json.loads(line)["response"] for line in result.answered}
    assert set(answered) == {"b", "d", None}
    assert "in.jsonl:2: body.model" in answered["b"]["body"]["error"]["message"]
    assert "in.jsonl:5: url" in answered["d"]["body"]["error"]["message"] and answered["d"]["status_code"] == 400
    no_labels = sort_lines(path, "in.jsonl", "/v1/chat/completions", MODEL, None, max_requests=10)
    assert not no_labels.jobs and len(no_labels.answered) == 6
    path.write_text(chat_line("a", "x") + "\n" + chat_line("a", "y") + "\n")
    assert sort_lines(path, "in.jsonl", "/v1/chat/completions", MODEL, None, 10).problems[0]["code"] == \
        "duplicate_custom_id"
    assert sort_lines(path, "in.jsonl", "/v1/chat/completions", MODEL, None, 1).problems[0]["code"] == \
        "too_many_requests"
    assert metadata_labels({"labels": LABELS}) == ["Yes", "No"] and metadata_labels({"x": "1"}) is None
    for bad in ("Yes,No", '["Yes"]', '["a", "a"]', "[1, 2]"):
        with pytest.raises(ValueError, match="metadata.labels"):
            metadata_labels({"labels": bad})


def test_a_request_may_bring_its_own_labels_as_token_ids(tmp_path, tokenizer):
    from batchscore.serve.token_labels import TokenLabels

    labels = TokenLabels(MODEL)
    ids = [tokenizer.encode(text, add_special_tokens=False)[0] for text in ("True", "False")]
    assert labels(ids) == (["True", "False"], None)
    assert "not in the model's vocabulary" in labels([ids[0], 10**7])[1]
    two_tokens = tokenizer.encode("Strongly", add_special_tokens=False)
    assert len(two_tokens) > 1 or labels(two_tokens + [ids[0]])[0] is not None  # the word may be one token
    own = json.loads(chat_line("own", "True or False?"))
    own["body"]["logprob_token_ids"] = ids
    bad = json.loads(chat_line("bad", "x"))
    bad["body"]["logprob_token_ids"] = [ids[0], ids[0]]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([chat_line("a", "Yes or No?"), json.dumps(own), json.dumps(bad)]) + "\n")
    result = sort_lines(path, "in.jsonl", "/v1/chat/completions", MODEL, ["Yes", "No"], 10, labels)
    assert [(job.labels, job.lines) for job in result.jobs] == [(["Yes", "No"], {1}), (["True", "False"], {2})]
    assert "in.jsonl:3: body.logprob_token_ids: must list two or more distinct" in result.answered[0]


def test_routes_answer_with_the_api_shapes(tmp_path):
    from fastapi.testclient import TestClient

    from batchscore.serve.app import Limits, create_app
    from batchscore.serve.worker import Worker, WorkerSettings

    store = Store(tmp_path / "state")
    worker = Worker(store, WorkerSettings(model=MODEL))  # not started: batches stay queued
    client = TestClient(create_app(store, worker, KEY, MODEL, Limits(max_file_bytes=1000, max_requests=3)))
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/health").json() == {"status": "ok"}
    for method, path in [("get", "/v1/batches"), ("post", "/v1/files"), ("get", "/v1/files/x/content"),
                         ("post", "/v1/batches/x/cancel"), ("get", "/v1/nowhere")]:
        answer = getattr(client, method)(path)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    upload = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                         files={"file": ("in.jsonl", chat_line("a", "Yes?") + "\n")})
    assert upload.status_code == 200 and upload.json()["object"] == "file"
    file_id = upload.json()["id"]
    assert client.get(f"/v1/files/{file_id}/content", headers=auth).text == chat_line("a", "Yes?") + "\n"
    big = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("b.jsonl", "x" * 1001)})
    assert big.status_code == 413 and big.json()["error"]["code"] == "file_too_large"
    many = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("m.jsonl", "{}\n" * 5)})
    assert many.status_code == 400 and many.json()["error"]["param"] == "file"
    wrong = client.post("/v1/files", headers=auth, data={"purpose": "fine-tune"}, files={"file": ("f", "{}")})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"

    def create(**changes):
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                "metadata": {"labels": LABELS}, **changes}
        return client.post("/v1/batches", headers=auth, json=body)

    for changes, param in [({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
                           ({"metadata": {"labels": "Yes"}}, "metadata"), ({"input_file_id": None}, "input_file_id")]:
        answer = create(**changes)
        assert answer.status_code == 400, changes
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"} and answer.json()["error"]["param"] == param
    assert create(input_file_id="file-none").status_code == 404
    ids = [create().json()["id"] for _ in range(3)]
    batch = client.get(f"/v1/batches/{ids[0]}", headers=auth).json()
    assert batch["object"] == "batch" and batch["status"] == "validating" and batch["model"] == MODEL
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0} and batch["usage"] is None
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    page = client.get("/v1/batches?limit=2", headers=auth).json()
    assert page["object"] == "list" and [b["id"] for b in page["data"]] == ids[:0:-1] and page["has_more"]
    assert page["first_id"] == ids[2] and page["last_id"] == ids[1]
    rest = client.get(f"/v1/batches?limit=2&after={page['last_id']}", headers=auth).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert client.get("/v1/batches?limit=0", headers=auth).status_code == 400
    cancelled = client.post(f"/v1/batches/{ids[0]}/cancel", headers=auth).json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"] is not None
    store.update_batch(ids[1], status="completed")
    refused = client.post(f"/v1/batches/{ids[1]}/cancel", headers=auth)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "batch_not_cancellable"
    assert worker._next()["id"] == ids[2]  # settles the cancel first: nothing ran, so no files
    settled = client.get(f"/v1/batches/{ids[0]}", headers=auth).json()
    assert settled["status"] == "cancelled" and settled["cancelled_at"] is not None
    assert settled["output_file_id"] is None and settled["error_file_id"] is None
    # deleting the uploaded file leaves the queued batches their own copy of it
    assert client.delete(f"/v1/files/{file_id}", headers=auth).json() == {"id": file_id, "object": "file", "deleted": True}
    assert (store.work / ids[2] / "input.jsonl").read_text() == chat_line("a", "Yes?") + "\n"


def test_progress_counts_the_rows_a_running_jobs_parts_hold(tmp_path):
    import numpy as np

    from batchscore.output.layout import OutputFiles
    from batchscore.output.parts import Manifest, PartStore
    from batchscore.serve.progress import JobProgress

    output = tmp_path / "job0" / "output.jsonl"
    output.parent.mkdir()
    progress = JobProgress(output)
    assert progress.counts() == (0, 0)  # the run has not saved anything yet
    store = PartStore(OutputFiles(str(output), str(tmp_path / "job0" / "output.errors.jsonl")))
    manifest = store.start(Manifest(job_hash="h", identity={}, num_groups=1, num_rows=6, worker_rows={"0": 6}),
                           fresh=False, input_errors={5: "line 6: not valid JSON"})
    assert progress.counts() == (0, 1)  # a row refused before scoring has failed already

    def part(rows, errors, start):
        store.write_part(manifest, np.array(rows), [np.array([-0.1, -2.0])] * len(rows), [None] * len(rows),
                         errors, start, start + len(rows))

    part([0, 1, 2], {1: "longer than the maximum"}, 0)
    assert progress.counts() == (2, 2)
    part([3, 4, 6], {}, 3)  # row 6: past the job's rows (calibration's content-free row), not a request
    assert progress.counts() == (4, 2)
    store.finish()  # the run ends and removes its parts: the last counts stay
    assert progress.counts() == (4, 2)


def test_usage_and_cancelled_lines_take_the_batch_apis_shapes(tmp_path):
    from batchscore.formats.openai_batch import error_response
    from batchscore.row_errors import RowError, TOO_LONG, no_result
    from batchscore.serve.results import batch_usage, cancelled_if_not_run

    # the batch's usage is its answered lines' summed: each prompt once, its shared part cached
    decision = {"custom_id": "d", "response": {"status_code": 200, "body": {"usage": {
        "input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3}}}}
    chat = [{"custom_id": f"c{i}", "response": {"status_code": 200, "body": {"object": "chat.completion", "usage": {
        "prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
        "prompt_tokens_details": {"cached_tokens": cached}}}}} for i, cached in enumerate([0, 30])]
    usage = batch_usage([json.dumps(decision)] + [json.dumps(x) for x in chat])
    assert usage == {"input_tokens": 89, "input_tokens_details": {"cached_tokens": 34}, "output_tokens": 5,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 94}

    def error_line(error):
        return json.dumps({"id": "batch_req_x", "custom_id": "x", "response": error_response("x", error),
                           "error": None})

    cancelled = json.loads(cancelled_if_not_run(error_line(no_result())))
    assert cancelled["custom_id"] == "x" and cancelled["response"] is None
    assert cancelled["error"]["code"] == "batch_cancelled"
    failed = error_line(RowError(TOO_LONG, "in.jsonl:3: prompt is 9 tokens, longer than the maximum 8"))
    assert cancelled_if_not_run(failed) == failed  # it ran and failed: stays as it is
    # the kind decides, not the text: a failure whose message reads like a never-run row stays failed
    for kind in ("failed", "input"):
        failed = error_line(RowError(kind, "not scored: no result from the engine"))
        assert cancelled_if_not_run(failed) == failed


def test_a_cancelled_batch_keeps_its_finished_jobs_lines_and_cancels_the_rest(tmp_path, tokenizer):
    """Two jobs (the batch's labels; a line with its own): the first finished before the cancel,
    the second never started. The slow test below cancels a job mid-run (its parts assembled)."""
    from batchscore.serve.worker import Worker, WorkerSettings, stage_input

    store = Store(tmp_path / "state")
    own = json.loads(chat_line("c", "True or False?"))
    own["body"]["logprob_token_ids"] = [tokenizer.encode(t, add_special_tokens=False)[0] for t in ("True", "False")]
    upload = store.incoming_path()
    upload.write_text("\n".join([chat_line("a", "x"), chat_line("b", "y"), json.dumps(own), "{broken"]) + "\n")
    file_id = store.add_file(upload, "in.jsonl", "batch")["id"]
    batch = {"id": "batch_x", "object": "batch", "endpoint": "/v1/chat/completions", "status": "cancelling",
             "in_progress_at": 1, "cancelled_at": None, "metadata": {"labels": LABELS}}
    stage_input(store, "batch_x", file_id)
    store.add_batch(batch)
    job0 = store.work / "batch_x" / "job0"  # what a finished run of the first job leaves
    job0.mkdir()
    ok = [{"id": f"batch_req_{c}", "custom_id": c, "response": {"status_code": 200, "body": {}}, "error": None}
          for c in ("a", "b")]
    (job0 / "output.jsonl").write_text("".join(json.dumps(x) + "\n" for x in ok))
    (job0 / "_output.jsonl.complete.json").write_text("{}")

    Worker(store, WorkerSettings(model=MODEL))._cancel(store.batch("batch_x"))
    done = store.batch("batch_x")
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    assert done["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    output = [json.loads(x) for x in store.file_path(done["output_file_id"]).read_text().splitlines()]
    error_file = store.file_path(done["error_file_id"]).read_text().splitlines()
    errors = {line["custom_id"]: line for line in map(json.loads, error_file)}
    assert [x["custom_id"] for x in output] == ["a", "b"] and set(errors) == {"c", None}
    assert errors["c"]["response"] is None and errors["c"]["error"]["code"] == "batch_cancelled"
    assert errors[None]["response"]["status_code"] == 400  # the broken line failed; it was not cancelled


# --- slow: the real server, the official client ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`batchscore serve` as a real process on a free port."""

    def __init__(self, state: Path, port: int, extra: tuple[str, ...] = ()):
        self.state, self.port, self.process, self.extra = state, port, None, list(extra)

    def start(self) -> None:
        import httpx

        env = {**os.environ, "BATCHSCORE_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        command = [sys.executable, "-m", "batchscore.cli", "serve", "--state-dir", str(self.state),
                   "--port", str(self.port), "--set", "output.part_rows=4", "--set", "output.audit_rows=2", *self.extra]
        self.log = (self.state.parent / "server.log").open("ab")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.state.parent / "server.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise AssertionError("the server did not answer /health in 60 s")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_for(client, batch_id: str, statuses: tuple[str, ...], timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.5)
    raise AssertionError(f"{batch_id} still {batch.status} after {timeout} s")


def results(client, batch) -> tuple[list[dict], list[dict]]:
    ok = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    failed = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()] \
        if batch.error_file_id else []
    return ok, failed


# the batch cancelled mid-run: long enough that the cancel lands before its last row is scored (120
# rows finished first once the engine's CPU kernels got faster)
DOOMED_ROWS = 480


def long_completions(prefix: str, n: int) -> str:
    """`n` completions lines of distinct prompts, so parts are written every few rows."""
    words = ["apple", "river", "stone", "cloud", "lamp", "garden", "violin", "harbor", "forest", "candle"]
    lines = []
    for i in range(n):
        story = " ".join(words[(i + j) % len(words)] for j in range(60))
        prompt = f"{i} {words[i % 10]}: {story}. Is this text about fruit? Answer Yes or No:"
        lines.append(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": MODEL, "prompt": prompt}}))
    return "\n".join(lines) + "\n"


@pytest.mark.slow  # a real server process, five batches on the real model: a few minutes
def test_openai_client_runs_batches_against_batchscore_serve(tmp_path, tokenizer):
    import httpx
    import openai

    server = Server(tmp_path / "state", _free_port())
    server.start()
    base = f"http://127.0.0.1:{server.port}/v1"
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    try:
        # no key, a wrong key: 401 everywhere but the health check
        assert httpx.get(f"{base}/batches").status_code == 401
        assert httpx.post(f"{base}/files", files={"file": ("x", b"{}")}, data={"purpose": "batch"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).batches.list()

        # chat lines scored over the batch's labels; a broken line and another model's request fail alone
        chat = [chat_line(f"chat-{i}", f"Is a {thing} a fruit? Answer Yes or No.")
                for i, thing in enumerate(["banana", "hammer", "cherry", "bicycle", "mango", "teapot"])]
        chat += ['{"custom_id": "broken", "body": ', chat_line("other-model", "Is it?", model="gpt-4o-mini")]
        own = json.loads(chat_line("own-labels", "Is a plum a fruit? Answer True or False."))
        own["body"]["logprob_token_ids"] = [tokenizer.encode(t, add_special_tokens=False)[0] for t in ("True", "False")]
        chat.append(json.dumps(own))  # its own labels, as vLLM takes them
        image = json.loads(chat_line("image", "x"))
        image["body"]["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]
        chat.append(json.dumps(image))  # refused by the job's reader, not by the server
        chat_file = client.files.create(file=("chat.jsonl", ("\n".join(chat) + "\n").encode()), purpose="batch")
        chat_batch = client.batches.create(input_file_id=chat_file.id, endpoint="/v1/chat/completions",
                                           completion_window="24h", metadata={"labels": LABELS})
        # System One lines from the shipped sample, asked of this server's model
        decision_lines = (REPO / "sample_data" / "systemone_batch.jsonl").read_text().splitlines()
        systemone = [json.loads(line) for line in decision_lines][:3]
        for line in systemone:
            line["body"]["model"] = MODEL
        so_file = client.files.create(file=("so.jsonl", "".join(json.dumps(x) + "\n" for x in systemone).encode()),
                                      purpose="batch")
        so_batch = client.batches.create(input_file_id=so_file.id, endpoint="/v1/systemone", completion_window="24h")
        # a third batch, cancelled while it runs
        long_file = client.files.create(file=("long.jsonl", long_completions("c", DOOMED_ROWS).encode()),
                                        purpose="batch")
        doomed = client.batches.create(input_file_id=long_file.id, endpoint="/v1/completions",
                                       completion_window="24h", metadata={"labels": LABELS})
        assert chat_batch.status == "validating" and chat_batch.endpoint == "/v1/chat/completions"

        done = wait_for(client, chat_batch.id, ("completed", "failed"))
        assert done.status == "completed", done.errors
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (10, 7, 3)
        ok, failed = results(client, done)
        assert Counter(x["custom_id"] for x in ok + failed) == Counter(
            [f"chat-{i}" for i in range(6)] + ["own-labels", "image", "other-model", None])
        for line in ok:
            body = line["response"]["body"]
            labels = {"True", "False"} if line["custom_id"] == "own-labels" else {"Yes", "No"}
            assert line["response"]["status_code"] == 200 and body["object"] == "chat.completion"
            assert body["model"] == MODEL and set(body["scores"]) == labels
            assert body["choices"][0]["message"]["content"] in labels
        errors = {x["custom_id"]: x["response"]["body"]["error"] for x in failed}
        assert errors[None]["message"].startswith("chat.jsonl:7: not valid JSON")
        assert errors["other-model"]["message"].startswith("chat.jsonl:8: body.model")
        assert errors["image"]["message"].startswith("chat.jsonl:10: body.messages: message 0: only text content")
        assert all(x["response"]["status_code"] == 400 for x in failed)
        # usage: the answered lines' summed (each prompt once, its shared part cached, one token per answer)
        jobs = list((server.state / "batches" / done.id).glob("job*/metrics.json"))
        assert len(jobs) == 2  # the batch's labels, and the line with its own
        line_usage = [line["response"]["body"]["usage"] for line in ok]
        assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in line_usage) > 0
        assert done.usage.input_tokens_details.cached_tokens == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                                    for u in line_usage)
        assert done.usage.output_tokens == len(ok) and done.usage.total_tokens == done.usage.input_tokens + len(ok)

        done = wait_for(client, so_batch.id, ("completed", "failed"))
        assert done.status == "completed", done.errors
        ok, failed = results(client, done)
        assert sorted(x["custom_id"] for x in ok) == sorted(x["custom_id"] for x in systemone) and not failed
        answers = ok[0]["response"]["body"]["answers"]
        assert set(answers) == set(systemone[0]["body"]["questions"]) and answers["team"]["type"] == "choice"
        # a decision line's usage counts one output token per answer; the batch's sums them
        assert done.usage.output_tokens == sum(x["response"]["body"]["usage"]["output_tokens"] for x in ok) > 0
        assert done.usage.input_tokens > 0

        # its request counts grow while it runs (from the parts the run saves), then it is cancelled:
        # the lines done so far are its output, every other request is in the error file as cancelled
        wait_for(client, doomed.id, ("in_progress",))
        seen, deadline = [0], time.monotonic() + 300
        while len(set(seen) - {0}) < 2 and time.monotonic() < deadline:
            counts = client.batches.retrieve(doomed.id).request_counts
            if counts.completed != seen[-1]:
                seen.append(counts.completed)
            time.sleep(0.2)
        assert seen == sorted(seen) and len(set(seen) - {0}) >= 2 and counts.total == DOOMED_ROWS, seen
        assert client.batches.cancel(doomed.id).status in ("cancelling", "cancelled")
        cancelled = wait_for(client, doomed.id, ("cancelled", "completed"), timeout=240)
        assert cancelled.status == "cancelled" and cancelled.cancelled_at
        ok, failed = results(client, cancelled)
        assert seen[-1] <= len(ok) < DOOMED_ROWS and all(x["response"]["status_code"] == 200 for x in ok)
        assert Counter(x["custom_id"] for x in ok + failed) == Counter(f"c-{i}" for i in range(DOOMED_ROWS))
        assert all(x["response"] is None and x["error"]["code"] == "batch_cancelled" for x in failed)
        counts = cancelled.request_counts
        assert (counts.total, counts.completed, counts.failed) == (DOOMED_ROWS, len(ok), len(failed))

        # killed mid-batch (SIGKILL: no cleanup) and started again: the batch resumes and finishes
        killed_file = client.files.create(file=("kill.jsonl", long_completions("k", 60).encode()), purpose="batch")
        killed = client.batches.create(input_file_id=killed_file.id, endpoint="/v1/completions",
                                       completion_window="24h", metadata={"labels": LABELS})
        parts = server.state / "batches" / killed.id / "job0" / "_output.jsonl.parts"
        deadline = time.monotonic() + 300
        while not list(parts.glob("*-part-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.batches.retrieve(killed.id).status == "in_progress"
        server.kill()
        server.start()
        done = wait_for(client, killed.id, ("completed", "failed"))
        assert done.status == "completed", done.errors
        ok, failed = results(client, done)
        assert sorted(x["custom_id"] for x in ok + failed) == sorted(f"k-{i}" for i in range(60)) and not failed
        metrics = json.loads((server.state / "batches" / killed.id / "job0" / "metrics.json").read_text())
        assert 0 < metrics["resumed_rows"] < 60  # resumed from the parts saved before the kill

        listed = client.batches.list(limit=2)
        assert [b.id for b in listed.data] == [killed.id, doomed.id] and listed.has_more
    finally:
        server.stop()
