"""Decision requests: System One (`POST /v1/systemone`) and OpenAI Decisions (`POST /v1/decisions`)
bodies read into typed questions, and each question's read: the prompt text and the labels whose
log-probabilities answer it.

The layout is vLLM v0.32.0's NextTokenStrategy (`vllm-nexttoken-v1`, question_types.py at 02cc9cd):
one chat render per question, whose user message is the state, a blank line, then the question
block; the request's `instructions` are a system message; the generation prompt is added and
thinking is off. All of a record's reads start with the same state, so the prefix tree prefills it
once. Choices of 27–255 options (which vLLM refuses, TypeSafe allows) get two-letter labels
`AA, AB, …` on every option (`vllm-nexttoken-v1+wide`), scored as multi-token labels.

Nothing here imports torch: a tokenizer object (transformers-like) is passed in.
"""

from __future__ import annotations

import json
import re
import string
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from batchscore.errors import DecisionRequestError
from batchscore.io.readers import lone_surrogate_field
from batchscore.prepare.prompts import contents_in_order

LAYOUT = "vllm-nexttoken-v1"  # vLLM v0.32.0's NextTokenStrategy read, pinned (docs/jobs.md#decisions)
WIDE_LAYOUT = "vllm-nexttoken-v1+wide"  # the same read with two-letter labels from 27 options on

API_SYSTEMONE = "systemone"
API_OPENAI = "openai"

SYSTEMONE_TYPES = ("choice", "noul", "score")
OPENAI_TYPES = ("predicate", "choice", "score")

MIN_OPTIONS, MAX_OPTIONS = 2, 255  # TypeSafe's and OpenAI's choice limits
MIN_LEVELS, MAX_LEVELS = 2, 10  # score levels: the labels are the digits 0-9
MAX_LETTERS = 26  # one letter per option up to here; two letters on every option beyond

LETTER_REPLY = "Answer with the letter of one option only."
NOUL_REPLY = "Answer with yes or no only."
SCORE_REPLY = "Answer with the number of one level only."

NOUL_LABELS = ("yes", "no", "Yes", "No")  # read on both spellings: P(yes) = p(yes) + p(Yes)
SCORE_LABELS = tuple(string.digits)

# vLLM's Question spec: any other field is refused, since a field ignored could change the answer.
_SYSTEMONE_QUESTION_FIELDS = frozenset({"type", "instructions", "criteria"})
_OPENAI_REQUEST_FIELDS = frozenset({"model", "input", "questions", "safety_identifier", "prompt_cache_key",
                                    "prompt_cache_options"})
_OPENAI_QUESTION_FIELDS = {"predicate": frozenset({"type", "instructions", "name"}),
                           "choice": frozenset({"type", "instructions", "name", "choices"}),
                           "score": frozenset({"type", "instructions", "name", "levels"})}
# apply_chat_template's own arguments: a request's chat_template_kwargs never override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                                       "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                       "tokenizer_kwargs", "enable_thinking"})
# The fields of a body that are read (System One ignores any other top-level field).
_SYSTEMONE_READ_FIELDS = ("state", "instructions", "questions", "model", "chat_template_kwargs")
_OPENAI_READ_FIELDS = ("model", "input", "questions")


@dataclass(frozen=True)
class Question:
    """One question of a request, as read.

    key: the System One id, or the OpenAI index. name: OpenAI's optional `name` (None when absent;
    echoed in its answer); the id for System One. type: choice|noul|score (System One) or
    predicate|choice|score (OpenAI). options: the names answers and columns use — System One choice
    criteria keys, noul ("yes", "no"), score "0".."n-1"; OpenAI predicate ("false", "true"), choice
    `json.dumps(value)`, score the level labels. labels: the strings read after the prompt, one per
    option in option order (noul adds the aliases "Yes", "No" after "yes", "no"). descriptions:
    per option, the text after " - " (noul: the true/false descriptions), None for none.
    levels: score level texts (System One: each level as text; OpenAI: the labels). values: OpenAI
    choice values, typed. reply_instruction: the block's closing line.
    """

    key: str | int
    name: str | None
    type: str
    instructions: str
    options: tuple[str, ...]
    labels: tuple[str, ...]
    layout: str
    descriptions: tuple[str | None, ...] = ()
    levels: tuple[str, ...] | None = None
    values: tuple[str | bool, ...] | None = None
    reply_instruction: str = LETTER_REPLY


