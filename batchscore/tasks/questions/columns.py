"""The names of a questions output's columns: each question's columns are `<question id>.<part>`
(and `<question id>.<part>.<option>` for a value per option), named here and nowhere else."""

from __future__ import annotations

# the parts of a question's columns
STATUS, ERROR, LABEL_MASS, ARGMAX_IS_LABEL = "status", "error", "label_mass", "argmax_is_label"
CHOICE, P_YES, SCORE, CONFIDENCE = "choice", "p_yes", "score", "confidence"
P, P_CAL = "p", "p_cal"  # per option: the probability, the calibrated probability
NEEDS_REVIEW, OUT_OF_SCOPE = "needs_review", "out_of_scope"

EVERY_QUESTION = (STATUS, ERROR, LABEL_MASS, ARGMAX_IS_LABEL)  # every question has these columns
VALUE_PARTS = (CHOICE, P_YES, SCORE, CONFIDENCE)  # and one of these (or `.p.<option>` columns)
NOT_ASKED = "not asked"  # `<id>.status` of a record whose own questions did not include this one


def column(key: str, part: str, option: object = None) -> str:
    """The name of question `key`'s column `part` (of `option`, for a per-option part)."""
    return f"{key}.{part}" if option is None else f"{key}.{part}.{option}"


def key_of(name: str, part: str) -> str | None:
    """The question id whose `part` column `name` is, else None."""
    tail = column("", part)
    return name[: -len(tail)] if name.endswith(tail) else None


def is_question_column(name: str, key: str, part: str | None = None) -> bool:
    """`name` is one of question `key`'s columns (of `part`'s options, when given)."""
    return name.startswith(column(key, "") if part is None else column(key, part, ""))


def question_keys(names: list[str]) -> list[str]:
    """The question ids of a questions output, in column order ([] for another output). A
    question is an `<id>.status` column with at least one more of its columns; one missing some of
    EVERY_QUESTION is still a question (`missing_question_columns` says which), so it is reported,
    not dropped. A kept input column such as `order.status` alone makes no question."""
    present = set(names)
    keys = []
    for name in names:
        key = key_of(name, STATUS)
        if key is None:
            continue
        own = [column(key, part) for part in EVERY_QUESTION[1:] + VALUE_PARTS]
        if any(c in present for c in own) or any(is_question_column(n, key, P) for n in names):
            keys.append(key)
    return keys


def missing_question_columns(names: list[str], key: str) -> list[str]:
    """The columns every question has (EVERY_QUESTION) that question `key` lacks."""
    present = set(names)
    return [column(key, part) for part in EVERY_QUESTION if column(key, part) not in present]


# ---------------------------------------------------------------------------- output.column_separator
# The columns are named `<id>.<part>[.<option>]` everywhere inside batchscore; the writer joins them
# with the job's separator instead (`joined`), and the report reads them back (`dotted`).

PER_OPTION = (P, P_CAL)  # the parts followed by an option


def joined(name: str, keys: list[str], sep: str) -> str:
    """Question column `name` (`<id>.<part>[.<option>]` of one of `keys`) with its parts joined by
    `sep`: `team.p_cal.billing` → `team__p_cal__billing`. Other names come back unchanged."""
    key = max((k for k in keys if name.startswith(k + ".")), key=len, default=None)
    if sep == "." or key is None:
        return name
    return key + sep + _rest(name[len(key) + 1:], ".", sep)


def dotted(names: list[str], sep: str) -> dict[str, str]:
    """Each of `names` (an output's columns, joined by `sep`) → its name inside batchscore (`.`)."""
    if sep == ".":
        return {name: name for name in names}
    keys = [name[: -len(sep + STATUS)] for name in names if name.endswith(sep + STATUS)]
    out = {}
    for name in names:
        key = max((k for k in keys if name.startswith(k + sep)), key=len, default=None)
        out[name] = name if key is None else key + "." + _rest(name[len(key) + len(sep):], sep, ".")
    return out


def _rest(rest: str, old: str, new: str) -> str:
    """A column's `<part>[<old><option>]` with `new` between the part and the option."""
    part = next((p for p in PER_OPTION if rest.startswith(p + old)), None)
    return rest if part is None else part + new + rest[len(part) + len(old):]


def separator_of(names: list[str], metadata: dict | None) -> str:
    """The separator an output's question columns are joined by: the one its Parquet schema records
    (output/layout.SEPARATOR_KEY), else the one that names a question (JSON Lines keep no schema)."""
    from batchscore.output.layout import COLUMN_SEPARATORS, SEPARATOR_KEY

    recorded = (metadata or {}).get(SEPARATOR_KEY.encode())
    if recorded is not None:
        return recorded.decode()
    return next((sep for sep in COLUMN_SEPARATORS if question_keys(list(dotted(names, sep).values()))), ".")


# ---------------------------------------------------------------------------- output.column_names: slug
# A question's per-option columns (`<id>.p.<option>`, `<id>.p_cal.<option>`) named by each option's
# slug instead (`category.p.home_garden` for `Home & Garden`: output/column_names.py); the schema
# records each slug's option per question (QUESTION_LABELS_KEY), from which the report reads them back.

QUESTION_LABELS_KEY = "batchscore.question_column_labels"  # JSON {question id: {slug: option}}


def option_slugs(questions) -> dict[str, dict[str, str]]:
    """{question id: {option: its slug}} of every question's options."""
    from batchscore.output.column_names import slug

    return {str(q.key): {str(o): slug(str(o)) for o in q.options} for q in questions}


def slugged(name: str, slugs: dict[str, dict[str, str]]) -> str:
    """Question column `name` (`<id>.<part>.<option>`, as inside batchscore) with its option named by
    the option's slug (`slugs`: option_slugs); other names come back unchanged."""
    key = max((k for k in slugs if name.startswith(k + ".")), key=len, default=None)
    if key is None:
        return name
    rest = name[len(key) + 1:]
    part = next((p for p in PER_OPTION if rest.startswith(p + ".")), None)
    option = None if part is None else rest[len(part) + 1:]
    return name if option not in slugs[key] else column(key, part, slugs[key][option])


def by_option_text(names: list[str], metadata: dict | None) -> list[str]:
    """An output's column names (as inside batchscore, `<id>.<part>.<option>`) with each slugged
    option named by its text again, by the slugs its schema records (unchanged without them)."""
    import json

    raw = (metadata or {}).get(QUESTION_LABELS_KEY.encode())
    if not raw:
        return names
    return [slugged(name, json.loads(raw)) for name in names]  # {slug: option} turns a slug back into its text
