"""The two labeled sets behind docs/quality.md, and its table of every calibration method.

    python sample_data/calibration_quality.py data out/quality     # the sets and their job files
    batchscore run out/quality/relevance.yaml                       # each scored once, with contextual
    batchscore run out/quality/langid.yaml                          #   calibration (its content-free input)
    python sample_data/calibration_quality.py table out/quality/relevance.yaml out/quality/langid.yaml

relevance: jobs/sample.yaml's 200 product/query pairs, labeled: make_sample.py writes query i for
product i + 1 (P001 'waterproof boots for hiking in the rain' … P010 'tool to hang shelves on a
brick wall'), so exactly those 10 pairs are relevant (10 Yes, 190 No).
langid: 50 paragraphs each of German, French, Spanish and Italian, from the translated manual
pages under /usr/share/man (Debian's base packages ship them; nothing is downloaded).

`table` re-assembles each scored output under every `score.calibrate` through the code a run
uses at assembly (scores/quality.py): the raw p_<label> columns do not depend on the method, so
one scoring serves all; contextual reuses the run's own content-free values (calibrate.from).
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

HERE = Path(__file__).resolve().parent
LANGUAGES = {"de": "German", "fr": "French", "es": "Spanish", "it": "Italian"}
PER_LANGUAGE = 50
ACCENTS = {":": "\u0308", "'": "\u0301", "`": "\u0300", "^": "\u0302", "~": "\u0303", ",": "\u0327"}
ENGLISH = {"the", "and", "of", "is", "to", "with", "this", "for", "are", "be"}  # untranslated paragraphs
COMMON = {"model": "smollm2-135m-instruct", "engine": {"kind": "torch", "dtype": "float32"},
          "score": {"calibrate": "contextual"}}
REVIEW = {"review": {"max_error": 0.05, "confidence": 0.95}, "out_of_scope": {"min_label_mass": "auto"}}


def relevance(folder: Path) -> None:
    rows = pq.read_table(HERE / "relevance.parquet").to_pylist()
    for row in rows:
        row["relevant"] = "Yes" if int(row["product_id"][1:]) - 1 == int(row["pair_id"][-2:]) else "No"
    pq.write_table(pa.Table.from_pylist(rows), folder / "relevance.parquet")
    from batchscore.config import safe_load_yaml  # YAML 1.2 booleans: labels [Yes, No] stay text

    sample = safe_load_yaml((HERE.parent / "jobs" / "sample.yaml").read_text())
    job = {"input": {"path": "relevance.parquet", "id_column": "pair_id"}, "prompt": sample["prompt"],
           "labels": sample["labels"], **COMMON, "calibrate": {"truth_column": "relevant"},
           "output": {"path": "relevance_scores.parquet", "keep_columns": ["product_id", "query"], **REVIEW}}
    (folder / "relevance.yaml").write_text(yaml.safe_dump(job, sort_keys=False))


def _char(name: str) -> str:
    """A roff special character (\\(:a, \\[u00E9]) as text."""
    if name == "ss":
        return "ß"
    if name.startswith("u") and len(name) == 5:
        return chr(int(name[1:], 16))
    if len(name) == 2 and name[0] in ACCENTS:
        return unicodedata.normalize("NFC", name[1] + ACCENTS[name[0]])
    return ""


def _paragraphs(path: Path):
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8", "replace")
    lines = []
    for line in text.splitlines() + [""]:
        if line.startswith((".", "'")) or not line.strip():  # a roff request or a blank line ends a paragraph
            if lines:
                yield " ".join(" ".join(lines).split())
            lines = []
            continue
        line = re.sub(r"\\f(\[[^]]*\]|\(..|.)", "", line)
        line = re.sub(r"\\\((..)|\\\[([^]]*)\]", lambda m: _char(m[1] or m[2]), line)
        lines.append(re.sub(r"\\[&e|^%]", "", line).replace("\\-", "-").replace("\\", "").strip())


def langid(folder: Path) -> None:
    rows = []
    for code, name in LANGUAGES.items():
        found = set()
        for path in sorted(Path("/usr/share/man", code).rglob("*")):
            for text in _paragraphs(path) if path.is_file() else ():
                words = text.split()
                if (15 <= len(words) <= 60 and sum(w.lower() in ENGLISH for w in words) < 2
                        and sum(c.isalpha() for c in text) > 0.7 * len(text)):
                    found.add(text)
        chosen = sorted(found, key=lambda t: hashlib.sha256(t.encode()).hexdigest())[:PER_LANGUAGE]
        if len(chosen) < PER_LANGUAGE:
            sys.exit(f"/usr/share/man/{code}: {len(chosen)} paragraphs, {PER_LANGUAGE} needed (install manpages-{code})")
        rows += [{"text_id": f"{code}-{i:03d}", "text": t, "language": name} for i, t in enumerate(chosen)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "langid.parquet")
    job = {"input": {"path": "langid.parquet", "id_column": "text_id"},
           "prompt": {"chat": True, "template": "Text: {text}\n\nWhich language is this text written in: German, "
                                                "French, Spanish or Italian? Answer with the language only."},
           "labels": list(LANGUAGES.values()), **COMMON, "calibrate": {"truth_column": "language"},
           "output": {"path": "langid_scores.parquet", **REVIEW}}
    (folder / "langid.yaml").write_text(yaml.safe_dump(job, sort_keys=False))


def table(job_path: str) -> None:
    """Print one markdown row per method for the scored output of `job_path`."""
    from batchscore.jobfile import load_job
    from batchscore.output import layout
    from batchscore.scores.quality import add_quality_columns

    config = load_job(job_path)
    scored = pq.read_table(config.output.path)
    ok = np.array([s == layout.STATUS_OK for s in scored.column(layout.STATUS).to_pylist()])
    names = [layout.label_column(label) for label in config.labels] + [layout.LABEL, layout.LABEL_MASS]
    columns = {name: scored.column(name).combine_chunks() for name in names}
    kept = scored.select([config.calibrate.truth_column])
    ids = scored.column(config.input.id_column).combine_chunks()
    print(f"\n{Path(job_path).stem}: {int(ok.sum())} rows, labels {config.labels}\n")
    print(f"| score.calibrate | fit / eval rows | ECE | Brier | NLL | accuracy | rows per label ({' / '.join(config.labels)}) "
          "| review coverage (≤ 5% error at 95%) |")
    print("|---|---|---|---|---|---|---|---|")
    for method in ("none", "batch", "contextual", "temperature", "vector", "platt"):
        if method == "platt" and len(config.labels) != 2:
            continue
        config.score.calibrate = method
        config.calibrate.from_ = config.output.path if method == "contextual" else None
        _, result = add_quality_columns(config, dict(columns), ok, kept, ids)
        cal, rev = result.calibration, result.review
        before, after = cal["before"], cal["after"] or cal["before"]
        pair = lambda key: (f"{before[key]:.3f}" if method == "none"
                            else f"{before[key]:.3f} → {after[key]:.3f}")  # noqa: E731
        chosen = cal.get("label_counts", {}).get("calibrated") or raw_labels(columns, config.labels, ok)
        split = " / ".join(str(chosen.get(label, 0)) for label in config.labels)
        print(f"| {method} | {cal['fit_rows']} / {cal['eval_rows']} | {pair('ece')} | {pair('brier')} | {pair('nll')} "
              f"| {pair('accuracy')} | {split} | {rev['coverage']:.0%} of {rev['rows']} |")


def raw_labels(columns: dict, labels: list[str], ok: np.ndarray) -> dict[str, int]:
    """Rows per most probable label of the raw p_<label> (the written `label` follows calibration)."""
    from batchscore.output import layout

    p = np.column_stack([columns[layout.label_column(label)].to_numpy(zero_copy_only=False) for label in labels])
    best = np.argmax(p[ok], axis=1)
    return {label: int(np.sum(best == i)) for i, label in enumerate(labels)}


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "data":
        folder = Path(sys.argv[2])
        folder.mkdir(parents=True, exist_ok=True)
        relevance(folder)
        langid(folder)
        print(f"wrote {folder}/relevance.parquet, langid.parquet and their job files")
    elif len(sys.argv) >= 3 and sys.argv[1] == "table":
        for job in sys.argv[2:]:
            table(job)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
