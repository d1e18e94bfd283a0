"""Which input columns the scores are made from, and which only assembly reads.

The run identity fingerprints these two sets apart (output/identity.py `input_identities`): an
edit to a truth or kept column leaves every scored part valid and the run only assembles again,
while an edit to a column a prompt, an option list, the token ids or the row ids come from is
a different job. The lists mirror what the readers read: `prepare_input` for a labels or choices
job, `tasks/questions/reads.py` for a questions job.
"""

from __future__ import annotations

from batchscore.config import JobConfig
from batchscore.prepare.prompts import compile_template


def scoring_columns(config: JobConfig) -> list[str] | None:
    """The columns a row's requests are built from, in a fixed order; None when the scores may
    depend on any part of a line (OpenAI Batch files, whose bodies are the requests) or there is
    no input file (synthetic rows)."""
    inp = config.input
    if inp.synthetic is not None or inp.format == "openai_batch":
        return None
    columns = [inp.id_column] if inp.id_column else []
    if config.questions is not None or inp.questions_column is not None:
        prompt = config.prompt
        columns += list(prompt.state_columns) if prompt.state_columns else \
            compile_template(prompt.template, prompt.engine).columns
        columns += [inp.questions_column] if inp.questions_column else []
    elif inp.token_ids_column:
        columns.append(inp.token_ids_column)
    else:
        columns += compile_template(config.prompt.template, config.prompt.engine).columns
    if inp.choices_column:
        columns.append(inp.choices_column)
    return list(dict.fromkeys(columns))


def assembly_columns(config: JobConfig) -> list[str]:
    """The columns only assembly reads: truth and kept columns no request is built from."""
    scoring = set(scoring_columns(config) or ())
    named = [*config.output.keep_columns, config.calibrate.truth_column, *config.calibrate.truth_columns.values()]
    return [c for c in dict.fromkeys(named) if c and c not in scoring]
