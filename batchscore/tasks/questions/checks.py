"""What a questions job checks in its job file: the questions parse, the state has one source,
the keys of label jobs are absent, its columns do not clash, and calibration and review apply
to its questions."""

from __future__ import annotations

from batchscore.config import JobConfig
from batchscore.errors import DecisionRequestError
from batchscore.formats.registry import answers_in_lines, requests_in_lines
from batchscore.output.layout import ERROR, STATUS
from batchscore.scores.calibration import FITTED
from batchscore.tasks.questions.answers import table_column_types
from batchscore.tasks.questions.columns import joined, option_slugs, slugged
from batchscore.tasks.questions.files import ANSWERS
from batchscore.tasks.questions.quality import QUESTION_METHODS, column_types
from batchscore.tasks.questions.requests import parse_systemone


def job_problems(config: JobConfig) -> list[str]:
    """`questions:` jobs: the questions parse (System One map shape), the state has one source,
    and the keys that belong to label jobs are absent."""

    problems = text_key_problems(config)
    inp, prompt = config.input, config.prompt
    if config.labels:
        problems.append("labels and questions: a decisions job reads each question's own labels; remove labels")
    if inp.choices_column:
        problems.append("input.choices_column and questions: give one of them")
    if requests_in_lines(config):
        problems.append("questions: not used with input.format openai_batch (each line's body holds its questions)")
    if inp.token_ids_column:
        problems.append("input.token_ids_column: not used with questions (the reads are rendered text)")
    if bool(prompt.template) == bool(prompt.state_columns):
        problems.append("prompt.template or prompt.state_columns: give exactly one — the state as a rendered "
                        "template, or a JSON object of these columns")
    if prompt.state_columns is not None and (not prompt.state_columns or not all(
            isinstance(c, str) and c for c in prompt.state_columns)):
        problems.append("prompt.state_columns: a non-empty list of column names")
    if config.engine.speculative is not None:
        problems.append("engine.speculative: not available for questions (reads are scored exactly)")
    if answers_in_lines(config):
        problems.append("output.format openai_batch: a questions job writes parquet or jsonl")
    if config.questions is not None:
        if not isinstance(config.questions, dict) or not config.questions:
            problems.append("questions: a map of question id -> {type, instructions, criteria}")
        else:
            try:
                parse_systemone({"state": "", "questions": config.questions})
            except DecisionRequestError as exc:
                where = f"questions.{exc.question}" if exc.question is not None else "questions"
                problems.append(f"{where}: {exc}")
    return problems


def output_columns(config: JobConfig) -> tuple[set[str], list[str]]:
    """(the columns a questions job writes besides the id and kept columns, the problems of two of
    them sharing a name). Questions that do not parse are left to job_problems."""

    generated = {STATUS, ERROR} | ({ANSWERS} if config.input.questions_column else set())
    if not isinstance(config.questions, dict) or not config.questions:
        return generated, []
    try:
        questions = parse_systemone({"state": "", "questions": config.questions}).questions
    except DecisionRequestError:
        return generated, []
    problems = []
    try:
        columns = table_column_types(questions)
    except ValueError as exc:
        problems.append(f"questions: {exc}; rename a question id or an option")
        columns = {}
    judged = column_types(config, questions)
    both = [name for name in judged if name in columns]
    if both:
        problems.append(f"questions: {both[0]!r} is both a question's answer column and a calibration or review "
                        "column of another; rename a question id or an option")
    sep, keys = config.output.column_separator, [str(q.key) for q in questions]
    slugs = option_slugs(questions) if config.output.column_names == "slug" else {}
    blank = [(key, option) for key, by in slugs.items() for option, name in by.items() if not name]
    if blank:
        problems.append(f"output.column_names slug: the option {blank[0][1]!r} of question {blank[0][0]!r} has no "
                        "letter a-z or digit to name its columns by; rename it, or keep output.column_names: text")
    sources: dict[str, list[str]] = {}  # each column as the output names it -> the names inside batchscore
    for name in [*columns, *judged]:
        sources.setdefault(joined(slugged(name, slugs), keys, sep), []).append(name)
    named = set(sources)
    clash = next(((column, inner) for column, inner in sources.items() if len(inner) > 1), None)
    if clash is not None and joined(clash[1][0], keys, sep) != joined(clash[1][1], keys, sep):  # the slugs alone
        problems.append(f"output.column_names slug: {clash[1][0]!r} and {clash[1][1]!r} would both be written as the "
                        f"column {clash[0]!r}; make the options differ in letters or digits")
    elif clash is not None:  # joined by the separator, two different columns would get one name
        problems.append(f"output.column_separator {sep!r}: {clash[1][0]!r} and {clash[1][1]!r} would both be written "
                        f"as the column {clash[0]!r}; rename a question id or an option, or keep the separator '.'")
    dots = sorted(name for name in named if "." in name)
    if sep != "." and dots:  # the separator's promise: no column name holds a dot
        problems.append(f"output.column_separator {sep!r}: the column {dots[0]!r} would still hold a dot (a "
                        "question id or option with one); rename it, or keep the separator '.'")
    return generated | named, problems


