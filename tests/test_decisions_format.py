"""Decision requests (System One, OpenAI Decisions): parsing and refusals, the exact read text on
the real SmolLM2 tokenizer, label checks, answers and confidence, response bodies (checked with
jevcompat's validators) and table columns. No model forward."""

from __future__ import annotations

import json
import math

import pytest

from batchscore.errors import DecisionRequestError, InputError
from batchscore.tasks.questions import answers as out
from batchscore.tasks.questions import requests as dec

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

TICKET = {
    "model": "jev-latest",
    "state": {"ticket": "Charged twice for order 4411, refund today please"},
    "questions": {
        "team": {"type": "choice", "instructions": "Which team handles this?",
                 "criteria": {"billing": "payments, refunds", "shipping": None, "security": "account access"}},
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "anger": {"type": "score", "instructions": "How upset is the customer?",
                  "criteria": ["calm", "annoyed", "furious"]},
    },
}

PARCEL = {
    "model": "gpt-6-luna",
    "input": "The package arrived with a broken screen.",
    "questions": [
        {"type": "predicate", "name": "damaged", "instructions": "Does the customer report damage?"},
        {"type": "choice", "instructions": "Which department?",
         "choices": [{"value": "returns", "description": "sends items back"}, {"value": "billing"}, {"value": True}]},
        {"type": "score", "name": "severity", "instructions": "How severe?",
         "levels": [{"label": "cosmetic"}, {"label": "broken", "description": "does not work"}]},
    ],
}


def with_question(body: dict, key, question) -> dict:
    """A copy of a System One body whose questions are just {key: question}."""
    return {**body, "questions": {key: question}}


def log(ps):
    return [math.log(p) if p > 0 else -math.inf for p in ps]


# ---------------------------------------------------------------------------- parsing


def test_systemone_parse_keeps_ids_types_options_and_labels():
    request = dec.parse_systemone(TICKET)
    assert request.api == "systemone" and request.model == "jev-latest" and request.system is None
    assert request.state_text == '{"ticket": "Charged twice for order 4411, refund today please"}'
    team, refund, anger = request.questions
    assert (team.key, team.type, team.options, team.labels, team.layout) == \
        ("team", "choice", ("billing", "shipping", "security"), ("A", "B", "C"), "vllm-nexttoken-v1")
    assert team.descriptions == ("payments, refunds", None, "account access")
    assert (refund.options, refund.labels) == (("yes", "no"), ("yes", "no", "Yes", "No"))
    assert (anger.options, anger.labels, anger.levels) == \
        (("0", "1", "2"), ("0", "1", "2"), ("calm", "annoyed", "furious"))


def test_state_json_uses_python_defaults_and_keeps_key_order():
    body = {**TICKET, "state": {"z": "café ☕", "a": [1, 2.5, None, True]}}
    assert dec.parse_systemone(body).state_text == '{"z": "caf\\u00e9 \\u2615", "a": [1, 2.5, null, true]}'
    assert dec.parse_systemone({**TICKET, "state": "plain  text\n"}).state_text == "plain  text\n"
    assert dec.parse_systemone({**TICKET, "state": [1, "x"]}).state_text == '[1, "x"]'


def test_openai_parse_letters_every_question():
    request = dec.parse_openai_decisions(PARCEL)
    assert request.api == "openai" and request.system is None
    predicate, choice, score = request.questions
    assert (predicate.key, predicate.name, predicate.options, predicate.labels) == \
        (0, "damaged", ("false", "true"), ("A", "B"))
    assert choice.name is None and choice.options == ('"returns"', '"billing"', "true")
    assert choice.values == ("returns", "billing", True) and choice.labels == ("A", "B", "C")
    assert choice.descriptions == ("sends items back", None, None)
    assert (score.options, score.labels, score.levels) == (("cosmetic", "broken"), ("A", "B"), ("cosmetic", "broken"))


