"""Chat and completion answers in OpenAI's shape where parsing code looks: `finish_reason`
"stop", per-line `usage` (the prompt's tokens once, whatever the labels; the part another prompt
shares as cached), and each request option either honoured (`logprobs: false`, `top_logprobs`,
`n: 1`, `response_format` text) or that line's 400 naming it."""

import json

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.formats.openai_batch import openai_request
from batchscore.output.token_usage import prompt_usage
from batchscore.plan.types import Request

MODEL = "smollm2-135m-instruct"
SYSTEM = "You sort support tickets. Answer with the team's name only."


def chat(custom_id: str, text: str, **options) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": text}], **options}}


@pytest.mark.parametrize("options, named", [
    ({"n": 2}, "body.n"), ({"response_format": {"type": "json_object"}}, "body.response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "body.response_format"),
    ({"stream": True}, "body.stream"), ({"tools": [{"type": "function"}]}, "body.tools"),
    ({"tool_choice": "required"}, "body.tool_choice"), ({"logit_bias": {"50": 100}}, "body.logit_bias"),
    ({"top_logprobs": 2}, "body.top_logprobs: needs body.logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "body.top_logprobs"), ({"logprobs": "yes"}, "body.logprobs"),
])
def test_an_option_scoring_cannot_honour_is_that_lines_400_naming_it(options, named):
    row, problem = openai_request(chat("a", "x", **options))
    assert problem is not None and problem.startswith(named) and row["custom_id"] == "a"


def test_options_scoring_honours_are_kept_for_the_answer():
    for options, reply in [({"n": 1, "response_format": {"type": "text"}, "temperature": 0, "max_tokens": 1}, None),
                           ({"logprobs": False}, {"logprobs": False}),
                           ({"logprobs": True, "top_logprobs": 1}, {"top_logprobs": 1})]:
        row, problem = openai_request(chat("a", "x", **options))
        assert problem is None and (json.loads(row["reply"]) if row["reply"] else None) == reply
    completion = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 1}}
    assert json.loads(openai_request(completion)[0]["reply"]) == {"top_logprobs": 1}
    completion["body"]["logprobs"] = 9
    assert openai_request(completion)[1].startswith("body.logprobs")


def test_prompt_usage_counts_each_prompt_once_and_the_shared_part_as_cached():
    prompts = {0: [5, 6, 7, 8, 1], 1: [5, 6, 7, 9], 2: [2, 3], 3: [5, 6, 7, 8, 1]}
    usage = prompt_usage(Request(i, np.array(t)) for i, t in prompts.items())
    assert {i: u[0] for i, u in usage.items()} == {i: len(t) for i, t in prompts.items()}
    # in token order: [2,3] | [5,6,7,8,1] | [5,6,7,8,1] (all shared but its last token) | [5,6,7,9]
    assert sorted(u[1] for u in usage.values()) == [0, 0, 3, 4]
    assert usage[2][1] == 0 and {usage[0][1], usage[3][1]} == {0, 4} and usage[1][1] == 3


@pytest.mark.parametrize("seed", range(4))
def test_the_stores_usage_equals_the_requests_usage(tmp_path, seed):
    """`store_usage` (the rows sorted once, no request per row) equals `prompt_usage` on the same
    prompts: duplicates, prefixes of each other, an empty row's absence, a content-free row last."""
    from batchscore.output.token_usage import store_usage
    from batchscore.store import StoreWriter

    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 50, size=rng.integers(1, 30)).tolist() for _ in range(5)]
    prompts = [stems[rng.integers(0, 5)][: rng.integers(1, 30)] + rng.integers(0, 50, size=rng.integers(0, 4)).tolist()
               for _ in range(60)]
    prompts = [p or [7] for p in prompts]
    requests = [Request(i, np.array(t)) for i, t in enumerate(prompts) if i != 9]  # row 9: refused, no tokens
    writer = StoreWriter(tmp_path / "tokens")
    writer.add_requests(requests + [Request(len(prompts), np.array(prompts[0] + [1]))])  # a content-free row last
    store = writer.close(len(prompts))
    assert store_usage(store, len(prompts)) == prompt_usage(requests)


def test_a_chat_batch_is_answered_in_openais_shape(tmp_path, tokenizer, monkeypatch):
    """Four multi-token labels, prompts sharing a system message: each line's usage counts its
    prompt once (not once per label), the label is the finished answer, options honoured, and
    calibration (score.calibrate: batch) carried by the answers: the label follows it."""
    labels = ["billing", "shipping", "security", "other"]
    texts = ["I was charged twice for one order.", "My parcel never arrived.", "I cannot log in to my account."]
    lines = [chat("plain-0", texts[0]), chat("plain-1", texts[1]), chat("no-logprobs", texts[2], logprobs=False),
             chat("top-1", texts[0] + " Again.", logprobs=True, top_logprobs=1),
             chat("two-answers", texts[1], n=3),
             {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
              "body": {"model": "gpt-4o-mini", "prompt": "Ticket: refund please. Team:", "logprobs": 2}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = {"input": {"path": str(tmp_path / "in.jsonl"), "format": "openai_batch"}, "labels": labels, "model": MODEL,
           "engine": {"kind": "torch", "dtype": "float32"}, "score": {"calibrate": "batch"}, "output": {"path": str(tmp_path / "out.jsonl"), "max_error_rate": 0.5, "audit_rows": 0}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    from batchscore.run import runner

    built, real = [], runner.build_store
    monkeypatch.setattr(runner, "build_store", lambda *a, **k: built.append(1) or real(*a, **k))
    result = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "-q"])
    assert result.exit_code == 0, result.output
    assert built == [1]  # Batch API lines in and out: the token store's path, usage read from it
    ok = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    failed = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in failed] == ["two-answers"]
    assert "in.jsonl:5: body.n: 3" in failed[0]["response"]["body"]["error"]["message"]
    assert failed[0]["response"]["status_code"] == 400

    for line in lines[:4]:
        body = ok[line["custom_id"]]
        choice, usage = body["choices"][0], body["usage"]
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] in labels
        prompt = tokenizer.apply_chat_template(line["body"]["messages"], tokenize=True, add_generation_prompt=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]  # a BatchEncoding in newer transformers
        assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 1
        assert usage["total_tokens"] == usage["prompt_tokens"] + 1
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    # the system message is shared: every prompt but the first in token order reads it as cached
    system_tokens = len(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=False))
    cached = sorted(ok[c]["usage"]["prompt_tokens_details"]["cached_tokens"] for c in ("plain-0", "plain-1", "no-logprobs"))
    assert cached[0] == 0 and cached[1] > 0 and system_tokens > 0
    assert ok["no-logprobs"]["choices"][0]["logprobs"] is None and set(ok["no-logprobs"]["scores"]) == set(labels)
    top = ok["top-1"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["token"] for t in top] == [max(ok["top-1"]["scores"], key=ok["top-1"]["scores"].get)]  # the model's own
    for body in ok.values():  # calibrated probabilities beside the raw ones; the answer follows them
        calibrated = body["calibrated_scores"]
        assert set(calibrated) == set(labels) and sum(calibrated.values()) == pytest.approx(1.0)
        assert body["choices"][0].get("message", {}).get("content", body["choices"][0].get("text")) == \
            max(calibrated, key=calibrated.get)
    assert len(ok["plain-0"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 4
    completion = ok["completion"]
    assert completion["choices"][0]["finish_reason"] == "stop" and len(completion["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
    assert completion["usage"]["prompt_tokens"] == len(tokenizer.encode("Ticket: refund please. Team:", add_special_tokens=False))
