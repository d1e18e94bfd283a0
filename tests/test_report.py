"""`batchscore report` and `run --report / --metrics-prom` on a real run; drift numbers by hand."""

import base64
import json
import math
from html.parser import HTMLParser

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import EXIT_ERROR_RATE, EXIT_INPUT
from batchscore.scores.normalize import results_table
from batchscore.report import ReportError, load_output, write_report
from batchscore.report.drift import PSI_EPSILON, bin_shares, compare, psi
from batchscore.report.html import SECTION_IDS
from batchscore.report.stats import error_kind, error_kinds
from tests.conftest import write_job, write_sample_subset


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


class _Page(HTMLParser):
    """Section ids, every src/href, and the tags of an HTML page."""

    def __init__(self, text):
        super().__init__()
        self.sections, self.links, self.tags, self._in = {}, [], set(), None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        if tag == "section":
            self._in = attrs["id"]
            self.sections[self._in] = ""
        self.links += [attrs[a] for a in ("src", "href") if a in attrs]

    def handle_data(self, data):
        if self._in:
            self.sections[self._in] += data + " "  # cells apart


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """One real CLI run of a 12-row job (one row with a null query) with --report and --metrics-prom."""
    folder = tmp_path_factory.mktemp("report_run")
    source = write_sample_subset(folder / "input.parquet", queries=4, product_ids=("P001", "P002", "P004"))
    rows = pq.read_table(source).to_pylist()
    rows[5]["query"] = None
    pq.write_table(pa.Table.from_pylist(rows), source)
    job = write_job(folder, source, output={"max_error_rate": 0.2})
    prom = folder / "batchscore.prom"
    result = invoke("run", job, "-q", "--report", "--metrics-prom", prom, "--metrics", folder / "out.json")
    assert result.exit_code == 0, result.output
    return folder, result


