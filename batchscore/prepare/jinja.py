"""`prompt.engine: jinja`: prompt templates rendered by jinja2's sandbox.

The row's columns are the template's variables, so a template can loop over a list column
(few-shot examples) and branch on a value:

    {% for ex in examples %}Q: {{ ex.q }}
    A: {{ ex.a }}
    {% endfor %}{% if hint %}Hint: {{ hint }}
    {% endif %}Q: {{ query }}

`SandboxedEnvironment` refuses unsafe attribute access (`__class__`, …), so a job file still
cannot run code; prepare/jinja_limits.py bounds what one row's rendering may build (text over
1 MiB, `'x' * 10**10`, recursion deeper than 50, endless loops), so a row can only fail itself.
`StrictUndefined`: a variable that is not a column fails the row instead of
rendering as empty text. A null column value is false in `{% if %}` and `is defined` tests, but
outputting it (`{{ hint }}`) or looping over it fails the row, like a null `{field}` of the format
engine; so does any `{{ … }}` that evaluates to null (e.g. a null field inside a list item).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from jinja2 import StrictUndefined, TemplateError, TemplateSyntaxError, meta

from batchscore.errors import NullFieldError, PromptTemplateError, RowRenderError
from batchscore.prepare.jinja_limits import MAX_TEXT, LimitedSandbox, limited_template, refuse

# A `{column}` field of the format engine, which jinja would print as literal text.
_FORMAT_FIELD = re.compile(r"(?<!\{)\{\s*([A-Za-z_]\w*)\s*\}(?!\})")
_RAW_OR_COMMENT = re.compile(r"\{%-?\s*raw\s*-?%\}.*?\{%-?\s*endraw\s*-?%\}|\{#.*?#\}", re.S)

# For the spans of data, a second rendering wraps every `{{ … }}` value in these marks, so the
# text that came from expressions (the row's data) is known: special-token text there is tokenized
# as text (prompts.PromptRenderer.encode). A random nonce per process: data cannot forge a mark.
_NONCE = str(secrets.randbits(64))
_OPEN, _CLOSE = f"\ue000{_NONCE}\ue001", f"\ue002{_NONCE}\ue003"
_MARK = re.compile(re.escape(_OPEN) + "|" + re.escape(_CLOSE))


class _Null(StrictUndefined):
    """A column whose value is null: false in conditions, an error when printed or iterated."""

    __slots__ = ()

    def __init__(self, name: str):
        super().__init__(hint=name, name=name, exc=NullFieldError)

    def __bool__(self) -> bool:
        return False


def _finalize(value: Any) -> Any:
    """Every `{{ … }}` value: null fails the row instead of printing 'None'."""
    if value is None:
        raise RowRenderError("a {{ … }} expression in the template is null (e.g. a null field of a list item)")
    return value


def _finalize_marked(value: Any) -> str:
    return f"{_OPEN}{_finalize(value)}{_CLOSE}"


def _environment(marked: bool = False) -> LimitedSandbox:
    # keep_trailing_newline: the text ends as written, as with the format engine.
    return LimitedSandbox(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True,
                          finalize=_finalize_marked if marked else _finalize)


def _unmark(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without marks and the [start, end) spans of marked (data) text; nested marks
    (a macro's output printed again) merge. Unbalanced marks: the whole text is data."""
    out, spans, depth, at, length, start = [], [], 0, 0, 0, 0
    for match in _MARK.finditer(marked):
        piece = marked[at:match.start()]
        out.append(piece)
        length += len(piece)
        at = match.end()
        if match.group() == _OPEN:
            if depth == 0:
                start = length
            depth += 1
        else:
            depth -= 1
            if depth < 0:
                break
            if depth == 0 and length > start:
                spans.append((start, length))
    out.append(marked[at:])
    text = "".join(out)
    if depth != 0 or _OPEN in text or _CLOSE in text:
        text = _MARK.sub("", marked)
        return text, [(0, len(text))] if text else []
    return text, spans


@dataclass(frozen=True)
class JinjaTemplate:
    """A compiled jinja template and the columns it reads."""

    source: str
    columns: list[str]
    _template: Any = field(compare=False, repr=False)
    _marked: Any = field(compare=False, repr=False)  # the same template, every `{{ … }}` value marked

    def render(self, row: dict[str, Any]) -> str:
        """Render one row; raises NullFieldError (a KeyError) naming a null or missing column that
        the template prints or loops over, RowRenderError for any other failure of this row."""
        return _render(self._template, self._variables(row), MAX_TEXT)

    def render_spans(self, row: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
        """Render one row: the text and the [start, end) spans every `{{ … }}` value fills. When the
        marks change what the template does (a filter over a block's text, e.g. `truncate`), the
        whole text counts as data. Raises as `render`."""
        text = self.render(row)
        try:
            unmarked, spans = _unmark(_render(self._marked, self._variables(row), 2 * MAX_TEXT))
        except RowRenderError:  # the text rendered; only the marks failed
            unmarked, spans = None, []
        if unmarked != text:
            return text, [(0, len(text))] if text else []
        return text, spans

    def _variables(self, row: dict[str, Any]) -> dict[str, Any]:
        return {name: _Null(name) if row.get(name) is None else row[name] for name in self.columns}


def parse_jinja_template(template: str) -> JinjaTemplate:
    """Compile `template`; raises PromptTemplateError naming the line of a syntax error."""
    env = _environment()
    try:
        tree = env.parse(template)
    except TemplateSyntaxError as exc:
        lines = template.splitlines()
        text = lines[exc.lineno - 1].strip() if 0 < exc.lineno <= len(lines) else ""
        raise PromptTemplateError(f"jinja syntax error on line {exc.lineno}: {exc.message}"
                                  + (f" (line {exc.lineno}: {text!r})" if text else "")) from None
    stray = _FORMAT_FIELD.findall(_RAW_OR_COMMENT.sub("", template))
    if stray:
        raise PromptTemplateError(
            f"{{{stray[0]}}} is a format-engine field; with prompt.engine: jinja write {{{{ {stray[0]} }}}} "
            "(literal braces: {% raw %}{...}{% endraw %})")
    # Names the template assigns itself (loop variables, {% set %}) are not columns; neither are
    # jinja's globals (range, dict, …).
    columns = sorted(name for name in meta.find_undeclared_variables(tree) if name not in env.globals)
    return JinjaTemplate(template, columns, limited_template(env, tree),
                         limited_template(_environment(marked=True), template))


def _render(template, variables: dict[str, Any], limit: int) -> str:
    """Render one row within the limits of jinja_limits.py and at most `limit` characters of
    text; raises RowRenderError for any failure of this row (NullFieldError for a null column)."""
    env = template.environment
    try:
        with env.rendering():
            pieces, size = [], 0
            for piece in template.generate(variables):
                size += len(piece)
                if size > limit:
                    refuse("the prompt", size, limit)
                pieces.append(piece)
            return "".join(pieces)
    except RowRenderError:
        raise
    except TemplateError as exc:  # undefined attributes, the sandbox's refusals, …
        raise RowRenderError(f"template: {exc.message or exc}") from None
    except RecursionError:
        raise RowRenderError("template: nested too deeply (a value or macro that contains itself?)") from None
    except MemoryError:
        raise RowRenderError("template: ran out of memory rendering this row") from None
    except Exception as exc:  # noqa: BLE001 — whatever one row's data makes its template do fails that row
        raise RowRenderError(f"template: {type(exc).__name__}: {exc}") from None
