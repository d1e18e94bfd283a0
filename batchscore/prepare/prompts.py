"""Prompt templates, chat templates and label tokenization.

Templates (`prompt.engine: format`, the default) use `{column}` fields only. They are parsed,
not evaluated: a field cannot reach attributes (`{a.b}`), indexes (`{a[0]}`), conversions
(`{a!r}`) or format specs, so a job file cannot run code or read anything but the row's own
columns. `prompt.engine: jinja` renders with jinja2's sandbox instead (batchscore.prepare.jinja).
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from batchscore.errors import LabelError, PromptTemplateError, RowRenderError
from batchscore.prepare.tail_tokens import cut_of, encode_batch, tail_rule


PROMPT_ENGINES = ("format", "jinja")  # prompt.engine


@dataclass(frozen=True)
class PromptTemplate:
    """A parsed template: literal text and column names, alternating."""

    pieces: tuple[tuple[str, str | None], ...]  # (literal text, column or None)

    @property
    def columns(self) -> list[str]:
        seen: list[str] = []
        for _, column in self.pieces:
            if column is not None and column not in seen:
                seen.append(column)
        return seen

    def render(self, row: dict[str, Any]) -> str:
        """Fill the fields from `row`; raises KeyError naming a missing or null field."""
        return self.render_spans(row)[0]

    def render_spans(self, row: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
        """The filled text and the [start, end) character spans that came from the row's data."""
        out, spans, length = [], [], 0
        for literal, column in self.pieces:
            out.append(literal)
            length += len(literal)
            if column is not None:
                value = row.get(column)
                if value is None:
                    raise KeyError(column)
                text = str(value)
                out.append(text)
                spans.append((length, length + len(text)))
                length += len(text)
        return "".join(out), spans


def parse_template(template: str) -> PromptTemplate:
    """Parse `template`; raises PromptTemplateError for anything but plain `{column}` fields."""
    pieces = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise PromptTemplateError(f"malformed template ({exc}); write literal braces as {{{{ and }}}}") from None
    for literal, field_name, format_spec, conversion in parsed:
        if field_name is None:
            pieces.append((literal, None))
            continue
        if field_name == "":
            raise PromptTemplateError("empty field {} — name a column, e.g. {query}")
        if any(ch in field_name for ch in ".[]") or conversion or format_spec:
            raise PromptTemplateError(
                f"field {{{field_name}{'!' + conversion if conversion else ''}"
                f"{':' + format_spec if format_spec else ''}}} is not allowed: "
                "only plain {column} fields (no attributes, indexes, conversions or format specs)"
            )
        pieces.append((literal, field_name))
    return PromptTemplate(tuple(pieces))


def template_fields(template: str, engine: str = "format") -> list[str]:
    """The column names a template uses (validates it on the way)."""
    return compile_template(template, engine).columns


