"""The report's quality sections as HTML: class prevalence, quality against a truth column, the
exactness audit, and the drift tests. Numbers come from `quality` and `significance`; tables,
figures and escaping from `page`; html.py draws them under its plain-text settings.
"""

from __future__ import annotations

import numpy as np

import batchscore.report.page as page
from batchscore.output.summary import RunSummary
from batchscore.report import quality as q
from batchscore.report import significance as sig
from batchscore.report.data import ScoredOutput

RAW_COLOR, CALIBRATED_COLOR = "#9e9e9e", "#1f77b4"


def interval(value: sig.Interval | None, percent: bool = True) -> str:
    """'61.2% (52.0–69.8%)' or '0.612 (0.520–0.698)'; '–' for None."""
    if value is None:
        return "–"
    fmt = (lambda x: page.pct(x)) if percent else (lambda x: page.num(x))
    return f"{fmt(value.value)} ({fmt(value.low)}–{fmt(value.high)})"


def prevalence_section(prevalence: q.Prevalence) -> str:
    headers = ["label", f"predicted share of {prevalence.predicted_rows:,} ok rows (95% Wilson)"]
    if prevalence.truth is not None:
        headers.append(f"true share of {prevalence.truth_rows:,} labeled rows (95% Wilson)")
    rows = []
    for i, label in enumerate(prevalence.labels):
        row = [label, interval(prevalence.predicted[i])]
        if prevalence.truth is not None:
            row.append(interval(prevalence.truth[i]))
        rows.append(row)
    note = ("The share of rows given each label, with its 95% Wilson score interval: how sure the count "
            "is, given the number of rows (not whether the labels are right).")
    return page.section("prevalence", "Class prevalence", f'<p class="note">{page.escape(note)}</p>',
                         page.table(headers, rows))


def quality_section(quality: q.Quality | None, summary: RunSummary | None) -> str:
    if quality is None:
        return page.section(
            "quality", "Quality against the true labels",
            "<p>No truth column: set <code>calibrate.truth_column</code> in the job (it is copied into the "
            "output), or pass <code>--truth COLUMN</code> to <code>batchscore report</code>.</p>")
    parts = [f'<p class="note">Against <code>{page.escape(quality.truth_column)}</code>: {quality.rows:,} ok rows '
             f"whose true label is one of the labels; {quality.unlabeled:,} ok rows without one are left out.</p>"]
    if quality.not_a_label:
        shown = ", ".join(f"{value!r} ({count:,})" for value, count in sorted(quality.not_a_label.items())[:10])
        parts.append(f'<p class="warn">Left out, a true value that is not a label: {page.escape(shown)}.</p>')
    if not quality.rows:
        return page.section("quality", "Quality against the true labels", *parts)
    parts.append(page.table(["the label column", "value (95% bootstrap interval)"],
                             [("accuracy", interval(quality.accuracy)),
                              ("macro-F1", interval(quality.macro_f1, percent=False))],
                             note=f"{sig.BOOTSTRAP_SAMPLES:,} bootstrap resamples of the labeled rows (seed "
                                  f"{sig.BOOTSTRAP_SEED}); the interval is their 2.5th to 97.5th percentile."))
    calibrated = quality.calibrated
    parts.append(page.table(
        ["", "p_<label> (raw)", "p_cal_<label> (calibrated)" if calibrated else "p_cal_<label> (not calibrated)"],
        [(name, page.num(quality.raw[key], 4), page.num(calibrated[key], 4) if calibrated else "–")
         for name, key in (("ECE (15 bins, top label)", "ece"), ("Brier (summed over the labels)", "brier"))]))
    held_out = _held_out(summary)
    if held_out:
        parts.append(f'<p class="note">{page.escape(held_out)}</p>')
    parts.append(page.img(_quality_figure(quality), "reliability diagram and coverage against error"))
    if quality.coverage is not None:
        parts.append(f'<p class="note">{page.escape(_coverage_note(quality.coverage))}</p>')
    parts.append("<h3>Confusion matrix</h3>")
    cells = [(label, *[f"{n:,}" for n in quality.confusion[i]]) for i, label in enumerate(quality.labels)]
    parts.append(page.table(["true \\ predicted", *quality.labels], cells))
    return page.section("quality", "Quality against the true labels", *parts)