def test_run_report_writes_a_self_contained_page_with_every_section(real_run):
    folder, result = real_run
    page_path = folder / "_out.parquet.report.html"
    assert f"report: {page_path}" in result.output
    page = _Page(page_path.read_text(encoding="utf-8"))
    assert set(SECTION_IDS) <= set(page.sections)
    assert not [link for link in page.links if link.startswith(("http://", "https://", "//"))]
    assert not page.tags & {"script", "link", "iframe"}
    images = [link for link in page.links if link.startswith("data:")]
    assert len(images) >= 4
    for image in images:
        assert image.startswith("data:image/png;base64,")
        assert base64.b64decode(image.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    summary = " ".join(page.sections["summary"].split())
    assert "rows 12" in summary and "ok 11" in summary and "errors 1 (8.3%)" in summary
    assert "Yes, No" in summary
    # the null query, as a kind without file or line, with its row as the example
    errors = page.sections["errors"]
    assert "field 'query' is null or missing" in errors and "P002-Q01" in errors
    out = pq.read_table(folder / "out.parquet").to_pandas()
    share = (out["label_mass"] < 0.5).sum() / out["label_mass"].notna().sum()
    assert f"label_mass < 0.5 {share:.1%}" in " ".join(page.sections["label-mass"].split())
    throughput = page.sections["throughput"]
    assert "No run metrics" not in throughput and "torch / smollm2-135m-instruct" in throughput
    assert "No previous output" in page.sections["drift"]


def test_metrics_prom_parses_and_holds_the_row_counts(real_run):
    from prometheus_client.parser import text_string_to_metric_families

    folder, _ = real_run
    text = (folder / "batchscore.prom").read_text()
    assert [p.name for p in folder.iterdir() if "prom" in p.name] == ["batchscore.prom"]  # no temporary file left
    families = {f.name: f for f in text_string_to_metric_families(text)}
    values = {name: [(s.labels, s.value) for s in f.samples] for name, f in families.items()}
    assert values["batchscore_rows"] == [({"job": "job"}, 12.0)]
    assert values["batchscore_rows_ok"] == [({"job": "job"}, 11.0)]
    assert values["batchscore_rows_error"] == [({"job": "job"}, 1.0)]
    assert values["batchscore_run_complete"] == [({"job": "job"}, 1.0)]
    assert families["batchscore_rows"].type == "gauge"
    assert families["batchscore_rows"].documentation
    summary = json.loads((folder / "out.json").read_text())
    assert values["batchscore_processed_tokens"][0][1] == summary["processed_tokens"]
    assert values["batchscore_run_info"][0][0]["engine"] == "torch"


def test_report_command_compares_with_a_previous_output(real_run, tmp_path):
    folder, _ = real_run
    table = pq.read_table(folder / "out.parquet")
    previous = table.to_pydict()
    previous["p_Yes"] = [None if p is None else 1 - p for p in previous["p_Yes"]]
    previous["p_No"] = [None if p is None else 1 - p for p in previous["p_No"]]
    previous["label"] = [None if lab is None else {"Yes": "No", "No": "Yes"}[lab] for lab in previous["label"]]
    pq.write_table(pa.table(previous, schema=table.schema), tmp_path / "prev.parquet")
    target = tmp_path / "page.html"
    result = invoke("report", folder / "out.parquet", "--previous", tmp_path / "prev.parquet", "-o", target)
    assert result.exit_code == 0, result.output
    drift = " ".join(_Page(target.read_text()).sections["drift"].split())
    assert "label flip rate 100.0% (11 of 11 rows)" in drift
    assert "PSI" in drift and "cᵢ" in drift  # the formula is stated


def test_report_command_refuses_what_is_not_an_output(tmp_path):
    result = invoke("report", tmp_path / "missing.parquet")
    assert result.exit_code == EXIT_INPUT and "output not found" in result.output
    pq.write_table(pa.table({"a": [1]}), tmp_path / "other.parquet")
    result = invoke("report", tmp_path / "other.parquet")
    assert result.exit_code == EXIT_INPUT and "not a batchscore output" in result.output


def test_error_rate_exceeded_still_writes_report_and_metrics(tmp_path, small_input):
    rows = pq.read_table(small_input).to_pylist()[:3]
    rows[0]["title"] = None
    pq.write_table(pa.Table.from_pylist(rows), small_input)
    job = write_job(tmp_path, small_input)
    result = invoke("run", job, "-q", "--report", "--metrics-prom", tmp_path / "m.prom")
    assert result.exit_code == EXIT_ERROR_RATE, result.output
    page = _Page((tmp_path / "_out.parquet.report.html").read_text())
    assert "field 'title' is null or missing" in page.sections["errors"]
    prom = (tmp_path / "m.prom").read_text()
    assert 'batchscore_rows_error{job="job"} 1.0' in prom
    assert 'batchscore_run_success{job="job"} 0.0' in prom and 'batchscore_exit_code{job="job"} 4.0' in prom


def test_metrics_prom_is_written_when_the_run_fails_early(tmp_path, small_input):
    job = write_job(tmp_path, small_input, labels=["Yes", "Yes"])  # refused before any work
    result = invoke("run", job, "-q", "--metrics-prom", tmp_path / "m.prom")
    assert result.exit_code == 2, result.output
    prom = (tmp_path / "m.prom").read_text()
    assert 'batchscore_run_success{job="job"} 0.0' in prom and 'batchscore_exit_code{job="job"} 2.0' in prom
    assert "batchscore_last_run_timestamp_seconds" in prom and "batchscore_rows{" not in prom


# --- drift against a hand computation ---------------------------------------------------------

def _output(path, ids, p_yes, errors=()):
    """An output file in the writer's own layout; rows in `errors` get status error."""
    totals = np.log([[np.nan, np.nan] if p is None else [0.6 * p, 0.6 * (1 - p)] for p in p_yes])  # label mass 0.6
    table = results_table(pa.array(ids), "pair_id", pa.table({"query": [f"q-{i}" for i in ids]}),
                          ["Yes", "No"], totals, {i: "boom" for i in errors})
    pq.write_table(table, path)
    return path


def test_the_runs_diagnostic_columns_are_not_listed_as_kept_columns(tmp_path):
    """logp_<label>, output.top_token's columns and approx_keep are the run's, not the input's."""
    path = _output(tmp_path / "out.parquet", ["a", "b"], [0.3, 0.8])
    table = pq.read_table(path)
    for name, values in (("logp_Yes", [-1.0, -0.2]), ("logp_No", [-0.4, -1.6]), ("argmax_is_label", [True, False]),
                         ("top_token", ["Yes", "The"]), ("top_p", [0.5, 0.4]), ("approx_keep", [0.5, 0.5])):
        table = table.append_column(name, pa.array(values))
    pq.write_table(table, path)
    assert set(load_output(path).kept) == {"query"}
    write_report(path)
    html = (tmp_path / "_out.parquet.report.html").read_text()
    kept_row = html.split("keep columns", 1)[1].split("</tr>", 1)[0]
    assert "query" in kept_row and not any(n in kept_row for n in ("logp_", "top_token", "top_p", "approx_keep"))


@pytest.fixture
def two_nights(tmp_path):
    # previous: a..e, g (e an error); current: b..g and f (a gone, f new, g now an error)
    previous = _output(tmp_path / "prev.parquet", ["a", "b", "c", "d", "e", "g"],
                       [0.05, 0.15, 0.55, 0.95, None, 0.75], errors=[4])
    current = _output(tmp_path / "cur.parquet", ["b", "c", "d", "e", "f", "g"],
                      [0.12, 0.45, 0.92, 0.65, 0.08, None], errors=[5])
    return previous, current


def test_drift_numbers_equal_a_hand_computation(two_nights):
    previous, current = two_nights
    d = compare(load_output(previous), load_output(current))
    # joined: b c d e g; compared (ok in both): b c d; c flips Yes -> No
    assert (d.joined, d.only_current, d.only_previous, d.compared) == (5, 1, 1, 3)
    assert (d.flips, d.became_error, d.became_ok) == (1, 1, 1)
    assert d.flip_rate == pytest.approx(1 / 3)
    assert d.flip_counts == {("No", "No"): 1, ("Yes", "No"): 1, ("Yes", "Yes"): 1}
    # P(Yes) bins: previous a0 b1 c5 d9 g7, current b1 c4 d9 e6 f0 -> 0.2 each; bins 4,5,6,7 differ
    expected = 4 * (0.2 - PSI_EPSILON) * math.log(0.2 / PSI_EPSILON)
    assert d.psi["Yes"] == pytest.approx(expected, rel=1e-12)
    assert d.psi["No"] == pytest.approx(expected, rel=1e-12)  # P(No) = 1 - P(Yes): mirrored bins
    assert [c.id for c in d.top_changed] == ["c", "b", "d"]
    assert d.top_changed[0].delta == pytest.approx(-0.10)
    assert d.top_changed[0].kept == {"query": "q-c"}


def test_psi_of_uneven_shares_and_bin_edges():
    # previous shares: bin0 .5, bin1 .25, bin5 .25; current: bin0 .25, bin1 .75
    value = psi([0.05, 0.05, 0.15, 0.55], [0.05, 0.15, 0.15, 0.15])
    hand = ((0.25 - 0.5) * math.log(0.25 / 0.5) + (0.75 - 0.25) * math.log(0.75 / 0.25)
            + (PSI_EPSILON - 0.25) * math.log(PSI_EPSILON / 0.25))
    assert value == pytest.approx(hand, rel=1e-12)
    assert psi([0.3, 0.6], [0.3, 0.6]) == 0.0
    assert psi([], [0.5]) is None
    # an edge starts its bin; 1.0 is in the last, closed one; NaN is ignored
    assert list(np.flatnonzero(bin_shares([0.1, 0.0999, 1.0, 0.9, float("nan")]))) == [0, 1, 9]
    assert bin_shares([0.1, 0.0999, 1.0, 0.9])[9] == 0.5


def test_report_page_shows_the_drift_numbers(two_nights, tmp_path):
    previous, current = two_nights
    path = write_report(current, previous=previous, html_path=tmp_path / "r.html")
    page = _Page(path.read_text())
    drift = " ".join(page.sections["drift"].split())
    assert "label flip rate 33.3% (1 of 3 rows)" in drift
    assert f"Yes {4 * (0.2 - PSI_EPSILON) * math.log(0.2 / PSI_EPSILON):.4f} large shift" in drift
    assert "No run metrics" in page.sections["throughput"]  # none next to it: said so


def test_error_messages_group_by_kind(tmp_path):
    assert error_kind("/data/a.jsonl:17: field 'query' is null or missing") == "field 'query' is null or missing"
    assert error_kind("prompt is 3000 tokens, longer than the maximum 2048 (the model's context)") == \
        "prompt is N tokens, longer than the maximum N (the model's context)"
    assert error_kind("cannot open /tmp/x/y.bin (gone)") == "cannot open <file> (gone)"
    table = results_table(pa.array(["w", "x", "y", "z"]), "id", pa.table({}), ["Yes", "No"], np.full((4, 2), np.nan),
                          {0: "a.jsonl:1: field 'q' is null or missing",
                           1: "b.jsonl:9: field 'q' is null or missing",
                           2: "a.jsonl:3: field 't' is null or missing",
                           3: "token id 70000 is outside the model's vocabulary (size 49152)"})
    pq.write_table(table, tmp_path / "e.parquet")
    kinds = error_kinds(load_output(tmp_path / "e.parquet"))
    assert [(k.kind, k.count) for k in kinds] == [
        ("field 'q' is null or missing", 2), ("field 't' is null or missing", 1),
        ("token id N is outside the model's vocabulary (size N)", 1)]
    assert [row for row, _ in kinds[0].examples] == ["w", "x"]


def test_without_matplotlib_the_error_names_the_extra(monkeypatch, tmp_path, job_factory, small_input):
    import sys

    from batchscore.errors import EXIT_ENGINE

    output = _output(tmp_path / "o.parquet", ["a"], [0.3])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = invoke("report", output)
    assert result.exit_code == EXIT_ENGINE and "pip install 'batchscore[report]'" in result.output
    result = invoke("run", job_factory(small_input), "-q", "--report")  # refused before scoring
    assert result.exit_code == EXIT_ENGINE and not (tmp_path / "out.parquet").exists()


# --- quality sections against a hand computation ----------------------------------------------

Z95 = 1.959963984540054


def _wilson_by_hand(k, n):
    p = k / n
    center = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 / (1 + Z95**2 / n) * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n))
    return center - half, center + half