def quality_problems(config: JobConfig, asked: list[str]) -> list[str]:
    """A questions job's calibration and review: the job's own questions, a table output, one
    truth column per question (`calibrate.truth_columns`), the methods that apply to them."""

    method, cal = config.score.calibrate, config.calibrate
    if cal.truth_columns:
        asked = asked + ["calibrate.truth_columns"]
    if not asked:
        return []
    if config.questions is None:
        return [f"{asked[0]}: calibration and review apply to the job's questions (questions:), not to per-row "
                "questions (input.questions_column)"]
    if answers_in_lines(config):
        return [f"{asked[0]}: the calibration and review columns are written to parquet or jsonl outputs, "
                "not output.format openai_batch"]
    problems = []
    if cal.truth_column is not None:
        problems.append("calibrate.truth_column: a questions job has one truth column per question — write "
                        "calibrate.truth_columns: {<question id>: <input column>}")
    if method not in QUESTION_METHODS:
        problems.append(f"score.calibrate {method}: applies to labels jobs; for questions use one of "
                        f"{', '.join(QUESTION_METHODS)}")
    if not isinstance(cal.truth_columns, dict):
        return problems + [f"calibrate.truth_columns: a map of question id -> input column, got {cal.truth_columns!r}"]
    ids = [str(k) for k in config.questions]
    unknown = [str(k) for k in cal.truth_columns if str(k) not in ids]
    if unknown:
        problems.append(f"calibrate.truth_columns: {unknown} are not questions of this job (its questions: {ids})")
    not_names = [f"{k}: {v!r}" for k, v in cal.truth_columns.items() if not isinstance(v, str) or not v]
    if not_names:
        problems.append(f"calibrate.truth_columns: each value is an input column name; got {', '.join(not_names)}")
    # questions without a truth column stay uncalibrated and unreviewed (stated per question); none at all is refused
    given = [q for q in ids if q in {str(k) for k in cal.truth_columns}]
    if method in FITTED and cal.from_ is None and not given:
        problems.append(f"score.calibrate {method}: fitted on labeled records — calibrate.truth_columns names no "
                        f"question (its questions: {ids}); give a truth column for the questions to calibrate, or "
                        "reuse fitted values with calibrate.from")
    if config.output.review is not None and not given:
        problems.append(f"output.review: needs a truth column for the questions to review (the threshold is chosen "
                        f"where the accepted records' error is known); calibrate.truth_columns names none of {ids}")
    if method == "platt":
        try:
            questions = parse_systemone({"state": "", "questions": config.questions}).questions
        except Exception:  # noqa: BLE001 — job_problems names what is wrong with them
            questions = ()
        wide = [f"{q.key} ({len(q.options)} options)" for q in questions
                if len(q.options) != 2 and (cal.from_ is not None or str(q.key) in given)]
        if wide:
            problems.append(f"score.calibrate platt: two-option questions only (noul, or a choice of two); "
                            f"{', '.join(wide)} — use temperature or vector")
    return problems


def text_key_problems(config: JobConfig) -> list[str]:
    """YAML reads `1:` and `true:` as a number and a boolean: question ids and option names are
    text, so such keys are written as text here (`1` -> "1", `true` -> "true", as JSON writes
    them; noul's `{true: ..., false: ...}` as docs/jobs.md shows it). Any other key (a float, a
    date, null) is refused, to be quoted. Changes `config.questions` and the keys of
    `calibrate.truth_columns` in place."""
    problems: list[str] = []

    def text_keys(mapping: dict, where: str) -> dict:
        result: dict = {}
        for key, value in mapping.items():
            if isinstance(key, bool):
                name = "true" if key else "false"
            elif isinstance(key, (str, int)):
                name = str(key)
            else:
                problems.append(f"{where}: the key {key!r} is a {type(key).__name__}, not text; quote it (e.g. "
                                f"'{key}')")
                name = str(key)
            if name in result:
                problems.append(f"{where}: the keys {name!r} and {key!r} are the same once written as text")
            result[name] = value
        return result

    if isinstance(config.questions, dict):
        config.questions = text_keys(config.questions, "questions")
        for qid, spec in config.questions.items():
            if isinstance(spec, dict) and isinstance(spec.get("criteria"), dict):
                config.questions[qid] = {**spec, "criteria": text_keys(spec["criteria"], f"questions.{qid}.criteria")}
    if isinstance(config.calibrate.truth_columns, dict):
        config.calibrate.truth_columns = text_keys(config.calibrate.truth_columns, "calibrate.truth_columns")
    return problems