def _held_out(summary: RunSummary | None) -> str | None:
    """The run's own measures on its evaluation rows (not used to fit), from the summary."""
    calibration = (summary.quality.calibration if summary else None) or {}
    before, after = calibration.get("before"), calibration.get("after")
    if not before:
        return None
    text = (f"The run measured on its {before.get('rows', 0):,} evaluation rows (the labeled rows it did not fit "
            f"on): ECE {page.num(before.get('ece'), 4)}, Brier {page.num(before.get('brier'), 4)}")
    if after:
        text += (f" before calibration ({calibration.get('method')}), ECE {page.num(after.get('ece'), 4)}, "
                 f"Brier {page.num(after.get('brier'), 4)} after")
    if calibration.get("applied") is False:
        text += (f" — worse in log-loss ({page.num(before.get('nll'), 4)} → {page.num((after or {}).get('nll'), 4)}), "
                 "so the calibration was not applied: label follows the raw p_<label>")
    fit = calibration.get("fit_rows") or 0
    split = (f" The {fit:,} fit rows are a seeded draw of the {calibration.get('labeled_rows', 0):,} labeled rows "
             f"(calibrate.seed {calibration.get('seed')}, holdout_fraction {calibration.get('holdout_fraction')}); "
             "every other labeled row evaluates." if fit else
             f" Nothing was fitted on these rows ({calibration.get('source') or 'no calibration'}): every labeled "
             "row evaluates.")
    return text + "." + split + (f" The tables above cover every labeled row, the {fit:,} fit rows included (so "
                                 "they flatter the calibration)." if fit else "")


def _coverage_note(curve: q.Coverage) -> str:
    text = f"Rows ordered by {curve.source}, most confident first."
    if curve.threshold is not None:
        text += (f" output.review's threshold {curve.threshold:.4g} accepts {page.pct(curve.threshold_coverage)} of "
                 f"the labeled rows with {page.pct(curve.threshold_error)} wrong among them")
        text += f" (budget {page.pct(curve.max_error)})." if curve.max_error is not None else "."
    elif curve.max_error is not None:
        text += (f" output.review found no threshold whose accepted rows stay within the {page.pct(curve.max_error)} "
                 "error budget: every row needs review"
                 + (f" ({curve.reason})." if curve.reason else "."))
    return text


def _quality_figure(quality: q.Quality):
    fig, (ax_rel, ax_cov, ax_cm) = page.figure(12, 3.6, 1, 3)
    ax_rel.plot([0, 1], [0, 1], color="black", lw=0.8, linestyle="dashed")
    for rel, color in zip(quality.reliability, (RAW_COLOR, CALIBRATED_COLOR)):
        used = rel.counts > 0
        ax_rel.plot(rel.confidence[used], rel.accuracy[used], marker="o", color=color, label=rel.name)
    ax_rel.set_xlim(0, 1)
    ax_rel.set_ylim(0, 1)
    ax_rel.set_xlabel("mean top probability in the bin", fontsize=8)
    ax_rel.set_ylabel("accuracy in the bin", fontsize=8)
    ax_rel.set_title("reliability (on the diagonal: calibrated)", fontsize=9)
    ax_rel.legend(fontsize=7, loc="lower right")
    curve = quality.coverage
    ax_cov.plot(curve.coverage, curve.error, color=CALIBRATED_COLOR, lw=1.2)
    if curve.threshold is not None:
        ax_cov.axvline(curve.threshold_coverage, color="#d62728", linestyle="dashed", lw=1,
                       label=f"review threshold {curve.threshold:.3g}")
    if curve.max_error is not None:
        ax_cov.axhline(curve.max_error, color="#ff7f0e", linestyle="dotted", lw=1, label="error budget")
    if curve.threshold is not None or curve.max_error is not None:
        ax_cov.legend(fontsize=7)
    ax_cov.set_xlim(0, 1)
    ax_cov.set_ylim(bottom=0)
    ax_cov.set_xlabel("coverage: share of labeled rows accepted", fontsize=8)
    ax_cov.set_ylabel("error among the accepted", fontsize=8)
    ax_cov.set_title("coverage against error", fontsize=9)
    share = quality.confusion / np.maximum(quality.confusion.sum(axis=1, keepdims=True), 1)
    ax_cm.imshow(share, cmap="Blues", vmin=0, vmax=1)
    k = len(quality.labels)
    ticks = np.arange(k)
    ax_cm.set_xticks(ticks)
    ax_cm.set_yticks(ticks)
    ax_cm.set_xticklabels([page.short(label, 12) for label in quality.labels], fontsize=7, rotation=45 if k > 4 else 0)
    ax_cm.set_yticklabels([page.short(label, 12) for label in quality.labels], fontsize=7)
    if k <= 10:
        for i in range(k):
            for j in range(k):
                ax_cm.text(j, i, f"{quality.confusion[i, j]:,}", ha="center", va="center", fontsize=7,
                           color="white" if share[i, j] > 0.6 else "black")
    ax_cm.set_xlabel("predicted", fontsize=8)
    ax_cm.set_ylabel("true", fontsize=8)
    ax_cm.set_title("confusion (shade: share of the true row)", fontsize=9)
    return fig


