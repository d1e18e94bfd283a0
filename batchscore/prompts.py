"""Prompt templates, chat templates and label tokenization.

Templates use `{column}` fields only. They are parsed, not evaluated: a field cannot reach
attributes (`{a.b}`), indexes (`{a[0]}`), conversions (`{a!r}`) or format specs, so a job file
cannot run code or read anything but the row's own columns.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Sequence

from batchscore.errors import LabelError, PromptTemplateError


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
        out = []
        for literal, column in self.pieces:
            out.append(literal)
            if column is not None:
                value = row.get(column)
                if value is None:
                    raise KeyError(column)
                out.append(str(value))
        return "".join(out)


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


def template_fields(template: str) -> list[str]:
    """The column names a template uses (validates it on the way)."""
    return parse_template(template).columns


class PromptRenderer:
    """Renders rows into prompt token ids with a tokenizer, optionally via its chat template."""

    def __init__(self, tokenizer, template: str, *, system: str | None = None, chat: bool = False):
        self.tokenizer = tokenizer
        self.template = parse_template(template)
        self.system = system
        self.chat = chat
        if chat and not getattr(tokenizer, "chat_template", None):
            raise PromptTemplateError("prompt.chat is true but the model's tokenizer has no chat template")

    def text(self, row: dict[str, Any]) -> str:
        """The full prompt text for one row (chat template applied when asked)."""
        user = self.template.render(row)
        if not self.chat:
            return user if self.system is None else f"{self.system}\n\n{user}"
        messages = [{"role": "user", "content": user}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Tokenize many prompt texts at once (the chat template already holds special tokens)."""
        if not texts:
            return []
        return self.tokenizer(list(texts), add_special_tokens=not self.chat)["input_ids"]


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


def label_column(label: str) -> str:
    """Output column name for a label's probability, e.g. 'Yes' -> 'p_Yes'."""
    return f"p_{label.strip()}"