def compile_template(template: str, engine: str = "format"):
    """A PromptTemplate (`format`) or a JinjaTemplate (`jinja`): `.columns` and `.render(row)`."""
    if engine == "jinja":
        from batchscore.prepare.jinja import parse_jinja_template

        return parse_jinja_template(template)
    if engine != "format":
        raise PromptTemplateError(f"unknown template engine {engine!r}; use one of {', '.join(PROMPT_ENGINES)}")
    return parse_template(template)


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt's text and the [start, end) character spans that came from the row's data."""

    text: str
    spans: list[tuple[int, int]]
    chat: bool | None = None  # the text holds a chat template's tokens (None: the renderer's `chat`)


class PromptRenderer:
    """Renders rows into prompt token ids with a tokenizer, optionally via its chat template."""

    def __init__(self, tokenizer, template: str, *, system: str | None = None, chat: bool = False,
                 engine: str = "format"):
        self._use_tokenizer(tokenizer)
        self.template = compile_template(template, engine)
        self.system = system
        self.chat = chat
        if chat and not getattr(tokenizer, "chat_template", None):
            raise PromptTemplateError("prompt.chat is true but the model's tokenizer has no chat template")

    def _use_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._special = special_token_pattern(tokenizer)
        self._longest_token_chars: int | None = None

    @property
    def longest_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary entry's length: a byte-level
        entry has a character per byte, at least one per character it decodes to). A text longer than
        `max_length` times this cannot fit `max_length` tokens."""
        if self._longest_token_chars is None:
            vocab = self.tokenizer.get_vocab()
            self._longest_token_chars = max((len(entry) for entry in vocab), default=1) or 1
        return self._longest_token_chars

    @property
    def columns(self) -> list[str]:
        """The input columns a prompt is made of."""
        return self.template.columns

    def text(self, row: dict[str, Any]) -> str:
        """The full prompt text for one row (chat template applied when asked)."""
        return self.prompt(row).text

    def prompt(self, row: dict[str, Any]) -> RenderedPrompt:
        """The full prompt text for one row and the character spans of the row's data in it."""
        user, spans = self.template.render_spans(row)
        if not self.chat:
            if self.system is None:
                return RenderedPrompt(user, spans)
            head = f"{self.system}\n\n"
            return RenderedPrompt(head + user, [(a + len(head), b + len(head)) for a, b in spans])
        messages = [{"role": "user", "content": user}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        at = text.rfind(user)  # chat templates insert the message verbatim
        return RenderedPrompt(text, [(a + at, b + at) for a, b in spans] if at >= 0 else [(0, len(text))])

    def render_table(self, table) -> list[RenderedPrompt | None] | None:
        """`prompt` of every row of an Arrow `table` at once (Arrow's string kernels, no dict per
        row), None for a row with a null field (`prompt` names it); None for the whole table where
        that does not apply: a chat template, jinja, a renderer of its own, a field that is not a
        text column."""
        if type(self).prompt is not PromptRenderer.prompt or self.chat or not isinstance(self.template, PromptTemplate):
            return None
        import pyarrow as pa
        import pyarrow.compute as pc

        head = "" if self.system is None else f"{self.system}\n\n"
        parts = [pa.scalar(head)] if head else []
        literal, data, fields = len(head), np.zeros(table.num_rows, np.int64), []  # before the next field: literal + data
        for text, column in self.template.pieces:
            if text:
                parts.append(pa.scalar(text))
                literal += len(text)
            if column is None:
                continue
            if column not in table.column_names or not (pa.types.is_string(table.schema.field(column).type)
                                                        or pa.types.is_large_string(table.schema.field(column).type)):
                return None
            values = table.column(column).cast(pa.string())
            parts.append(values)
            begin = literal + data
            data = data + pc.utf8_length(values).fill_null(0).to_numpy().astype(np.int64)
            fields.append(list(zip(begin.tolist(), (literal + data).tolist())))
        if not fields:
            return None
        texts = pc.binary_join_element_wise(*parts, "", null_handling="emit_null").to_pylist()
        return [None if text is None else RenderedPrompt(text, list(spans)) for text, spans in zip(texts, zip(*fields))]

    def encode(self, prompts: Sequence[str | RenderedPrompt]) -> list[list[int]]:
        """Tokenize many prompts at once (the chat template already holds special tokens).

        Text from the row's data never becomes a control token: a row whose data holds the text
        of a special token (`<|im_start|>assistant` — a forged turn) is tokenized piece by piece,
        its data pieces with the special tokens split into ordinary text. Every other row is
        tokenized whole, as before.
        """
        return self.encode_cuts(prompts)[0]

    def encode_cuts(self, prompts: Sequence[str | RenderedPrompt]) -> tuple[list[list[int]], list]:
        """`encode`'s token ids, and for each prompt where options may follow its tail alone
        (prepare/tail_tokens.py) its cut (k, c), else None. The batch goes straight to the
        tokenizer's backend where that gives the same ids (no per-text wrapper)."""
        if not prompts:
            return [], []
        prompts = [p if isinstance(p, RenderedPrompt) else RenderedPrompt(p, []) for p in prompts]
        result: list = [None] * len(prompts)
        cuts: list = [None] * len(prompts)
        rule = tail_rule(self.tokenizer) if not getattr(self.tokenizer, "split_special_tokens", False) else None
        for chat in (True, False):  # a chat template's text already holds BOS and the like
            at = [i for i, p in enumerate(prompts) if (self.chat if p.chat is None else p.chat) == chat]
            if not at:
                continue
            texts = [prompts[i].text for i in at]
            encodings = encode_batch(self.tokenizer, texts, not chat, backend=rule.backend if rule else None)
            if encodings is None:
                encoded = self.tokenizer(texts, add_special_tokens=not chat)["input_ids"]
            else:
                encoded = [encoding.ids for encoding in encodings]
                if rule is not None:
                    for i, encoding in zip(at, encodings):
                        cuts[i] = cut_of(encoding)
            for i, tokens in zip(at, encoded):
                result[i] = tokens
        for i, prompt in enumerate(prompts):
            if self.in_pieces(prompt):
                result[i], cuts[i] = self._encode_pieces(prompt), None
        return result, cuts

    def in_pieces(self, prompt: RenderedPrompt) -> bool:
        """True when `encode` tokenizes this prompt piece by piece (its data holds special-token text)."""
        return self._special is not None and any(self._special.search(prompt.text, a, b) for a, b in prompt.spans)

    @staticmethod
    def last_piece(prompt: RenderedPrompt) -> tuple[str, bool]:
        """The text `_encode_pieces` tokenizes last, and whether it is data (special tokens split)."""
        at, last = 0, (0, 0)
        for start, end in sorted(prompt.spans):
            at, last = max(at, end), (start, end) if end >= at else last
        if at < len(prompt.text):
            return prompt.text[at:], False
        return prompt.text[last[0] : last[1]], True

    def _encode_pieces(self, prompt: RenderedPrompt) -> list[int]:
        chat = self.chat if prompt.chat is None else prompt.chat
        tokens = self.tokenizer("", add_special_tokens=not chat)["input_ids"]  # BOS, if the model adds one
        at = 0
        for start, end in sorted(prompt.spans):
            if start > at:
                tokens += self.tokenizer(prompt.text[at:start], add_special_tokens=False)["input_ids"]
            tokens += self.tokenizer(prompt.text[start:end], add_special_tokens=False,
                                     split_special_tokens=True)["input_ids"]
            at = max(at, end)
        if at < len(prompt.text):
            tokens += self.tokenizer(prompt.text[at:], add_special_tokens=False)["input_ids"]
        return tokens


def special_token_pattern(tokenizer) -> re.Pattern | None:
    """A pattern matching the text of any of the tokenizer's special or added tokens (longest first),
    or None when it has none: text from the data that matches is tokenized as plain text."""
    specials = sorted({str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
                      | {str(t) for t in getattr(tokenizer, "get_added_vocab", dict)()}, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in specials if t)) if any(specials) else None


class RequestRenderer(PromptRenderer):
    """Prompts of OpenAI Batch requests (`input.format: openai_batch`, rows of
    formats/openai_batch.OPENAI_BATCH_SCHEMA): `messages` through the model's chat template, or a plain
    `prompt` (completions). Every message's content, and the whole plain prompt, is data."""

    def __init__(self, tokenizer):
        self._use_tokenizer(tokenizer)
        self.system = None
        self.chat = False

    @property
    def columns(self) -> list[str]:
        return ["messages", "prompt"]

    def prompt(self, row: dict[str, Any]) -> RenderedPrompt:
        if row.get("messages") is None:
            if row.get("prompt") is None:
                raise KeyError("prompt")
            return RenderedPrompt(row["prompt"], [(0, len(row["prompt"]))], chat=False)
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptTemplateError("input.format openai_batch: requests with body.messages need a model whose "
                                      "tokenizer has a chat template")
        messages = json.loads(row["messages"])
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        data = [m for m in messages if m["content"].strip()]  # an empty one has nothing a special token could hide in
        try:
            spans = contents_in_order(text, [m["content"] for m in data])
        except LookupError as missing:
            raise RowRenderError(f"the model's chat template changes the text of a {data[missing.args[0]]['role']!r} "
                                 "message; its data cannot be told from the template's own tokens") from None
        return RenderedPrompt(text, spans, chat=True)


def contents_in_order(text: str, contents: Sequence[str]) -> list[tuple[int, int]]:
    """The [start, end) span of each of `contents` in a chat-rendered `text`, found in order: chat
    templates insert each content in order, some stripped. Raises LookupError(index) for the first
    content that is not there."""
    spans, at = [], 0
    for index, content in enumerate(contents):
        found = text.find(content, at)
        if found < 0:
            content = content.strip()
            found = text.find(content, at)
        if found < 0:
            raise LookupError(index)
        spans.append((found, found + len(content)))
        at = found + len(content)
    return spans


def label_token_ids(tokenizer, labels: Sequence[str]) -> list[int]:
    """Map each label to its single token id; raises LabelError listing every bad label."""
    problems, ids = [], []
    for label in labels:
        tokens = tokenizer.encode(label, add_special_tokens=False)
        if len(tokens) != 1:
            pieces = [tokenizer.decode([t]) for t in tokens]
            problems.append(f"label {label!r} is {len(tokens)} tokens {pieces}, not one; "
                            "choose a label that is a single token (e.g. 'Yes'), or a shorter word")
        else:
            ids.append(tokens[0])
    if not problems and len(set(ids)) != len(ids):
        problems.append(f"labels {list(labels)} map to the same token ids {ids}; labels must be distinct tokens")
    if problems:
        raise LabelError("; ".join(problems))
    return ids
