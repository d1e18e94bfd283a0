"""The report as one self-contained HTML file: inline CSS, plots as base64 PNG, no scripts.

Plots are drawn with matplotlib's Agg canvas on `Figure` objects (no pyplot, so no global backend
or figure state is touched). Every section has a stable id (SECTION_IDS).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

import batchscore.report.drift as drift_mod
import batchscore.report.stats as stats
from batchscore.output.summary import RunSummary
from batchscore.report import quality, quality_html
from batchscore.report.data import ScoredOutput
from batchscore.report.page import escape as _e, figure as _figure, img as _img, num as _num, pct as _pct
from batchscore.report.page import PLAIN_TEXT, document as _document, section as _section, short as _short
from batchscore.report.page import table as _table

SECTION_IDS = ("summary", "quality", "prevalence", "audit", "label-distribution", "probabilities", "label-mass",
               "errors", "throughput", "drift")  # the numbers to act on first
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
PREVIOUS_COLOR, CURRENT_COLOR = "#9e9e9e", "#1f77b4"



def render(current: ScoredOutput, previous: ScoredOutput | None, summary: RunSummary | None,
           metrics_note: str, truth: str | None = None) -> str:
    """The whole HTML document. `summary`: the run's (from its --metrics JSON or completion
    marker); `metrics_note` says where it came from or was looked for;
    `truth`: the output's column of true labels (None: the quality section says how to add one)."""
    from matplotlib import rc_context

    with rc_context(PLAIN_TEXT):
        return _render(current, previous, summary, metrics_note, truth)




def _render(current: ScoredOutput, previous: ScoredOutput | None, run: RunSummary | None, metrics_note: str,
            truth: str | None) -> str:
    summary = stats.summarize(current)
    assessed = quality.assess(current, truth, run) if truth is not None else None
    body = [
        _summary_section(current, summary, previous),
        quality_html.quality_section(assessed, run),
        quality_html.prevalence_section(quality.prevalence(current, assessed)),
        quality_html.audit_section(run),
        _label_section(summary),
        _probability_section(current, _calibration_applied(run)),
        _mass_section(current),
        _errors_section(current),
        _throughput_section(current, run, metrics_note),
        _drift_section(current, previous),
    ]
    return _document(current.path, [(s, s.replace("-", " ")) for s in SECTION_IDS], body)


# --- sections ---------------------------------------------------------------------------------

def _summary_section(current: ScoredOutput, summary: stats.Summary, previous: ScoredOutput | None) -> str:
    rows = [("rows", f"{summary.rows:,}"), ("ok", f"{summary.ok:,}"),
            ("errors", f"{summary.errors:,} ({_pct(summary.error_rate)})"),
            ("labels", ", ".join(summary.labels)), ("id column", current.id_column),
            ("keep columns", ", ".join(current.kept) or "–")]
    if previous is not None:
        rows.append(("previous output", str(previous.path)))
    rows += [("note", note) for note in current.notes]
    return _section("summary", "Summary", _table(["", ""], rows, header=False))


def _label_section(summary: stats.Summary) -> str:
    labels = list(summary.label_counts)
    counts = [summary.label_counts[label] for label in labels]
    rows = [(label, f"{count:,}", _pct(count / summary.ok if summary.ok else 0.0))
            for label, count in zip(labels, counts)]
    rows.append(("(error)", f"{summary.errors:,}", _pct(summary.error_rate)))
    fig, (ax,) = _figure(6, 2.8)
    ax.bar(labels + ["(error)"], counts + [summary.errors],
           color=[COLORS[i % len(COLORS)] for i in range(len(labels))] + ["#bbbbbb"])
    ax.set_ylabel("rows")
    ax.set_title("predicted label (most probable), ok rows; error rows in grey", fontsize=9)
    return _section("label-distribution", "Label distribution",
                    _table(["label", "rows", "share of ok rows"], rows), _img(fig, "label distribution"))


def _calibration_applied(run: RunSummary | None) -> bool:
    """False when the run wrote p_cal_<label> columns but kept the labels raw: the calibration made
    its evaluation rows worse (scores/quality.worse_warning)."""
    return ((run.quality.calibration if run else None) or {}).get("applied", True) is not False