# ok rows a..j, k an error; P(Yes) away from the 15 ECE bin edges; i has no truth, j a non-label
QUALITY_IDS = list("abcdefghijk")
QUALITY_P = [0.93, 0.83, 0.73, 0.63, 0.43, 0.33, 0.23, 0.13, 0.65, 0.35, None]
QUALITY_TRUTH = ["Yes", "Yes", "No", "Yes", "No", "Yes", "No", "No", None, "Maybe", "Yes"]


def _quality_output(path, calibrated=True):
    totals = np.log([[np.nan, np.nan] if p is None else [0.6 * p, 0.6 * (1 - p)] for p in QUALITY_P])
    table = results_table(pa.array(QUALITY_IDS), "pair_id", pa.table({"relevant": QUALITY_TRUTH}),
                          ["Yes", "No"], totals, {10: "boom"})
    if calibrated:  # halfway to 0.5: the same labels, less sure
        cal = [None if p is None else 0.5 + (p - 0.5) / 2 for p in QUALITY_P]
        at = table.column_names.index("status")
        table = table.add_column(at, "p_cal_Yes", pa.array(cal, type=pa.float64()))
        table = table.add_column(at + 1, "p_cal_No", pa.array([None if c is None else 1 - c for c in cal],
                                                               type=pa.float64()))
    pq.write_table(table, path)
    return path


