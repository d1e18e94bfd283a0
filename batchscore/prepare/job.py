"""The former home of opening and reading a job, kept one step as a face for callers in progress.

Opening a job (`open_job`, `locate_job`, `prepare_job`, `plan_job`, `scoring_config`,
`assembly_config`, the output-path checks) is `run/open.py`'s; reading its rows
(`prepare_input`, `load_tokenizer`, `make_renderer`, `prompt_limits`) is `prepare/read.py`'s;
`JobSource` and `PreparedJob` are `prepare/source.py`'s. Import them from there.
"""

from __future__ import annotations

from batchscore.prepare.read import load_tokenizer, make_renderer, prepare_input, prompt_limits
from batchscore.prepare.source import JobSource, PreparedJob, plan_options

__all__ = ["JobSource", "PreparedJob", "load_tokenizer", "make_renderer", "plan_options", "prepare_input",
           "prompt_limits"]