def _probability_section(current: ScoredOutput, applied: bool = True) -> str:
    # the answers follow the calibrated probabilities where the run calibrated: show those
    follows = bool(current.calibrated) and applied
    shown = current.calibrated if follows else current.probs
    name = "P_cal" if follows else "P"
    dists = {label: stats.distribution(shown[label]) for label in current.labels}
    rows = [(f"{name}({label})", _num(d.mean), _num(d.quantiles.get("p10")), _num(d.quantiles.get("p50")),
             _num(d.quantiles.get("p90"))) for label, d in dists.items()]
    cols = min(len(dists), 3)
    nrows = math.ceil(len(dists) / cols)
    fig, axes = _figure(3.6 * cols, 2.6 * nrows, nrows, cols)
    centers = (stats.HIST_EDGES[:-1] + stats.HIST_EDGES[1:]) / 2
    for k, ax in enumerate(axes):
        if k >= len(dists):
            ax.set_visible(False)
            continue
        label = current.labels[k]
        ax.bar(centers, dists[label].counts, width=0.05, color=COLORS[k % len(COLORS)], edgecolor="white")
        ax.set_xlim(0, 1)
        ax.set_title(f"{name}({label})", fontsize=9)
        ax.set_xlabel("calibrated probability (p_cal_<label>, which label follows)" if follows
                      else "probability (normalized over the labels)", fontsize=8)
        ax.set_ylabel("rows", fontsize=8)
    note = ("The output is calibrated: these are the p_cal_<label> columns, which label follows; the raw "
            "p_<label> columns are in the quality section's tables." if follows else
            "The calibration made its evaluation rows worse in log-loss, so label follows these raw "
            "probabilities; the p_cal_<label> columns are written for inspection only." if current.calibrated
            else None)
    return _section("probabilities", f"{name}(label) per label",
                    _table(["column", "mean", "10th pct", "median", "90th pct"], rows, note=note),
                    _img(fig, f"{name}(label) histograms"))


def _mass_section(current: ScoredOutput) -> str:
    dist = stats.distribution(current.label_mass)
    shares = stats.mass_shares(current.label_mass)
    rows = [(f"label_mass < {t:g}", _pct(share)) for t, share in shares.items()]
    fig, (ax,) = _figure(6, 2.8)
    centers = (stats.HIST_EDGES[:-1] + stats.HIST_EDGES[1:]) / 2
    ax.bar(centers, dist.counts, width=0.05, color="#6a3d9a", edgecolor="white")
    ax.axvline(0.5, color="black", linestyle="dashed", linewidth=1)
    ax.set_xlim(0, 1)
    ax.set_xlabel("label_mass: probability of all labels together, before normalizing", fontsize=8)
    ax.set_ylabel("rows", fontsize=8)
    text = ("label_mass is the probability the model gives the labels together; a low value means "
            "the model wanted to say something else (another word, a longer answer), so P(label) "
            "rests on a small share of its belief.")
    return _section("label-mass", "label_mass: how often the model wanted to say something else",
                    f'<p class="note">{_e(text)}</p>',
                    _table(["scored rows with", "share"], rows,
                           note=f"median {_num(dist.quantiles.get('p50'))}, mean {_num(dist.mean)} "
                                f"over {dist.n:,} scored rows"),
                    _img(fig, "label_mass histogram"))


def _errors_section(current: ScoredOutput) -> str:
    kinds = stats.error_kinds(current)
    if not kinds:
        return _section("errors", "Errors by kind", "<p>No error rows.</p>")
    rows = []
    for kind in kinds:
        examples = "<br>".join(f"<span class=\"mono\">{_e(str(row_id))}</span>: {_e(message)}"
                               for row_id, message in kind.examples)
        rows.append((_e(kind.kind), f"{kind.count:,}", examples))
    note = ("Messages are grouped by kind: the file, line and numbers are taken out (quoted field "
            "names are kept); up to three example rows each.")
    return _section("errors", "Errors by kind", f'<p class="note">{_e(note)}</p>',
                    _table(["kind", "rows", "examples"], rows, escaped=True))