def _ece_brier_by_hand(p_yes, truth):
    """Top-label ECE over 15 equal bins and the Brier score summed over both labels."""
    bins = {}
    brier = 0.0
    for p, t in zip(p_yes, truth):
        top, said = (p, "Yes") if p > 0.5 else (1 - p, "No")
        bins.setdefault(int(top * 15), []).append((top, said == t))
        p_true = p if t == "Yes" else 1 - p
        brier += 2 * (1 - p_true) ** 2
    n = len(p_yes)
    ece = sum(len(b) * abs(sum(c for _, c in b) / len(b) - sum(x for x, _ in b) / len(b)) for b in bins.values()) / n
    return ece, brier / n


LABELED = [0, 1, 2, 3, 4, 5, 6, 7]  # ok rows whose truth is Yes or No


def test_quality_numbers_equal_a_hand_computation(tmp_path):
    from batchscore.output.summary import RunSummary
    from batchscore.report.quality import assess, prevalence

    output = load_output(_quality_output(tmp_path / "q.parquet"))
    assert "p_cal_Yes" not in output.kept and set(output.calibrated) == {"Yes", "No"}
    summary = RunSummary.from_dict({"review": {"threshold": 0.65, "max_error": 0.05}})
    quality = assess(output, "relevant", summary)
    assert (quality.rows, quality.unlabeled, quality.not_a_label) == (8, 1, {"Maybe": 1})
    # truth Yes: a b d said Yes, f said No; truth No: c said Yes, e g h said No
    assert quality.confusion.tolist() == [[3, 1], [1, 3]]
    assert quality.accuracy.value == 6 / 8
    assert quality.macro_f1.value == pytest.approx((6 / 8 + 6 / 8) / 2)  # F1 = 2·3 / (2·3 + 1 + 1) for both
    assert quality.accuracy.low <= 0.75 <= quality.accuracy.high
    p_yes = [QUALITY_P[i] for i in LABELED]
    truth = [QUALITY_TRUTH[i] for i in LABELED]
    ece, brier = _ece_brier_by_hand(p_yes, truth)
    assert ece == pytest.approx(0.35) and quality.raw["ece"] == pytest.approx(ece)
    assert quality.raw["brier"] == pytest.approx(brier)
    cal_ece, cal_brier = _ece_brier_by_hand([0.5 + (p - 0.5) / 2 for p in p_yes], truth)
    assert quality.calibrated["ece"] == pytest.approx(cal_ece)
    assert quality.calibrated["brier"] == pytest.approx(cal_brier)
    # coverage by the top calibrated probability: a .715 h .685 b .665 g .635 c .615 f .585 d .565 e .535
    curve = quality.coverage
    assert curve.error.tolist() == pytest.approx([0, 0, 0, 0, 1 / 5, 2 / 6, 2 / 7, 2 / 8])
    assert curve.threshold_coverage == 3 / 8 and curve.threshold_error == 0.0  # a h b ≥ 0.65
    prev = prevalence(output, quality)
    assert prev.predicted_rows == 10  # a b c d i say Yes, e f g h j say No
    low, high = _wilson_by_hand(5, 10)
    assert (prev.predicted[0].value, prev.predicted[0].low, prev.predicted[0].high) == pytest.approx((0.5, low, high))
    low, high = _wilson_by_hand(4, 8)  # true Yes: a b d f
    assert (prev.truth[0].low, prev.truth[0].high) == pytest.approx((low, high))


