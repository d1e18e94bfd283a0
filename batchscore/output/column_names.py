"""`output.column_names: slug`: a label's columns named so a warehouse takes them unquoted.

Inside batchscore a label's columns are `p_<label>`, `p_cal_<label>` and `logp_<label>` with the
label as written (`p_Home & Garden`), which DuckDB and BigQuery refuse without quotes. In slug mode
the output names them by the label's slug instead — lowercase `[a-z0-9_]`, accents dropped
(`Home & Garden` -> `home_garden`: `p_home_garden`) — while the model still reads the label's text
and the `label` column still holds it. The schema records each slug's label (COLUMN_LABELS_KEY), so
the writer renames the columns as it writes (`as_written`) and a reader of the output gets the
names batchscore uses back (`as_read`: re-derive, the report).
"""

from __future__ import annotations

import json
import re
import unicodedata

import pyarrow as pa

from batchscore.output.layout import LABEL_PREFIX, LOGP_PREFIX, P_CAL_PREFIX

COLUMN_NAMES = ("text", "slug")  # output.column_names
COLUMN_LABELS_KEY = "batchscore.column_labels"  # JSON {slug: label}, in a slug output's schema
_PREFIXES = (P_CAL_PREFIX, LOGP_PREFIX, LABEL_PREFIX)  # the longest first: p_cal_ before p_


def slug(label: str) -> str:
    """`label` as lowercase [a-z0-9_]: accents dropped, every other run of characters one `_`
    ('Home & Garden' -> 'home_garden'); '' when nothing of it is a letter a-z or a digit."""
    plain = unicodedata.normalize("NFKD", label).encode("ascii", "ignore").decode().lower()
    return re.sub(r"[^a-z0-9]+", "_", plain).strip("_")


def slug_problems(labels: list[str]) -> list[str]:
    """What output.column_names: slug refuses of `labels`: one without a slug, two with one slug."""
    problems, seen = [], {}
    for label in labels:
        name = slug(label)
        if not name:
            problems.append(f"output.column_names slug: the label {label!r} has no letter a-z or digit to name its "
                            "columns by; rename it, or keep output.column_names: text")
        elif name in seen and seen[name] != label.strip():
            problems.append(f"output.column_names slug: the labels {seen[name]!r} and {label!r} would both be "
                            f"written as p_{name}; make them differ in letters or digits")
        seen.setdefault(name, label.strip())
    return problems


def column_labels(config) -> dict[str, str]:
    """{slug: label} of a slug job's fixed labels ({} in text mode, or for per-row choices)."""
    if config.output.column_names != "slug":
        return {}
    return {slug(label): label.strip() for label in config.labels}


def metadata(config) -> dict[str, str]:
    """What the output's schema records for its column names (COLUMN_LABELS_KEY in slug mode)."""
    labels = column_labels(config)
    return {COLUMN_LABELS_KEY: json.dumps(labels, ensure_ascii=False)} if labels else {}


def _renames(names: list[str], labels: dict[str, str], to_slug: bool) -> dict[str, str]:
    """{name: new name} of the label columns among `names` (`to_slug`: text -> slug, else back)."""
    pairs = {prefix + (text if to_slug else key): prefix + (key if to_slug else text)
             for key, text in labels.items() for prefix in _PREFIXES}
    return {name: pairs[name] for name in names if name in pairs}


def _recorded(schema: pa.Schema) -> dict[str, str]:
    raw = (schema.metadata or {}).get(COLUMN_LABELS_KEY.encode())
    return json.loads(raw) if raw else {}


def as_written(table: pa.Table) -> pa.Table:
    """`table` (named as inside batchscore) with its label columns renamed to the slugs its schema
    records (unchanged without them)."""
    return _renamed(table, True)


def as_read(table: pa.Table) -> pa.Table:
    """An output read back with its label columns named as inside batchscore again (`p_<label>`),
    by the slugs its schema records (unchanged without them)."""
    return _renamed(table, False)


def _renamed(table: pa.Table, to_slug: bool) -> pa.Table:
    labels = _recorded(table.schema)
    renames = _renames(table.column_names, labels, to_slug) if labels else {}
    if not renames:
        return table
    renamed = table.rename_columns([renames.get(name, name) for name in table.column_names])
    return renamed.replace_schema_metadata(table.schema.metadata)  # the metadata kept: the writer reads it


def written_schema(schema: pa.Schema) -> pa.Schema:
    """`schema`'s field names as `as_written` names them."""
    labels = _recorded(schema)
    renames = _renames(schema.names, labels, True) if labels else {}
    return pa.schema([field.with_name(renames.get(field.name, field.name)) for field in schema],
                     metadata=schema.metadata)
