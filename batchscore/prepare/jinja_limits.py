"""Limits on rendering one row with a jinja template, so that one row can only fail itself.

A template is a little program, and a row's data can make it big: `'x' * 10**10`,
`'x'.ljust(10**10)`, a macro that calls itself, two loops over a long string inside a macro.
`LimitedSandbox` refuses each of these as a RowRenderError of that row, before the memory is
asked for:

- every value a template builds (`*`, `**`, `+`, `%`, `~`, string methods, filters,
  `str.format`, a printed value) is measured first and refused over MAX_TEXT characters;
- all `{{ … }}` values of one rendering together, and every macro or block body, at most MAX_WORK;
- loop iterations and calls of one rendering together at most MAX_STEPS;
- macro calls and recursive loops inside one another at most MAX_DEPTH deep.

The rendered text itself is capped at MAX_TEXT by `JinjaTemplate.render` (prepare/jinja.py).
"""

from __future__ import annotations

import re
import threading
import types
from contextlib import contextmanager
from functools import update_wrapper
from typing import Any

from jinja2 import nodes
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import SandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from markupsafe import Markup

from batchscore.errors import RowRenderError

MAX_TEXT = 1 << 20  # characters: a prompt, or any one value a template builds (1 MiB)
MAX_WORK = 8 * MAX_TEXT  # characters of all printed values of one rendering (a macro's text is printed twice)
MAX_STEPS = 250_000  # loop iterations and calls of one rendering (a few seconds at most)
MAX_DEPTH = 50  # macro calls and recursive loops inside one another
_MAX_INT_BITS = 1 << 16  # an integer of ~20,000 digits; Python cannot even print longer ones
_STEPS = "__batchscore_steps__"  # the global every loop's iterable is wrapped in (see `limited_template`)

# A printf-style conversion: its width and precision (digits, or * taken from the arguments).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_NUMBER = re.compile(r"\d+")


def refuse(what: str, size: int | None = None, limit: int = MAX_TEXT) -> None:
    """Raise the row error for a template that would build more than `limit` characters."""
    about = f" of about {size:,} characters" if size is not None else ""
    raise RowRenderError(f"template: {what} would build a value{about}, over the limit of {limit:,} "
                         "characters per row")