def test_bootstrap_interval_matches_resampling_rows():
    from batchscore.report.significance import accuracy_of, bootstrap_confusion, macro_f1_of

    confusion = np.array([[30, 10], [5, 55]])
    ours = bootstrap_confusion(confusion, accuracy_of)
    assert ours == bootstrap_confusion(confusion, accuracy_of)  # seeded
    correct = np.repeat([True, False, False, True], confusion.ravel())
    rng = np.random.default_rng(1)
    direct = np.percentile(rng.choice(correct, (20000, len(correct))).mean(axis=1), [2.5, 97.5])
    assert ours.value == 0.85 and (ours.low, ours.high) == pytest.approx(tuple(direct), abs=0.011)
    perfect = bootstrap_confusion(np.array([[4, 0], [0, 6]]), macro_f1_of)
    assert (perfect.value, perfect.low, perfect.high) == (1.0, 1.0, 1.0)


def test_drift_tests_equal_a_hand_computation():
    from batchscore.report.significance import distribution_test, label_counts_test

    result = label_counts_test(["Yes", "No", "Maybe"], [30, 70, 0], [45, 55, 0])  # Maybe: in neither
    expected = np.outer([100, 100], [75, 125]) / 200
    chi2 = float((((np.array([[30, 70], [45, 55]]) - expected) ** 2) / expected).sum())
    assert result.statistic == pytest.approx(chi2) and "1 degree(s) of freedom over Yes, No" in result.detail
    assert result.p_value == pytest.approx(math.erfc(math.sqrt(chi2 / 2)))  # chi-square, 1 dof
    assert result.differs is (result.p_value < 0.01)
    ks = distribution_test("P(Yes)", np.array([0.1, 0.2, 0.3, np.nan]), np.array([0.25, 0.35, 0.45, 0.55]))
    assert ks.statistic == pytest.approx(0.75)  # at 0.3: 3/3 of previous, 1/4 of current
    assert label_counts_test(["Yes", "No"], [5, 0], [7, 0]) is None