def test_openai_typed_values_differ_and_messages_flatten():
    body = {**PARCEL, "questions": [{"type": "choice", "instructions": "q",
                                     "choices": [{"value": "true"}, {"value": True}]}],
            "input": [{"role": "user", "content": "first"},
                      {"role": "user", "type": "message",
                       "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]}
    request = dec.parse_openai_decisions(body)
    assert request.questions[0].options == ('"true"', "true")
    assert request.state_text == "first\n\na\nb"


BAD_SYSTEMONE = [
    ([1, 2], "JSON object"),
    ({"state": "x"}, "questions"),
    ({**TICKET, "questions": {}}, "questions"),
    (with_question(TICKET, "q1", {"type": "box", "criteria": None}), "question 'q1': unknown question type 'box'"),
    (with_question(TICKET, "q2", {"type": "noul", "instructions": "x", "weight": 2}),
     "question 'q2': unknown field(s) ['weight']"),
    ({**TICKET, "chat_template_kwargs": {"enable_thinking": True}}, "enable_thinking"),
    ({**TICKET, "images": ["aGVsbG8="]}, "images"),
    (with_question(TICKET, "one", {"type": "choice", "criteria": {"only": None}}), "question 'one': has 1 options"),
    (with_question(TICKET, "wide", {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}),
     "question 'wide': has 256 options; give 2 to 255"),
    (with_question(TICKET, "lv", {"type": "score", "criteria": [str(i) for i in range(11)]}),
     "question 'lv': has 11 levels; give 2 to 10"),
    (with_question(TICKET, "lv1", {"type": "score", "criteria": ["only"]}), "question 'lv1': has 1 levels"),
    (with_question(TICKET, "map", {"type": "score", "criteria": {"low": 0, "high": 1}}),
     "question 'map': score criteria"),
    (with_question(TICKET, "nl", {"type": "noul", "criteria": {"maybe": "x"}}), "question 'nl': noul criteria"),
    (with_question(TICKET, "", {"type": "noul"}), "non-empty"),
    (with_question(TICKET, "s", "just text"), "question 's': must be an object"),
]


@pytest.mark.parametrize("body, message", BAD_SYSTEMONE)
def test_systemone_refusals_name_the_question(body, message):
    with pytest.raises(DecisionRequestError) as caught:
        dec.parse_systemone(body)
    assert message in str(caught.value)
    assert caught.value.status == 400 and isinstance(caught.value, InputError)


def test_refusal_carries_the_question_key():
    with pytest.raises(DecisionRequestError) as caught:
        dec.parse_systemone(with_question(TICKET, "q9", {"type": "box"}))
    assert caught.value.question == "q9"


def openai_with(question) -> dict:
    return {**PARCEL, "questions": [PARCEL["questions"][0], question]}


BAD_OPENAI = [
    ("nope", "JSON object"),
    ({**PARCEL, "questions": []}, "questions"),
    ({**PARCEL, "temperature": 0}, "unknown field(s) ['temperature']"),
    (openai_with({"type": "yes_no", "instructions": "x"}), "questions[1]: unknown question type 'yes_no'"),
    (openai_with({"type": "predicate", "instructions": "x", "criteria": {}}),
     "questions[1]: unknown field(s) ['criteria']"),
    (openai_with({"type": "choice", "name": "dept", "instructions": "x", "choices": [{"value": "a"}, {"value": "a"}]}),
     "questions[1] ('dept'): choice values must be distinct"),
    (openai_with({"type": "choice", "instructions": "x", "choices": [{"value": "a"}]}), "questions[1]: has 1 choices"),
    (openai_with({"type": "choice", "instructions": "x", "choices": [{"value": str(i)} for i in range(256)]}),
     "questions[1]: has 256 choices; give 2 to 255"),
    (openai_with({"type": "choice", "instructions": "x", "choices": [{"value": 1}, {"value": 2}]}),
     "questions[1]: choices[0].value"),
    (openai_with({"type": "score", "instructions": "x", "levels": [{"label": str(i)} for i in range(11)]}),
     "questions[1]: has 11 levels; give 2 to 10"),
    (openai_with({"type": "predicate"}), "questions[1]: instructions"),
    (openai_with({"type": "predicate", "instructions": "x", "name": None}), "questions[1]: name"),
    ({**PARCEL, "input": [{"role": "user", "content": [{"type": "input_image",
                                                         "image_url": "data:image/png;base64,AA=="}]}]},
     "input[0].content[0]: decisions read text input only"),
    ({**PARCEL, "input": [{"role": "system", "content": "x"}]}, "input[0].role"),
]


@pytest.mark.parametrize("body, message", BAD_OPENAI)
def test_openai_refusals_name_the_question(body, message):
    with pytest.raises(DecisionRequestError) as caught:
        dec.parse_openai_decisions(body)
    assert message in str(caught.value)


def test_many_options_get_two_letter_labels():
    body = with_question(TICKET, "big", {"type": "choice", "criteria": {f"o{i}": None for i in range(40)}})
    question = dec.parse_systemone(body).questions[0]
    assert question.layout == "vllm-nexttoken-v1+wide"
    assert question.labels[:3] == ("AA", "AB", "AC") and question.labels[25:28] == ("AZ", "BA", "BB")
    assert question.labels[-1] == "BN" and len(set(question.labels)) == 40
    assert dec.question_block(question).startswith("AA: o0\nAB: o1\n")
    assert dec.option_labels(255)[0][-1] == "JU"
    assert dec.option_labels(26) == (tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), "vllm-nexttoken-v1")


# ---------------------------------------------------------------------------- read text


def test_render_choice_read_with_json_state_and_system(tokenizer):
    request = dec.parse_systemone({**TICKET, "instructions": "You triage support tickets."})
    expected = (
        "<|im_start|>system\nYou triage support tickets.<|im_end|>\n"
        "<|im_start|>user\n"
        '{"ticket": "Charged twice for order 4411, refund today please"}\n'
        "\n"
        "Question: Which team handles this?\n"
        "A: billing - payments, refunds\n"
        "B: shipping\n"
        "C: security - account access\n"
        "Answer with the letter of one option only.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert dec.render_read(tokenizer, request, request.questions[0]) == expected


def test_render_noul_read_with_string_state(tokenizer):
    body = {"state": "I want my money back.", "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?",
                   "criteria": {"true": "asks for money back"}},
        "bare": {"type": "noul"}}}
    request = dec.parse_systemone(body)
    refund, bare = request.questions
    assert dec.render_read(tokenizer, request, refund) == (
        SMOL_SYSTEM + "<|im_start|>user\nI want my money back.\n\n"
        "Question: Does the customer ask for a refund?\n"
        "yes: asks for money back\n"
        "Answer with yes or no only.<|im_end|>\n<|im_start|>assistant\n")
    # no instructions, no descriptions: only the closing line follows the state
    assert dec.render_read(tokenizer, request, bare) == (
        SMOL_SYSTEM + "<|im_start|>user\nI want my money back.\n\nAnswer with yes or no only.<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_render_score_read(tokenizer):
    request = dec.parse_systemone(TICKET)
    assert dec.render_read(tokenizer, request, request.questions[2]) == (
        SMOL_SYSTEM + "<|im_start|>user\n"
        '{"ticket": "Charged twice for order 4411, refund today please"}\n\n'
        "Question: How upset is the customer?\n0: calm\n1: annoyed\n2: furious\n"
        "Answer with the number of one level only.<|im_end|>\n<|im_start|>assistant\n")


def test_render_openai_reads_show_json_values_and_lettered_levels(tokenizer):
    request = dec.parse_openai_decisions(PARCEL)
    head = SMOL_SYSTEM + "<|im_start|>user\nThe package arrived with a broken screen.\n\n"
    tail = "Answer with the letter of one option only.<|im_end|>\n<|im_start|>assistant\n"
    predicate, choice, score = (dec.render_read(tokenizer, request, q) for q in request.questions)
    assert predicate == head + "Question: Does the customer report damage?\nA: false\nB: true\n" + tail
    assert choice == head + ('Question: Which department?\nA: "returns" - sends items back\nB: "billing"\n'
                             "C: true\n") + tail
    assert score == head + "Question: How severe?\nA: cosmetic\nB: broken - does not work\n" + tail


def test_structured_instructions_are_read_as_text():
    body = with_question(TICKET, "s", {"type": "choice", "instructions": {"ask": "which"},
                                       "criteria": {"a": ["x", 1], "b": ""}})
    question = dec.parse_systemone(body).questions[0]
    assert dec.question_block(question) == ("Question: {'ask': 'which'}\nA: a - ['x', 1]\nB: b\n"
                                            "Answer with the letter of one option only.")


# ---------------------------------------------------------------------------- label checks


def test_vllm_labels_are_single_tokens_on_smollm2(tokenizer):
    assert dec.check_labels(tokenizer, tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")) is None
    assert dec.check_labels(tokenizer, ("yes", "no", "Yes", "No")) is None
    assert dec.check_labels(tokenizer, tuple("0123456789")) is None
    for question in dec.parse_systemone(TICKET).questions:
        assert dec.check_question(tokenizer, dec.parse_systemone(TICKET), question) is None


def test_multi_token_or_repeated_label_fails(tokenizer):
    assert dec.check_labels(tokenizer, ("A", "xyzzyq")) == \
        "label 'xyzzyq' is not one distinct token after this model's chat prompt"
    assert dec.check_labels(tokenizer, ("A", "B", "A")) == \
        "label 'A' is not one distinct token after this model's chat prompt"


def test_wide_labels_need_no_single_token_check(tokenizer):
    body = with_question(TICKET, "big", {"type": "choice", "criteria": {f"o{i}": None for i in range(40)}})
    request = dec.parse_systemone(body)
    assert dec.check_question(tokenizer, request, request.questions[0]) is None


# ---------------------------------------------------------------------------- answers


def test_typesafe_confidence_worked_examples():
    assert out.choice_confidence([0.88, 0.12]) == pytest.approx(0.76)
    assert out.score_confidence([0.0, 0.95, 0.05]) == pytest.approx(0.925)
    assert out.choice_confidence([0.91, 0.03, 0.06]) == pytest.approx(0.865)
    assert out.score_confidence([0.5, 0.4, 0.1]) == pytest.approx(0.1)
    assert out.choice_confidence([0.25] * 4) == 0.0 and out.score_confidence([0.5, 0, 0, 0.5]) == 0.0


def test_read_answer_for_each_type():
    team, refund, anger = dec.parse_systemone(TICKET).questions
    # labels hold 80% of the vocabulary mass; the answer renormalises it
    choice = out.read_answer(team, log([0.704, 0.096, 0.0]), top_logp=math.log(0.704))
    assert choice.probabilities == pytest.approx((0.88, 0.12, 0.0)) and choice.top == 0
    assert choice.confidence == pytest.approx(0.82)  # (0.88 - 1/3) / (2/3)
    assert choice.label_mass == pytest.approx(0.8) and choice.top_x_mass == pytest.approx(0.704)
    assert choice.argmax_is_label is True

    score = out.read_answer(anger, log([0.0, 0.95, 0.05]), top_logp=math.log(0.99))
    assert score.score == pytest.approx(1.05) and score.confidence == pytest.approx(0.925)
    assert score.argmax_is_label is False

    noul = out.read_answer(refund, log([0.3, 0.1, 0.2, 0.05]))  # yes, no, Yes, No
    assert noul.p_yes == pytest.approx(0.5 / 0.65) and noul.probabilities == pytest.approx((0.5 / 0.65, 0.15 / 0.65))
    assert noul.label_mass == pytest.approx(0.65) and noul.confidence is None and noul.argmax_is_label is None

    predicate = out.read_answer(dec.parse_openai_decisions(PARCEL).questions[0], log([0.1, 0.6]))
    assert predicate.p_yes == pytest.approx(0.6 / 0.7) and predicate.confidence is None
    with pytest.raises(ValueError, match="finite"):
        out.read_answer(team, [-math.inf] * 3)


# ---------------------------------------------------------------------------- bodies


def jevcompat_violations(request_body: dict, response_body: dict) -> list:
    from jevcompat.client import Response, parse_json
    from jevcompat.validate import validate_success

    raw = json.dumps(response_body).encode()
    data, json_error, nonfinite = parse_json(raw)
    response = Response(200, {"content-type": "application/json"}, raw, 1.0, data, json_error, nonfinite)
    return validate_success(request_body, response)


def ticket_answers(questions):
    team, refund, anger = questions
    return [out.read_answer(team, log([0.704, 0.096, 0.02]), top_logp=math.log(0.704)),
            out.read_answer(refund, log([0.6, 0.1, 0.2, 0.05]), top_logp=math.log(0.6)),
            out.read_answer(anger, log([0.2, 0.5, 0.1]), top_logp=math.log(0.5))]


def test_systemone_body_passes_jevcompat():
    request = dec.parse_systemone(TICKET)
    body = out.systemone_body(request, ticket_answers(request.questions), model="smollm2-135m-instruct",
                              input_tokens=210, output_tokens=0)
    assert jevcompat_violations(TICKET, body) == []
    team, refund, anger = (body["answers"][k] for k in ("team", "refund", "anger"))
    assert team["choice"] == "billing" and list(team["probabilities"]) == ["billing", "shipping", "security"]
    assert set(refund) == {"type", "noul", "x_label_mass", "x_argmax_is_label", "x_confidence_top_x_mass"}
    assert refund["noul"] == pytest.approx(0.8 / 0.95)
    assert anger["legend"] == {"0": "calm", "1": "annoyed", "2": "furious"}
    assert anger["score"] == pytest.approx((0.5 + 0.2) / 0.8)
    assert body["usage"] == {"input_tokens": 210, "output_tokens": 0}


def test_jevcompat_catches_a_broken_body():
    request = dec.parse_systemone(TICKET)
    body = out.systemone_body(request, ticket_answers(request.questions), model="m")
    body["answers"]["refund"]["confidence"] = 0.5  # TypeSafe's noul has no confidence field
    body["answers"]["team"]["choice"] = "shipping"
    broken = {v.req for v in jevcompat_violations(TICKET, body)}
    assert {"response.extensions", "choice.argmax"} <= broken


def test_wide_choice_body_passes_jevcompat():
    request_body = with_question(TICKET, "big", {"type": "choice", "criteria": {f"ö{i}": None for i in range(40)}})
    request = dec.parse_systemone(request_body)
    logps = [math.log(0.01)] * 40
    logps[7] = math.log(0.5)
    body = out.systemone_body(request, [out.read_answer(request.questions[0], logps)], model="m")
    assert jevcompat_violations(request_body, body) == []
    assert body["answers"]["big"]["choice"] == "ö7"


def test_openai_body_keeps_order_and_typed_values():
    request = dec.parse_openai_decisions(PARCEL)
    predicate, choice, score = request.questions
    answers = [out.read_answer(predicate, log([0.02, 0.9])),
               out.read_answer(choice, log([0.1, 0.05, 0.6])),
               out.read_answer(score, log([0.3, 0.6]))]
    body = out.openai_body(request, answers, input_tokens=96)
    assert body["model"] == "gpt-6-luna"
    p, c, s = body["answers"]
    assert (p["type"], p["name"], "confidence" in p) == ("predicate", "damaged", False)
    assert p["probability"] == pytest.approx(0.9 / 0.92)
    assert c["choice"] is True and c["name"] is None
    assert [x["value"] for x in c["probabilities"]] == ["returns", "billing", True]
    assert c["confidence"] == pytest.approx(out.choice_confidence([0.1 / 0.75, 0.05 / 0.75, 0.6 / 0.75]))
    assert [(x["value"], x["label"]) for x in s["probabilities"]] == [(0, "cosmetic"), (1, "broken")]
    assert s["score"] == pytest.approx(0.6 / 0.9)
    assert all(k.startswith("x_") for a in body["answers"] for k in a
               if k not in {"type", "name", "probability", "choice", "probabilities", "confidence", "score"})
    assert body["usage"]["total_tokens"] == 96 and body["usage"]["input_tokens_details"]["cached_tokens"] == 0


# ---------------------------------------------------------------------------- table


def test_table_columns_and_row_values():
    request = dec.parse_systemone(TICKET)
    common = ["confidence", "label_mass", "argmax_is_label", "status", "error"]
    assert out.table_columns(request.questions) == (
        ["team.choice", "team.p.billing", "team.p.shipping", "team.p.security"] + [f"team.{c}" for c in common]
        + ["refund.p_yes"] + [f"refund.{c}" for c in common]
        + ["anger.score", "anger.p.0", "anger.p.1", "anger.p.2"] + [f"anger.{c}" for c in common])
    answers = ticket_answers(request.questions)
    answers[2] = "label '0' is not one distinct token after this model's chat prompt"
    row = out.row_values(request.questions, answers)
    assert list(row) == out.table_columns(request.questions)
    assert row["team.choice"] == "billing" and row["team.status"] == "ok" and row["team.error"] is None
    assert row["team.p.billing"] == pytest.approx(0.704 / 0.82) and row["team.argmax_is_label"] is True
    assert row["refund.p_yes"] == pytest.approx(0.8 / 0.95) and row["refund.confidence"] is None
    assert row["anger.status"] == "error" and "not one distinct token" in row["anger.error"]
    assert row["anger.score"] is None and row["anger.p.1"] is None
    assert out.table_column_types(request.questions)["team.argmax_is_label"] == "bool"


def test_openai_columns_use_the_index():
    request = dec.parse_openai_decisions(PARCEL)
    columns = out.table_columns(request.questions)
    assert columns[:2] == ["0.p_yes", "0.confidence"]
    assert '1.p."returns"' in columns and "1.p.true" in columns and "2.p.1" in columns