def _throughput_section(current: ScoredOutput, run: RunSummary | None, metrics_note: str) -> str:
    if run is None:
        return _section("throughput", "Throughput",
                        f"<p>No run metrics: {_e(metrics_note)}. Write them with "
                        "<code>batchscore run JOB --metrics FILE</code> and pass "
                        "<code>--metrics FILE</code> to the report.</p>")
    t = stats.throughput(run, current)
    rows = [("engine / model", f"{t.engine} / {t.model}"), ("workers", f"{t.workers}"),
            ("wall time", f"{t.seconds:.1f} s (planning {t.plan_seconds:.2f} s, scoring {t.score_seconds:.1f} s)"),
            ("rows / s (wall)", f"{t.rows_per_second:,.2f}"),
            ("logical tokens / s (wall)", f"{t.logical_tokens_per_second:,.0f}"),
            ("processed tokens / s (scoring)", f"{t.processed_tokens_per_score_second:,.0f}"),
            ("tokens", f"{t.logical_tokens:,} logical, {t.processed_tokens:,} processed "
                       f"(saving {_pct(t.saving_ratio)})")]
    if run.cost.machine_seconds:
        rows.append(("machine-seconds", ", ".join(f"{stage.replace('_', ' ')} {value:,.1f}"
                                                  for stage, value in run.cost.machine_seconds.items())))
    if run.cost.total is not None:
        per_million = "" if run.cost.per_million_rows is None else f", {run.cost.per_million_rows:,.4g} per million rows"
        rows.append(("cost", f"{run.cost.total:,.4g} at {run.cost.price_per_hour:g} an hour{per_million}; "
                             f"prefix sharing saved {run.cost.sharing_saved:,.4g}"))
    if run.carry.carried is not None:  # an incremental night: what the rows carried from the previous one saved
        saved = ("" if run.cost.carrying_saved is None else
                 f"; scoring them tonight would have cost {run.cost.carrying_saved:,.4g} (at tonight's token speed)")
        rows.append(("carried rows", f"{run.carry.carried:,} rows carried, {run.carry.scored:,} scored, "
                                     f"{run.carry.dropped:,} dropped{saved}"))
    parts = [f'<p class="note">From {_e(metrics_note)}.</p>']
    parts += [f'<p class="warn">{_e(w)}</p>' for w in t.warnings]
    parts.append(_table(["", ""], rows, header=False))
    fig, (ax_time, ax) = _figure(10, 2.8, 1, 2)
    other = max(t.seconds - t.plan_seconds - t.score_seconds, 0.0)
    left = 0.0
    for name, value, color in (("planning", t.plan_seconds, "#ff7f0e"), ("scoring", t.score_seconds, CURRENT_COLOR),
                               ("reading, tokenizing, loading, writing", other, "#bbbbbb")):
        ax_time.barh([0], [value], left=left, color=color, label=f"{name} {value:.1f} s")
        left += value
    ax_time.set_yticks([])
    ax_time.set_xlabel("seconds of the run", fontsize=8)
    ax_time.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=1)
    ax_time.set_title("where the wall time went", fontsize=9)
    if t.batch_token_counts:
        counts = np.asarray(t.batch_token_counts)
        ax.plot(np.arange(len(counts)), counts, marker=".", lw=1, color=CURRENT_COLOR)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("forward batch, in run order", fontsize=8)
        ax.set_ylabel("tokens", fontsize=8)
        ax.set_title(f"tokens per forward batch ({len(counts)} batches)", fontsize=9)
        parts.append('<p class="note">The metrics hold totals and the tokens of each forward batch, '
                     "not a time stamp per batch: the right chart follows the run batch by batch.</p>")
    else:
        ax.set_visible(False)
        parts.append('<p class="note">No per-batch token counts in the metrics (the torch engine '
                     "records them on local runs).</p>")
    parts.append(_img(fig, "wall time split and tokens per forward batch"))
    return _section("throughput", "Throughput over the run", *parts)


