"""`prompt.engine: jinja`: prompt templates rendered by jinja2's sandbox.

The row's columns are the template's variables, so a template can loop over a list column
(few-shot examples) and branch on a value:

    {% for ex in examples %}Q: {{ ex.q }}
    A: {{ ex.a }}
    {% endfor %}{% if hint %}Hint: {{ hint }}
    {% endif %}Q: {{ query }}

`SandboxedEnvironment` refuses unsafe attribute access (`__class__`, …), so a job file still
cannot run code. `StrictUndefined`: a variable that is not a column fails the row instead of
rendering as empty text. A null column value is false in `{% if %}` and `is defined` tests, but
outputting it (`{{ hint }}`) or looping over it fails the row, like a null `{field}` of the format
engine; so does any `{{ … }}` that evaluates to null (e.g. a null field inside a list item).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from jinja2 import StrictUndefined, TemplateError, TemplateSyntaxError, UndefinedError, meta
from jinja2.sandbox import SandboxedEnvironment

from batchscore.prompts import PromptTemplateError, RowRenderError

# A `{column}` field of the format engine, which jinja would print as literal text.
_FORMAT_FIELD = re.compile(r"(?<!\{)\{\s*([A-Za-z_]\w*)\s*\}(?!\})")
_RAW_OR_COMMENT = re.compile(r"\{%-?\s*raw\s*-?%\}.*?\{%-?\s*endraw\s*-?%\}|\{#.*?#\}", re.S)


class _NullColumn(UndefinedError):
    """A null (or absent) column was printed or iterated; the message is the column's name."""


class _Null(StrictUndefined):
    """A column whose value is null: false in conditions, an error when printed or iterated."""

    __slots__ = ()

    def __init__(self, name: str):
        super().__init__(hint=name, name=name, exc=_NullColumn)

    def __bool__(self) -> bool:
        return False


def _finalize(value: Any) -> Any:
    """Every `{{ … }}` value: null fails the row instead of printing 'None'."""
    if value is None:
        raise RowRenderError("a {{ … }} expression in the template is null (e.g. a null field of a list item)")
    return value


def _environment() -> SandboxedEnvironment:
    # keep_trailing_newline: the text ends as written, as with the format engine.
    return SandboxedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True,
                                finalize=_finalize)


@dataclass(frozen=True)
class JinjaTemplate:
    """A compiled jinja template and the columns it reads."""

    source: str
    columns: list[str]
    _template: Any = field(compare=False, repr=False)

    def render(self, row: dict[str, Any]) -> str:
        """Render one row; raises KeyError naming a null or missing column that the template
        prints or loops over, RowRenderError for any other failure of this row."""
        variables = {name: _Null(name) if row.get(name) is None else row[name] for name in self.columns}
        try:
            return self._template.render(variables)
        except _NullColumn as exc:
            raise KeyError(exc.message) from None
        except TemplateError as exc:  # undefined attributes, the sandbox's refusals, …
            raise RowRenderError(f"template: {exc.message or exc}") from None
        except RowRenderError:
            raise
        except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as exc:
            raise RowRenderError(f"template: {type(exc).__name__}: {exc}") from None


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
    return JinjaTemplate(template, columns, env.from_string(tree))