def size_of(value: Any, limit: int = MAX_TEXT) -> int:
    """About how many characters `str(value)` has; stops counting soon after `limit`, so a huge
    value (or a list that holds itself) costs little to measure. Changes nothing."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend(item)
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            if total <= limit:
                stack.extend(item.keys())
                stack.extend(item.values())
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() * 3 // 10 + 1
        else:
            total += 8
        if total > limit:
            return total
    return total


def _check(what: str, size: int, limit: int = MAX_TEXT) -> None:
    if size > limit:
        refuse(what, size, limit)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _sized(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


def _percent_widths(fmt: str, args: Any) -> None:
    """Refuse `fmt % args` when a width or precision asks for more than MAX_TEXT characters."""
    star_args = [a for a in (args if isinstance(args, tuple) else (args,)) if _int(a)]
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for number in (width, precision):
            if number == "*":
                _check("a '%*' width", max((abs(a) for a in star_args), default=0))
            elif number:
                _check(f"the format width {number[:12]}", int(number) if len(number) < 12 else MAX_TEXT + 1)


def _spec_widths(spec: str) -> None:
    for number in _NUMBER.findall(spec):
        _check(f"the format spec {spec[:20]!r}", int(number) if len(number) < 12 else MAX_TEXT + 1)


class _LimitedFormatter(SandboxedFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        _spec_widths(format_spec)
        _check("a formatted value", size_of(value))
        return super().format_field(value, format_spec)


class _LimitedEscapeFormatter(_LimitedFormatter, SandboxedEscapeFormatter):
    pass


def _replace_size(s: str, old: str, new: str, count: Any = -1) -> int:
    times = len(s) + 1 if old == "" else (len(s) // len(old) if old else 0)
    if isinstance(count, int) and count >= 0:
        times = min(times, count)
    return len(s) + times * len(new)


# Methods of text and lists whose result can be far larger than their inputs: the size they
# would build, from (self, *args) as the template passes them.
_METHODS = {
    (str, "ljust"): lambda s, width=0, *_: max(len(s), _int(width)),
    (str, "rjust"): lambda s, width=0, *_: max(len(s), _int(width)),
    (str, "center"): lambda s, width=0, *_: max(len(s), _int(width)),
    (str, "zfill"): lambda s, width=0, *_: max(len(s), _int(width)),
    (str, "expandtabs"): lambda s, tabsize=8, *_: len(s) * max(_int(tabsize), 1),
    (str, "replace"): lambda s, old="", new="", count=-1, *_: _replace_size(s, str(old), str(new), count),
    (str, "join"): lambda s, items=(), *_: (len(s) * len(items) + size_of(items)) if isinstance(items, (list, tuple)) else 0,
    (list, "extend"): lambda s, items=(), *_: len(s) + (_sized(items) or 0),
}


def _filter_size(name: str, args: tuple, kwargs: dict) -> int:
    """The size a width-taking filter would build, from its arguments as the template passes them."""
    value = args[0] if args else ""
    arg = lambda i, key, default: args[i] if len(args) > i else kwargs.get(key, default)  # noqa: E731
    if name == "center":
        return max(size_of(value), _int(arg(1, "width", 80)))
    if name == "indent":
        width = arg(1, "width", 4)
        prefix = len(width) if isinstance(width, str) else _int(width)
        return size_of(value) + prefix * (str(value).count("\n") + 1 if isinstance(value, str) else 1)
    if name == "tojson":
        return size_of(value) * (1 + _int(arg(1, "indent", 0)))
    if name in ("slice", "batch"):
        return _int(arg(1, "slices" if name == "slice" else "linecount", 0)) + size_of(value)
    if name == "replace":
        count = arg(3, "count", None)
        return _replace_size(str(value) if isinstance(value, str) else "", str(arg(1, "old", "")),
                             str(arg(2, "new", "")), -1 if count is None else count)
    if name == "join":
        sep = arg(1, "d", "")
        return size_of(value) + len(str(sep)) * (len(value) if isinstance(value, (list, tuple)) else 1)
    if name == "wordwrap":
        wrap = arg(4, "wrapstring", None) or "\n"
        return size_of(value) * (1 + len(str(wrap)) // max(_int(arg(1, "width", 79)), 1))
    if name == "format":
        if isinstance(value, str):
            _percent_widths(value, tuple(args[1:]) or tuple(kwargs.values()))
        return size_of(value) + sum(size_of(a) for a in (*args[1:], *kwargs.values()))
    return size_of(value)  # every other filter reads its value whole (list, string, tojson, pprint, …)


class _State(threading.local):
    steps = 0
    depth = 0
    work = 0


class LimitedSandbox(SandboxedEnvironment):
    """jinja2's sandbox with the limits of this module (see its docstring). Render through
    `rendering()`, which gives each rendering a fresh budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        finalize = options.pop("finalize", None)
        super().__init__(finalize=self._measured(finalize), **options)
        self._state = _State()
        self.concat = self._concat
        self.globals[_STEPS] = self._counted
        self.globals["lipsum"] = self._lipsum
        self.filters = {name: self._limited_filter(name, f) for name, f in self.filters.items()}

    @contextmanager
    def rendering(self):
        """A fresh budget for one rendering."""
        state = self._state
        state.steps = state.depth = state.work = 0
        yield

    # --- what a template builds ----------------------------------------------------------------

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if _sized(seq) is not None and _int(times):
                    _check("repeating a value", _sized(seq) * _int(times))
            if _int(left) and _int(right):
                _check("multiplying numbers", (abs(left).bit_length() + abs(right).bit_length()) // 3,
                       _MAX_INT_BITS // 3)
        elif operator == "**":
            if _int(left) and abs(left) > 1 and _int(right) > 0:
                _check("a power", right * abs(left).bit_length() // 3, _MAX_INT_BITS // 3)
        elif operator == "+":
            if _sized(left) is not None and _sized(right) is not None:
                _check("joining two values", _sized(left) + _sized(right))
        elif operator == "%" and isinstance(left, str):
            _percent_widths(left, right)
            _check("a formatted text", len(left) + size_of(right))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 — jinja's signature
        state = __self._state
        state.steps += 1
        if state.steps > MAX_STEPS:
            raise RowRenderError(f"template: more than {MAX_STEPS:,} loop iterations and calls for one row")
        owner = getattr(__obj, "__self__", None)
        kind = str if isinstance(owner, str) else list if isinstance(owner, list) else None  # Markup is a str
        size = _METHODS.get((kind, getattr(__obj, "__name__", None)))
        if size is not None:
            _check(f"{kind.__name__}.{__obj.__name__}()", size(owner, *args, *kwargs.values()))
        if not isinstance(__obj, (Macro, LoopContext)):
            return super().call(__context, __obj, *args, **kwargs)
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level: its items count too
            args = (__self._counted(args[0]), *args[1:])
        state.depth += 1
        try:
            if state.depth > MAX_DEPTH:
                raise RowRenderError(f"template: macro calls or recursive loops nested more than {MAX_DEPTH} deep")
            return super().call(__context, __obj, *args, **kwargs)
        finally:
            state.depth -= 1

    def wrap_str_format(self, value: Any):
        """`str.format` and `format_map` as the sandbox runs them, with every field's width and
        value measured (jinja's own wrapper, with a limited formatter)."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or \
                value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str):
            return None
        text = value.__self__
        formatter = _LimitedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup) \
            else _LimitedFormatter(self)

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if value.__name__ == "format_map":
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return type(text)(formatter.vformat(text, args, kwargs))

        return update_wrapper(wrapper, value)

    def _limited_filter(self, name: str, func):
        def limited(*args: Any, **kwargs: Any) -> Any:
            # Filters that take the context or environment first: the value is the next argument.
            shown = args[1:] if args and not _is_value_first(func) else args
            _check(f"the filter {name!r}", _filter_size(name, shown, kwargs))
            return func(*args, **kwargs)

        return update_wrapper(limited, func)

    def _measured(self, finalize):
        def measured(value: Any) -> Any:
            size = size_of(value)
            _check("a printed value", size)
            self._state.work += size
            _check("all printed values together", self._state.work, MAX_WORK)
            return finalize(value) if finalize is not None else value

        return measured

    def _concat(self, pieces) -> str:
        """A macro's, block's or `{% set %}` block's text (the rendering's own output is
        streamed and capped by the caller)."""
        pieces = list(pieces)
        _check("a macro or block's text", sum(len(p) for p in pieces), MAX_WORK)
        return "".join(pieces)

    def _counted(self, iterable):
        state = self._state
        for item in iterable:
            state.steps += 1
            if state.steps > MAX_STEPS:
                raise RowRenderError(f"template: more than {MAX_STEPS:,} loop iterations and calls for one row")
            yield item

    @staticmethod
    def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
        from jinja2.utils import generate_lorem_ipsum

        _check("lipsum()", _int(n) * _int(max) * 10)
        return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def _is_value_first(func) -> bool:
    """False for filters that jinja passes the context, eval context or environment first."""
    from jinja2.utils import _PassArg

    return _PassArg.from_obj(func) is None


def _str_join(seq) -> str:
    """jinja's `a ~ b`, measured first."""
    pieces = list(seq)
    _check("joining text with '~'", sum(size_of(p) for p in pieces))
    return "".join(map(str, pieces))


def limited_template(env: LimitedSandbox, source):
    """Compile `source` (text or a parsed tree) for `env`: every loop's items counted, every
    `~` measured. Changes the tree it is given."""
    tree = env.parse(source) if isinstance(source, str) else source
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Call(nodes.Name(_STEPS, "load"), [loop.iter], [], None, None, lineno=loop.lineno)
    template = env.from_string(tree)
    # The compiled module joins `a ~ b` with jinja.runtime.str_join, looked up in its globals.
    template.root_render_func.__globals__["str_join"] = _str_join
    return template


__all__ = ["LimitedSandbox", "limited_template", "refuse", "size_of", "MAX_TEXT", "MAX_WORK", "MAX_STEPS",
           "MAX_DEPTH"]