@dataclass(frozen=True)
class DecisionRequest:
    """A parsed request. api: "systemone" or "openai". state_text: what every read starts with.
    system: the system message (System One `instructions`), or None. model: the body's `model`.
    chat_template_kwargs: System One's extra template arguments (thinking is always off)."""

    api: str
    state_text: str
    system: str | None
    questions: tuple[Question, ...]
    model: str | None
    chat_template_kwargs: Mapping[str, Any] | None = None


# ---------------------------------------------------------------------------- labels


def option_labels(count: int) -> tuple[tuple[str, ...], str]:
    """The letter labels of `count` options and the layout they belong to: A… up to 26 options,
    else two letters AA, AB, … on every option."""
    letters = string.ascii_uppercase
    if count <= MAX_LETTERS:
        return tuple(letters[:count]), LAYOUT
    return tuple(letters[i // 26] + letters[i % 26] for i in range(count)), WIDE_LAYOUT


# ---------------------------------------------------------------------------- System One


def _check_text(body: dict, fields: Sequence[str]) -> None:
    """Every string the request is read from must be text: JSON can write a lone UTF-16 surrogate
    (`"\\ud83d"`), which no tokenizer takes; it makes this request's error, as it does a chat
    line's (io/readers.py), never the batch's."""
    field = lone_surrogate_field({name: body[name] for name in fields if name in body})
    if field is not None:
        raise DecisionRequestError(f"{field}: holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without "
                                   "its pair), which is not text")


def _text(value: Any) -> str:
    """vLLM's rule for instructions and descriptions: strings as is, null as "", anything else str()."""
    if isinstance(value, str):
        return value
    return "" if value is None else str(value)


def _description(value: Any) -> str | None:
    return None if value is None else _text(value)


def state_text(state: Any) -> str:
    """The text a System One state is read as: a string as is, JSON as `json.dumps` with Python's
    defaults (ASCII escaping, ", " and ": ", key order kept), as vLLM serialises it."""
    return state if isinstance(state, str) else json.dumps(state)


def parse_systemone(body: Any) -> DecisionRequest:
    """A System One request body read into questions; raises DecisionRequestError (400) naming the
    question at fault. Unknown top-level fields are ignored (TypeSafe); unknown question fields
    are refused (vLLM)."""
    if not isinstance(body, dict):
        raise DecisionRequestError(f"the request body must be a JSON object, not {_kind(body)}")
    _check_text(body, _SYSTEMONE_READ_FIELDS)
    if "state" not in body:
        raise DecisionRequestError("state: missing; give the text or JSON the questions are about")
    if body.get("images"):
        raise DecisionRequestError("images: this reader reads text only; images are not supported")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise DecisionRequestError(f"model: must be a string, not {_kind(model)}")
    system = body.get("instructions")
    if system is not None and not isinstance(system, str):
        raise DecisionRequestError(f"instructions: must be a string, not {_kind(system)}")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise DecisionRequestError(f"chat_template_kwargs: must be an object, not {_kind(kwargs)}")
    if (kwargs or {}).get("enable_thinking"):
        raise DecisionRequestError("chat_template_kwargs.enable_thinking: a read is the reply's first token, "
                                   "so thinking must be off")
    specs = body.get("questions")
    if not isinstance(specs, dict) or not specs:
        raise DecisionRequestError("questions: give an object of question id -> question, with at least one")
    questions = tuple(_systemone_question(qid, spec) for qid, spec in specs.items())
    return DecisionRequest(API_SYSTEMONE, state_text(body["state"]), system or None, questions, model,
                           dict(kwargs) if kwargs else None)


def _systemone_question(qid: str, spec: Any) -> Question:
    def fail(message: str) -> DecisionRequestError:
        return DecisionRequestError(f"question {qid!r}: {message}", qid)

    if not qid:
        raise fail("question ids must be non-empty")
    if not isinstance(spec, dict):
        raise fail(f"must be an object with type, instructions and criteria, not {_kind(spec)}")
    extra = sorted(set(spec) - _SYSTEMONE_QUESTION_FIELDS)
    if extra:
        raise fail(f"unknown field(s) {extra}; a question has type, instructions and criteria")
    qtype, criteria = spec.get("type"), spec.get("criteria")
    instructions = _text(spec.get("instructions", ""))
    if qtype == "choice":
        if not isinstance(criteria, dict):
            raise fail("choice criteria must map option names to a description or null")
        _check_count(fail, len(criteria), MIN_OPTIONS, MAX_OPTIONS, "options")
        labels, layout = option_labels(len(criteria))
        return Question(qid, qid, "choice", instructions, tuple(criteria), labels, layout,
                        tuple(_description(d) for d in criteria.values()))
    if qtype == "noul":
        if criteria is not None and (not isinstance(criteria, dict) or not set(criteria) <= {"true", "false"}):
            raise fail("noul criteria must be null or an object with true and/or false descriptions")
        criteria = criteria or {}
        return Question(qid, qid, "noul", instructions, ("yes", "no"), NOUL_LABELS, LAYOUT,
                        (_description(criteria.get("true")), _description(criteria.get("false"))),
                        reply_instruction=NOUL_REPLY)
    if qtype == "score":
        if not isinstance(criteria, list):
            raise fail("score criteria must be an ordered list of levels, lowest first")
        _check_count(fail, len(criteria), MIN_LEVELS, MAX_LEVELS, "levels")
        n = len(criteria)
        return Question(qid, qid, "score", instructions, tuple(str(i) for i in range(n)), SCORE_LABELS[:n], LAYOUT,
                        (None,) * n, levels=tuple(str(level) for level in criteria), reply_instruction=SCORE_REPLY)
    raise fail(f"unknown question type {qtype!r}; supported: {', '.join(SYSTEMONE_TYPES)}")


# ---------------------------------------------------------------------------- OpenAI Decisions


def input_text(value: Any) -> str:
    """OpenAI `input` as text: a string as is; user messages joined by a blank line, a message's
    text parts by a newline. Raises DecisionRequestError for images and anything not text."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise DecisionRequestError(f"input: must be a string or a list of user messages, not {_kind(value)}")
    texts = []
    for m, message in enumerate(value):
        where = f"input[{m}]"
        if not isinstance(message, dict):
            raise DecisionRequestError(f"{where}: must be a message object, not {_kind(message)}")
        extra = sorted(set(message) - {"role", "type", "content"})
        if extra:
            raise DecisionRequestError(f"{where}: unknown field(s) {extra}")
        if message.get("role") != "user":
            raise DecisionRequestError(f"{where}.role: must be \"user\", not {message.get('role')!r}")
        if message.get("type", "message") != "message":
            raise DecisionRequestError(f"{where}.type: must be \"message\", not {message.get('type')!r}")
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        if not isinstance(content, list):
            raise DecisionRequestError(f"{where}.content: must be a string or a list of parts, not {_kind(content)}")
        parts = []
        for p, part in enumerate(content):
            at = f"{where}.content[{p}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "input_image":
                raise DecisionRequestError(f"{at}: decisions read text input only; images are not supported")
            if kind != "input_text" or not isinstance(part.get("text"), str):
                raise DecisionRequestError(f"{at}: must be {{\"type\": \"input_text\", \"text\": string}}")
            extra = sorted(set(part) - {"type", "text", "prompt_cache_breakpoint"})
            if extra:
                raise DecisionRequestError(f"{at}: unknown field(s) {extra}")
            parts.append(part["text"])
        texts.append("\n".join(parts))
    return "\n\n".join(texts)


def parse_openai_decisions(body: Any) -> DecisionRequest:
    """An OpenAI Decisions request body read into questions (every one a lettered choice read, as
    vLLM maps them); raises DecisionRequestError (400) naming the question at fault. Unknown fields
    are refused, as the upstream schema does. No system message."""
    if not isinstance(body, dict):
        raise DecisionRequestError(f"the request body must be a JSON object, not {_kind(body)}")
    _check_text(body, _OPENAI_READ_FIELDS)
    extra = sorted(set(body) - _OPENAI_REQUEST_FIELDS)
    if extra:
        raise DecisionRequestError(f"unknown field(s) {extra}; a decisions request has "
                                   f"{', '.join(sorted(_OPENAI_REQUEST_FIELDS))}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise DecisionRequestError(f"model: must be a string, not {_kind(model)}")
    if "input" not in body:
        raise DecisionRequestError("input: missing; give a string or a list of user messages")
    text = input_text(body["input"])
    specs = body.get("questions")
    if not isinstance(specs, list) or not specs:
        raise DecisionRequestError("questions: give a list of questions, with at least one")
    questions = tuple(_openai_question(i, spec) for i, spec in enumerate(specs))
    return DecisionRequest(API_OPENAI, text, None, questions, model)


def _openai_question(index: int, spec: Any) -> Question:
    name = spec.get("name") if isinstance(spec, dict) else None

    def fail(message: str) -> DecisionRequestError:
        called = f" ({name!r})" if isinstance(name, str) else ""
        return DecisionRequestError(f"questions[{index}]{called}: {message}", index)

    if not isinstance(spec, dict):
        raise fail(f"must be a question object, not {_kind(spec)}")
    qtype = spec.get("type")
    if qtype not in _OPENAI_QUESTION_FIELDS:
        raise fail(f"unknown question type {qtype!r}; supported: {', '.join(OPENAI_TYPES)}")
    extra = sorted(set(spec) - _OPENAI_QUESTION_FIELDS[qtype])
    if extra:
        raise fail(f"unknown field(s) {extra} for a {qtype} question")
    instructions = spec.get("instructions")
    if not isinstance(instructions, str):
        raise fail(f"instructions: must be a string, not {_kind(instructions)}")
    if "name" in spec and not isinstance(name, str):
        raise fail(f"name: must be a string when given, not {_kind(name)}")
    if qtype == "predicate":
        return Question(index, name, "predicate", instructions, ("false", "true"), ("A", "B"), LAYOUT, (None, None))
    if qtype == "choice":
        choices = spec.get("choices")
        if not isinstance(choices, list):
            raise fail("choices: must be a list of {value, description?}")
        _check_count(fail, len(choices), MIN_OPTIONS, MAX_OPTIONS, "choices")
        values, descriptions = [], []
        for c, choice in enumerate(choices):
            if not isinstance(choice, dict) or not set(choice) <= {"value", "description"} or "value" not in choice:
                raise fail(f"choices[{c}]: must be {{\"value\": string or boolean, \"description\"?: string}}")
            value, description = choice["value"], choice.get("description", "")
            if not isinstance(value, (str, bool)):
                raise fail(f"choices[{c}].value: must be a string or a boolean, not {_kind(value)}")
            if not isinstance(description, str):
                raise fail(f"choices[{c}].description: must be a string, not {_kind(description)}")
            values.append(value)
            descriptions.append(description or None)
        typed = [(type(v), v) for v in values]  # "true" and true are different values
        if len(set(typed)) != len(typed):
            dup = next(v for i, v in enumerate(values) if typed[i] in typed[:i])
            raise fail(f"choice values must be distinct; {json.dumps(dup)} appears twice")
        labels, layout = option_labels(len(values))
        return Question(index, name, "choice", instructions, tuple(json.dumps(v) for v in values), labels, layout,
                        tuple(descriptions), values=tuple(values))
    levels = spec.get("levels")
    if not isinstance(levels, list):
        raise fail("levels: must be a list of {label, description?}, lowest first")
    _check_count(fail, len(levels), MIN_LEVELS, MAX_LEVELS, "levels")
    names, descriptions = [], []
    for lv, level in enumerate(levels):
        if not isinstance(level, dict) or not set(level) <= {"label", "description"} \
                or not isinstance(level.get("label"), str) or not isinstance(level.get("description", ""), str):
            raise fail(f"levels[{lv}]: must be {{\"label\": string, \"description\"?: string}}")
        if level["label"] in names:  # two copies would split one answer's probability
            raise fail(f"level labels must be distinct; {json.dumps(level['label'])} appears twice")
        names.append(level["label"])
        descriptions.append(level.get("description") or None)
    labels, layout = option_labels(len(names))
    return Question(index, name, "score", instructions, tuple(names), labels, layout, tuple(descriptions),
                    levels=tuple(names))


def _check_count(fail, count: int, low: int, high: int, what: str) -> None:
    if not low <= count <= high:
        raise fail(f"has {count} {what}; give {low} to {high}")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


# ---------------------------------------------------------------------------- reads


def question_block(question: Question) -> str:
    """The question as the model reads it after the state: the Question line (left out when the
    instructions are empty), one line per option, then the closing line; joined by newlines."""
    lines = [f"Question: {question.instructions}"] if question.instructions else []
    shown = question.levels if question.levels is not None else question.options
    for label, text, description in zip(question.labels, shown, question.descriptions or (None,) * len(shown)):
        if question.type == "noul":  # a side without a description is left out (02cc9cd)
            if description:
                lines.append(f"{label}: {description}")
        elif description:
            lines.append(f"{label}: {text} - {description}")
        else:
            lines.append(f"{label}: {text}")
    lines.append(question.reply_instruction)
    return "\n".join(lines)


def read_messages(request: DecisionRequest, question: Question) -> list[dict[str, str]]:
    """The chat messages of one read: the system message (when the request has instructions),
    then the state and the question block as the user message."""
    messages = [{"role": "user", "content": f"{request.state_text}\n\n{question_block(question)}"}]
    if request.system:
        messages.insert(0, {"role": "system", "content": request.system})
    return messages


def _template_kwargs(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    return {**kwargs, "tokenize": False, "add_generation_prompt": True, "enable_thinking": False}


def render_read(tokenizer, request: DecisionRequest, question: Question) -> str:
    """The full prompt text of one read: the chat template applied with the generation prompt and
    thinking off (templates that ignore `enable_thinking` are fine). Tokenize it without adding
    special tokens; the labels are read right after it."""
    if not getattr(tokenizer, "chat_template", None):
        raise DecisionRequestError("decision reads need a model whose tokenizer has a chat template")
    return tokenizer.apply_chat_template(read_messages(request, question),
                                         **_template_kwargs(request.chat_template_kwargs))


_PLACEHOLDER = "\ue000batchscore-message-{}\ue001"  # private-use characters: never in a template's own text
_PLACEHOLDER_RE = re.compile("\ue000batchscore-message-(\\d+)\ue001")


def read_prompt(tokenizer, request: DecisionRequest, question: Question) -> tuple[str, list[tuple[int, int]]]:
    """The read's prompt text (render_read) and the [start, end) spans of its messages in it: the
    request's text (instructions, state, the question's instructions, options, descriptions) is
    data, so special-token text there is tokenized as plain text, never as a control token.

    The spans are taken from the render: the template is rendered with a placeholder for each
    message's content and each placeholder gives its message's place. Where the template changes
    a content (strips it, say), so that this is not the real render, each content is found in
    the render in message order instead; raises DecisionRequestError when one is not there."""
    text = render_read(tokenizer, request, question)
    messages = read_messages(request, question)
    marked = tokenizer.apply_chat_template([{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)],
                                           **_template_kwargs(request.chat_template_kwargs))
    pieces, spans, length = [], [], 0
    at = 0
    for match in _PLACEHOLDER_RE.finditer(marked):
        content = messages[int(match.group(1))]["content"]
        pieces += [marked[at:match.start()], content]
        length += match.start() - at
        spans.append((length, length + len(content)))
        length += len(content)
        at = match.end()
    pieces.append(marked[at:])
    if "".join(pieces) == text:
        return text, spans
    try:  # the template changed a content: find each one, in order
        return text, contents_in_order(text, [m["content"] for m in messages])
    except LookupError as missing:
        raise DecisionRequestError(f"the model's chat template changes the text of the "
                                   f"{messages[missing.args[0]]['role']} message; the request's text cannot be "
                                   "told from the template's own tokens") from None


# ---------------------------------------------------------------------------- label checks

_label_checks: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _prompt_tail(tokenizer, chat_template_kwargs: Mapping[str, Any] | None) -> list[int]:
    """The ids of a probe chat prompt after its last added (special) token, as vLLM probes."""
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], **_template_kwargs(chat_template_kwargs))
    ids = tokenizer.encode(probe, add_special_tokens=False)
    added = set(tokenizer.get_added_vocab().values())
    start = max((i + 1 for i, t in enumerate(ids) if t in added), default=0)
    return list(ids[start:])


def check_labels(tokenizer, labels: Sequence[str],
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> str | None:
    """None when each label is one distinct token after this model's generation prompt, else the
    problem ("label 'X' is not one distinct token after this model's chat prompt"). Probes as vLLM
    does: the tail of a rendered probe prompt, decoded, plus the label must tokenize as the tail's
    ids and one new id. Cached per tokenizer, label set and template arguments."""
    key = (tuple(labels), json.dumps(chat_template_kwargs or {}, sort_keys=True, default=str))
    try:
        cache = _label_checks.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: no cache
        cache = {}
    if key not in cache:
        tail = _prompt_tail(tokenizer, chat_template_kwargs)
        text = tokenizer.decode(tail)
        ids: list[int] = []
        cache[key] = None
        for label in labels:
            extended = tokenizer.encode(text + label, add_special_tokens=False)
            if extended[:-1] != tail or extended[-1] in ids:
                cache[key] = f"label {label!r} is not one distinct token after this model's chat prompt"
                break
            ids.append(extended[-1])
    return cache[key]


def check_question(tokenizer, request: DecisionRequest, question: Question) -> str | None:
    """None when the question's labels can be read exactly, else the problem naming the question.
    One-letter, yes/no and digit labels must be single distinct tokens; two-letter labels
    (`vllm-nexttoken-v1+wide`) are scored as multi-token labels and need no check."""
    if question.layout == WIDE_LAYOUT:
        return None
    problem = check_labels(tokenizer, question.labels, request.chat_template_kwargs)
    if problem is None:
        return None
    where = f"question {question.key!r}" if request.api == API_SYSTEMONE else f"questions[{question.key}]"
    return f"{where}: {problem}"