def test_report_page_shows_quality_prevalence_audit_and_tests(tmp_path):
    current = _quality_output(tmp_path / "cur.parquet")
    previous = _output(tmp_path / "prev.parquet", QUALITY_IDS[:8], [0.9, 0.8, 0.2, 0.1, 0.3, 0.2, 0.4, 0.1])
    calibration = {"truth_column": "relevant", "method": "platt", "fit_rows": 4,
                   "before": {"rows": 4, "ece": 0.1, "brier": 0.2}, "after": {"rows": 4, "ece": 0.05, "brier": 0.15}}
    metrics = {"rows": 11, "seconds": 20.0, "calibration": calibration,
               "review": {"threshold": 0.65, "max_error": 0.05},
               "audit_rows": 10, "audit_max_dp": 3.2e-6, "audit_bound": 1e-4, "audit_seconds": 1.5}
    page = _Page(write_report(current, previous=previous, metrics=metrics, html_path=tmp_path / "r.html").read_text())
    assert set(SECTION_IDS) <= set(page.sections)
    quality = " ".join(page.sections["quality"].split())
    assert "8 ok rows whose true label is one of the labels; 1 ok rows without one" in quality
    assert "'Maybe' (1)" in quality
    assert "accuracy 75.0% (" in quality and "macro-F1 0.750 (" in quality
    ece, brier = _ece_brier_by_hand([QUALITY_P[i] for i in LABELED], [QUALITY_TRUTH[i] for i in LABELED])
    assert f"ECE (15 bins, top label) {ece:.4f} " in quality
    assert f"Brier (summed over the labels) {brier:.4f} " in quality
    assert "4 evaluation rows (the labeled rows it did not fit on): ECE 0.1000" in quality
    assert "the 4 fit rows included" in quality
    # threshold 0.65 accepts a (.715), h (.685), b (.665): 3 of 8, none wrong
    assert "threshold 0.65 accepts 37.5% of the labeled rows with 0.0% wrong among them (budget 5.0%)" in quality
    assert "Yes 3 1 No 1 3" in quality  # the confusion matrix, true rows
    low, high = _wilson_by_hand(5, 10)
    assert f"Yes 50.0% ({low:.1%}–{high:.1%})" in " ".join(page.sections["prevalence"].split())
    audit = " ".join(page.sections["audit"].split())
    assert "rows re-scored 10" in audit and "3.2e-06" in audit and "within the bound" in audit
    drift = " ".join(page.sections["drift"].split())
    assert "chi-square, predicted label counts" in drift and "Kolmogorov–Smirnov, P(Yes)" in drift