def audit_section(summary: RunSummary | None) -> str:
    if summary is None:
        return page.section("audit", "Exactness audit", "<p>No run metrics, so no audit result.</p>")
    audit = summary.audit
    max_dp, bound = audit.max_dp, audit.bound
    if max_dp is None:
        reason = audit.skipped or "the run's summary has no audit (a run from before the audit)"
        return page.section("audit", "Exactness audit", f"<p>No audit: {page.escape(str(reason))}.</p>")
    verdict = ("recorded only (no bound: approximate scores)" if bound is None
               else "within the bound" if max_dp <= bound else "ABOVE the bound: the run exited 7")
    rows = [("rows re-scored", f"{audit.rows:,}"),
            ("max |ΔP| against a plain float32 forward", f"{max_dp:.3g}"),
            *([("max / mean |ΔP| of the plain forward in the run's dtype, same rows",
                f"{audit.plain_max_dp:.3g} / {audit.plain_mean_dp:.3g} (the engine's mean {audit.mean_dp:.3g})")]
              if audit.plain_max_dp is not None else []),
            ("bound (output.audit_max_dp)", "–" if bound is None else f"{bound:g}"),
            ("verdict", verdict),
            ("time", f"{audit.seconds:.1f} s of the run's {summary.seconds:.1f} s")]
    parts = [f'<p class="note">{page.escape(AUDIT_NOTE)}</p>', page.table(["", ""], rows, header=False)]
    if audit.differing:
        parts.append('<p class="warn">Rows above the bound:</p>')
        parts.append(page.table(["row", ], [(d,) for d in audit.differing]))
    return page.section("audit", "Exactness audit", *parts)


AUDIT_NOTE = ("After writing the output, the run re-scored a seeded random sample of its scored rows with a "
              "plain transformers forward in float32 (no prefix sharing, no batching; float64 log-softmax) "
              "and compared the normalized label probabilities.")


def drift_tests_html(previous: ScoredOutput, current: ScoredOutput, labels: list[str]) -> str:
    """The drift tests as a table: chi-square on the predicted-label counts, KS on each P(label)."""
    def counts(output: ScoredOutput) -> list[int]:
        return [sum(1 for lab, ok in zip(output.label, output.ok) if ok and lab == label) for label in labels]

    tests = [sig.label_counts_test(labels, counts(previous), counts(current))]
    tested = labels[:1] if len(labels) == 2 else labels  # two labels: P(second) = 1 − P(first), the same test
    tests += [sig.distribution_test(f"P({label})", previous.probs[label][previous.ok], current.probs[label][current.ok])
              for label in tested]
    rows = [(t.name, f"{t.statistic:.4f}", f"{t.p_value:.3g}", t.detail,
             f"differs (p < {sig.ALPHA:g})" if t.differs else "no evidence of a change")
            for t in tests if t is not None]
    note = ("Every ok row of each output counts, joined or not (the populations are compared). A small "
            "p-value says the change is unlikely to be chance; with many rows even a small change is "
            "significant, so read it with the shares and PSI above.")
    if not rows:
        return "<h3>Tests</h3>\n<p>Not enough rows or labels for a test.</p>"
    return (f"<h3>Tests</h3>\n<p class=\"note\">{page.escape(note)}</p>\n"
            + page.table(["test", "statistic", "p-value", "over", "reading"], rows))
