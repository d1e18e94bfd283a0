"""`output.column_names: slug`: a label's columns named by lowercase a-z0-9_ (`Home & Garden` ->
`p_home_garden`), which DuckDB reads unquoted; the model still reads the label's text, the `label`
column holds it, and the schema records each slug's label. Two labels of one slug, or a label
without one, are refused at load naming them."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from batchscore.errors import JobConfigError
from batchscore.jobfile import load_job, parse_set_options
from batchscore.output.column_names import COLUMN_LABELS_KEY, slug
from batchscore.run.runner import run_job

from tests.conftest import write_job, write_sample_subset

LABELS = ["Home & Garden", "Electronics", "Toys"]
PROMPT = {"chat": True, "system": "You sort products into shop departments.",
          "template": "Product: {title}\n{description}\n\nWhich department sells it? Home & Garden, Electronics or Toys?"}


@pytest.mark.parametrize("label, expected", [("Home & Garden", "home_garden"), ("  Café au lait ", "cafe_au_lait"),
                                             ("5-Stars!", "5_stars"), ("snake_case", "snake_case"), ("是", "")])
def test_a_slug_is_lowercase_letters_digits_and_underscores(label, expected):
    assert slug(label) == expected


def test_labels_of_one_slug_or_of_none_are_refused_at_load(tmp_path):
    job = write_job(tmp_path, tmp_path / "in.parquet", labels=["Home & Garden", "home garden"])
    load_job(job)  # as text they are two columns
    with pytest.raises(JobConfigError, match=r"the labels 'Home & Garden' and 'home garden' would both be written "
                                             r"as p_home_garden"):
        load_job(job, parse_set_options(["output.column_names=slug"]))
    job = write_job(tmp_path, tmp_path / "in.parquet", labels=["是", "否"])
    with pytest.raises(JobConfigError, match=r"the label '是' has no letter a-z or digit"):
        load_job(job, parse_set_options(["output.column_names=slug"]))
    with pytest.raises(JobConfigError, match=r"output.column_names: must be one of text, slug, got 'snake'"):
        load_job(job, parse_set_options(["output.column_names=snake"]))


def test_a_json_lines_output_is_written_by_the_slugs_too(tmp_path):
    import pyarrow as pa

    from batchscore.formats.table import write_jsonl
    from batchscore.output.table import with_metadata

    table = with_metadata(pa.table({"row_id": [0], "p_Home & Garden": [0.25], "p_cal_Home & Garden": [0.5],
                                    "label": ["Home & Garden"]}),
                          {COLUMN_LABELS_KEY: json.dumps({"home_garden": "Home & Garden"})})
    write_jsonl(table, tmp_path / "out.jsonl")
    assert json.loads((tmp_path / "out.jsonl").read_text()) == {
        "row_id": 0, "p_home_garden": 0.25, "p_cal_home_garden": 0.5, "label": "Home & Garden"}


def _slug_job(tmp_path, **output):
    data = write_sample_subset(tmp_path / "in.parquet", queries=2, product_ids=("P001", "P002"))
    return write_job(tmp_path, data, prompt=PROMPT, labels=LABELS,
                     output={"column_names": "slug", "logprobs": True, **output})


def test_a_slug_output_reads_unquoted_in_duckdb_and_records_its_labels(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    run_job(load_job(_slug_job(tmp_path)), progress=False)
    out = tmp_path / "out.parquet"
    schema = pq.read_schema(out)
    assert schema.names[:7] == ["pair_id", "product_id", "p_home_garden", "p_electronics", "p_toys", "label",
                                "label_mass"]
    assert {"logp_home_garden", "logp_electronics", "logp_toys"} <= set(schema.names)
    assert json.loads(schema.metadata[COLUMN_LABELS_KEY.encode()]) == {
        "home_garden": "Home & Garden", "electronics": "Electronics", "toys": "Toys"}
    rows = duckdb.sql(f"select pair_id, p_home_garden + p_electronics + p_toys as total, label "
                      f"from read_parquet('{out}') order by pair_id").fetchall()
    assert len(rows) == 4 and all(abs(total - 1.0) < 1e-9 and label in LABELS for _, total, label in rows)
    with pytest.raises(duckdb.Error):  # what slug mode spares a warehouse: the text name unquoted is `p_Home` & ...
        duckdb.sql(f"select p_Home & Garden from read_parquet('{out}')")


@pytest.mark.slow  # two runs and a report (~40 s under load): make test-all
def test_a_slug_output_rederives_partitioned_and_reports_by_label_text(tmp_path):
    """Partitioned by label and slugged: a calibration added since re-derives it (p_cal_<slug>, each
    row's raw scores kept) and the report names the labels by their text."""
    from click.testing import CliRunner

    from batchscore.cli import main
    from batchscore.output import partitioned

    out = tmp_path / "scores"
    job = _slug_job(tmp_path, path=str(out), partition_by=["label"])
    run_job(load_job(job), progress=False)
    first = {row["pair_id"]: row["p_home_garden"] for row in partitioned.read_dataset(out).to_pylist()}
    again = run_job(load_job(job, parse_set_options(["score.calibrate=batch"])), progress=False)
    assert again.rederived and again.processed_tokens == 0
    table = partitioned.read_dataset(out)
    assert {"p_cal_home_garden", "p_cal_electronics", "p_cal_toys"} <= set(table.column_names)
    assert "p_Home & Garden" not in table.column_names
    assert {row["pair_id"]: row["p_home_garden"] for row in table.to_pylist()} == first
    assert {p.parent.name.split("=")[1] for p in partitioned.data_files(out)} <= {
        "Home%20%26%20Garden", "Electronics", "Toys"}  # the label's text, as a partition value
    result = CliRunner().invoke(main, ["report", str(out), "-o", str(tmp_path / "report.html")])
    assert result.exit_code == 0, result.output
    assert "Home &amp; Garden" in (tmp_path / "report.html").read_text()


TEAM = {"type": "choice", "instructions": "Which team should handle this ticket?",
        "criteria": {"Billing & Payments": "charges, refunds", "Shipping": "delivery, parcels",
                     "Account Security": "passwords, fraud", "other": None}}


def test_options_of_one_slug_in_a_question_are_refused_at_load(tmp_path):
    from tests.test_decision_quality import write_job as write_questions_job

    clash = {**TEAM, "criteria": {"Home & Garden": None, "home garden": None}}
    job = write_questions_job(tmp_path, questions={"team": clash}, output={"column_separator": "__"})
    load_job(job)
    with pytest.raises(JobConfigError, match=r"output.column_names slug: 'team.p.Home & Garden' and "
                                             r"'team.p.home garden' would both be written as the column "
                                             r"'team__p__home_garden'"):
        load_job(job, parse_set_options(["output.column_names=slug"]))


@pytest.mark.slow  # a questions run and its report (~15 s under load): make test-all
def test_a_questions_output_names_its_options_by_slugs_and_reports_them_by_text(tmp_path):
    """`team__p__Billing & Payments` is written `team__p__billing_payments` (and its p_cal), read
    unquoted by DuckDB; `team__choice` holds the option's text; the report names it by its text."""
    from click.testing import CliRunner

    from batchscore.cli import main
    from batchscore.tasks.questions.columns import QUESTION_LABELS_KEY

    from tests.test_decision_quality import write_job as write_questions_job

    duckdb = pytest.importorskip("duckdb")
    job = write_questions_job(tmp_path, questions={"team": TEAM}, score={"calibrate": "batch"},
                              output={"column_separator": "__", "column_names": "slug"})
    result = CliRunner().invoke(main, ["run", str(job), "-q", "--report"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out.parquet"
    schema = pq.read_schema(out)
    assert {"team__p__billing_payments", "team__p__shipping", "team__p__account_security", "team__p__other",
            "team__p_cal__billing_payments"} <= set(schema.names)
    assert not [name for name in schema.names if " " in name or "&" in name], schema.names
    assert json.loads(schema.metadata[QUESTION_LABELS_KEY.encode()])["team"]["billing_payments"] == "Billing & Payments"
    rows = duckdb.sql(f"select team__choice, team__p__billing_payments + team__p__shipping + team__p__account_security"
                      f" + team__p__other from read_parquet('{out}')").fetchall()
    assert len(rows) == 12 and all(choice in TEAM["criteria"] and abs(total - 1) < 1e-9 for choice, total in rows)
    html = (tmp_path / "_out.parquet.report.html").read_text()
    assert "Billing &amp; Payments" in html and "billing_payments" not in html