def test_report_truth_option_and_its_errors(tmp_path):
    output = _quality_output(tmp_path / "q.parquet", calibrated=False)
    target = tmp_path / "page.html"
    result = invoke("report", output, "--truth", "relevant", "-o", target)
    assert result.exit_code == 0, result.output
    quality = " ".join(_Page(target.read_text()).sections["quality"].split())
    assert "accuracy 75.0%" in quality and "p_cal_<label> (not calibrated)" in quality
    result = invoke("report", output, "--truth", "nope")
    assert result.exit_code == EXIT_INPUT and "--truth 'nope' is not a column" in result.output
    result = invoke("report", output)  # no summary naming a truth column: said how to add one
    assert "No truth column" in _Page((tmp_path / "_q.parquet.report.html").read_text()).sections["quality"]


def test_quality_section_of_labels_matplotlib_would_read_as_tex(tmp_path):
    labels = ["$x^$", "No"]
    totals = np.log([[0.5, 0.1], [0.1, 0.5], [0.3, 0.2]])
    table = results_table(pa.array(["a", "b", "c"]), "id", pa.table({"gold": ["$x^$", "No", "No"]}), labels, totals, {})
    pq.write_table(table, tmp_path / "o.parquet")
    result = invoke("report", tmp_path / "o.parquet", "--truth", "gold", "-o", tmp_path / "r.html")
    assert result.exit_code == 0, result.output
    quality = " ".join(_Page((tmp_path / "r.html").read_text()).sections["quality"].split())
    assert "accuracy 66.7%" in quality and "$x^$ 1 0 No 1 1" in quality  # c said $x^$, truly No


# ---------------------------------------------------------------------------- questions outputs

def questions_table() -> pa.Table:
    """A questions job's output: a choice, a yes/no and a score question; record d's team failed."""
    return pa.table({
        "id": ["a", "b", "c", "d"],
        "team.choice": ["billing", "billing", "shipping", None],
        "team.p.billing": [0.7, 0.6, 0.2, None], "team.p.shipping": [0.3, 0.4, 0.8, None],
        "team.confidence": [0.5, 0.3, 0.7, None], "team.label_mass": [0.9, 0.4, 0.8, None],
        "team.argmax_is_label": [True, False, True, None], "team.needs_review": [False, True, False, None],
        "team.status": ["ok", "ok", "ok", "error"], "team.error": [None, None, None, "not scored: boom"],
        "refund.p_yes": [0.9, 0.2, 0.6, 0.4], "refund.confidence": pa.array([None] * 4, pa.float64()),
        "refund.label_mass": [0.95] * 4, "refund.argmax_is_label": [True] * 4,
        "refund.status": ["ok"] * 4, "refund.error": pa.array([None] * 4, pa.string()),
        "mood.score": [0.2, 1.9, 1.1, 0.4], "mood.p.0": [0.8, 0.05, 0.1, 0.6], "mood.p.1": [0.2, 0.05, 0.7, 0.4],
        "mood.p.2": [0.0, 0.9, 0.2, 0.0], "mood.confidence": [0.6, 0.8, 0.5, 0.2],
        "mood.label_mass": [0.9, 0.9, 0.9, 0.3], "mood.argmax_is_label": [True, True, True, False],
        "mood.status": ["ok"] * 4, "mood.error": pa.array([None] * 4, pa.string()),
        "status": ["ok", "ok", "ok", "error"], "error": [None, None, None, "team: not scored: boom"]})