def _drift_section(current: ScoredOutput, previous: ScoredOutput | None) -> str:
    if previous is None:
        return _section("drift", "Drift against a previous output",
                        "<p>No previous output: pass <code>--previous OUTPUT</code> to compare.</p>")
    d = drift_mod.compare(previous, current)
    parts = [f'<p class="note">Rows joined by <code>{_e(current.id_column)}</code>: {d.joined:,} in both, '
             f"{d.only_current:,} only in the current output, {d.only_previous:,} only in the previous one; "
             f"{d.compared:,} joined rows are ok in both ({d.became_error:,} became errors, "
             f"{d.became_ok:,} recovered).</p>"]
    if d.only_current_labels or d.only_previous_labels:
        parts.append(f'<p class="warn">The label sets differ: only current {d.only_current_labels}, '
                     f"only previous {d.only_previous_labels}.</p>")
    parts.append(_table(["", ""], [
        ("label flip rate", f"{_pct(d.flip_rate)} ({d.flips:,} of {d.compared:,} rows)" if d.compared else "–"),
    ], header=False))
    if d.flip_counts:
        pairs = sorted(d.flip_counts.items(), key=lambda kv: (-kv[1], kv[0]))
        parts.append(_table(["previous label", "current label", "rows"],
                            [(a, b, f"{n:,}") for (a, b), n in pairs]))
    parts.append(f"<h3>Population stability index per label</h3>\n<p class=\"note\">{_e(drift_mod.PSI_FORMULA)}</p>")
    parts.append(_table(["label", "PSI", "reading"],
                        [(label, _num(value, 4), drift_mod.describe_psi(value)) for label, value in d.psi.items()]))
    if d.labels:
        parts.append(_img(_drift_figure(d), "P(label) bin shares, previous vs current"))
        parts.append(quality_html.drift_tests_html(previous, current, d.labels))
    if d.top_changed:
        keep = list(current.kept)
        rows = [(str(c.id), *[_short(c.kept.get(k)) for k in keep], c.previous_label, c.current_label,
                 f"{c.previous_p:.4f}", f"{c.current_p:.4f}", f"{c.delta:+.4f}") for c in d.top_changed]
        first = d.first_label
        parts.append(f"<h3>Rows that changed most (|ΔP({_e(first)})|)</h3>")
        parts.append(_table([current.id_column, *keep, "previous label", "current label",
                             f"previous P({first})", f"current P({first})", "ΔP"], rows))
    return _section("drift", "Drift against the previous output", *parts)


def _drift_figure(d: drift_mod.Drift):
    n = len(d.labels) + 1
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig, axes = _figure(3.6 * cols, 2.7 * nrows, nrows, cols)
    x = np.arange(10)
    for ax, label in zip(axes, d.labels):
        ax.bar(x - 0.2, d.previous_shares[label], 0.4, color=PREVIOUS_COLOR, label="previous")
        ax.bar(x + 0.2, d.current_shares[label], 0.4, color=CURRENT_COLOR, label="current")
        ax.set_xticks(x)
        ax.set_xticklabels([f".{i}" for i in range(10)], fontsize=7)
        ax.set_title(f"P({label}) share per bin, PSI {_num(d.psi[label], 3)}", fontsize=9)
        ax.legend(fontsize=7)
    scatter = axes[len(d.labels)]
    prev_p, cur_p = d.pairs
    scatter.scatter(prev_p, cur_p, s=6, alpha=0.6, color=CURRENT_COLOR)
    scatter.plot([0, 1], [0, 1], color="black", lw=0.8, linestyle="dashed")
    scatter.set_xlim(0, 1)
    scatter.set_ylim(0, 1)
    scatter.set_xlabel(f"previous P({d.first_label})", fontsize=8)
    scatter.set_ylabel(f"current P({d.first_label})", fontsize=8)
    scatter.set_title("joined rows", fontsize=9)
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig


def write_html(text: str, path: Path) -> Path:
    """Write the document atomically (io/atomic.py)."""
    from batchscore.io.atomic import atomic_write

    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