def test_a_questions_output_is_read_question_by_question():
    from batchscore.tasks.questions.report import read_questions

    team, refund, mood = read_questions(questions_table())
    assert (team.key, team.kind, team.answered, team.failed) == ("team", "choice", 3, 1)
    assert team.answers == {"billing": 2, "shipping": 1} and team.errors == {"not scored: boom": 1}
    assert (team.low_mass, team.top_not_answer, team.needs_review, team.out_of_scope) == (1, 1, 1, None)
    assert team.sureness.tolist() == [0.5, 0.3, 0.7]
    assert (refund.kind, refund.answers, refund.answered) == ("yes/no", {"yes": 2, "no": 2}, 4)
    assert refund.sureness.tolist() == [0.9, 0.2, 0.6, 0.4]  # P(yes): TypeSafe gives yes/no no confidence
    assert (mood.kind, mood.answers) == ("score", {"0": 2, "2": 1, "1": 1})  # the most probable level
    assert (mood.low_mass, mood.top_not_answer) == (1, 1)


def test_report_of_a_questions_output_has_a_section_per_question(tmp_path):
    path = tmp_path / "decisions.parquet"
    pq.write_table(questions_table(), path)
    metrics = {"calibration": {"questions": {"team": {"before": {"ece": 0.2, "brier": 0.3}, "after": {
        "ece": 0.05, "brier": 0.25}, "eval_rows": 3, "truth_column": "true_team", "source": "batch"}}}}
    html = write_report(path, metrics=metrics).read_text()
    for key in ("team", "refund", "mood"):
        assert f'id="q-{key}"' in html
    assert "0.2000 → 0.0500" in html and "(failed)" in html and "not scored: boom" in html
    with pytest.raises(ReportError, match="--previous"):
        write_report(path, previous=path)
    labels = tmp_path / "labels.parquet"  # a labels output with a kept `order.status` column keeps its report
    pq.write_table(pa.table({"id": ["a"], "order.status": ["shipped"], "p_yes": [0.6], "p_no": [0.4],
                             "label": ["yes"], "label_mass": [0.9], "status": ["ok"], "error": [None]}), labels)
    assert 'id="label-distribution"' in write_report(labels).read_text()
    result = CliRunner().invoke(main, ["report", str(path)])  # no run summary beside it: still a report
    assert result.exit_code == 0, result.output
    assert 'id="q-mood"' in (tmp_path / "_decisions.parquet.report.html").read_text()


def test_question_columns_are_told_from_kept_columns_and_edge_cases_read():
    """A kept `order.status` column makes no question; a predicate's answers follow its calibrated
    true/false columns; a record that failed as a whole is not the question's failure; no rows is fine."""
    from batchscore.tasks.questions.columns import question_keys
    from batchscore.tasks.questions.report import read_questions

    assert question_keys(["id", "order.status", "p_yes", "p_no", "label", "status"]) == []
    null = pa.array([None, None], pa.float64())
    table = pa.table({
        "id": ["a", "b"], "spam.p_yes": [0.7, None], "spam.p_cal.false": [0.9, None], "spam.p_cal.true": [0.1, None],
        "spam.confidence": null, "spam.label_mass": [0.8, None], "spam.argmax_is_label": [True, None],
        "spam.status": ["ok", None], "spam.error": pa.array([None, None], pa.string()),
        "status": ["ok", "error"], "error": [None, "line 2: not JSON"]})
    (spam,) = read_questions(table)
    assert spam.answers == {"false": 1}  # calibrated P(true) 0.1, though the raw P(yes) is 0.7
    assert spam.errors == {} and (spam.failed, spam.whole) == (0, 1)  # the record's error, counted once
    (empty,) = read_questions(table.slice(0, 0))
    assert (empty.answered, empty.answers, empty.low_mass) == (0, {}, 0)
