"""lm-evaluation-harness's `batchscore` model backend: every loglikelihood request of an evaluation
becomes a row of one batchscore job, so the global prefix plan shares every common prefix
(few-shot preambles, questions, the common start of choices) across the whole evaluation.

Tokenization is lm-eval's own (`TemplateLM.loglikelihood` splits context and continuation, and
`tok_encode` below is its `hf` backend's rule), and truncation is the `hf` backend's: the last
`max_length + 1` tokens of context + continuation. Each distinct (truncated) context is one row,
pre-tokenized (`input.token_ids_column`), its distinct continuations that row's options given as
token ids; the job writes each option's total log-probability (`output.logprobs`) and whether it
is the greedy continuation (`output.greedy`). The job lives in a folder named by its content
(`work_dir`), so a killed evaluation resumes from its parts and a repeated one reads the finished
output without scoring.

`loglikelihood_rolling` cuts each text into lm-eval's rolling windows and scores them as
loglikelihood requests of the same kind; `generate_until` is refused (batchscore is a scoring
engine). Imported by `batchscore eval` (and by lm-eval itself, through the `lm_eval.models` entry
point, where the installed lm-eval discovers outside backends).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

log = logging.getLogger("batchscore")

NAME = "batchscore"
# keys of --model_args the backend reads itself; any other key is a job key (engine.token_budget=...)
OWN_KEYS = ("model", "pretrained", "dtype", "engine", "work_dir", "max_length", "add_bos_token",
            "prefix_token_id", "progress")
# what lm-eval hands every backend that batchscore does not use: the plan batches by tokens
IGNORED_KEYS = ("batch_size", "max_batch_size", "device", "trust_remote_code", "parallelize")


# A row's continuations attend to each other's rows through one dense mask (the torch engine's
# option layout), so a context with many long continuations (rolling windows all start at the
# prefix token) is split into rows of at most this many continuation tokens; rows of one context
# still share its prefix in the plan.
OPTION_TOKENS_PER_ROW = 64


class GenerationRefused(SystemExit):
    """A generate_until request: batchscore scores text, it does not generate it (exit 2, no traceback)."""


@register_model(NAME)
class BatchscoreLM(TemplateLM):
    """`lm_eval --model batchscore --model_args model=...,dtype=float32,engine=torch,...`.

    model (or pretrained): a batchscore model (the built-in name, a folder or a hub id already in
    the cache); dtype: float32 | bfloat16 | float16; engine: torch (the default; the only engine
    that reads `is_greedy`) ; work_dir: where the evaluation's jobs live (default
    `$BATCHSCORE_HOME/lm-eval`); max_length, add_bos_token, prefix_token_id: as lm-eval's `hf`
    backend has them; progress: the job's progress bars; any dotted key (`engine.token_budget=4096`)
    sets that job key. Each job writes its run summary (`run.json`) beside its output; the HTML run
    report covers fixed labels only, not these per-row options.
    """

    def __init__(self, model: str | None = None, pretrained: str | None = None, dtype: str = "float32",
                 engine: str = "torch", work_dir: str | None = None, max_length: int | None = None,
                 add_bos_token: bool = False, prefix_token_id: int | None = None, progress: bool = True,
                 **keys: Any) -> None:
        super().__init__()
        from transformers import AutoConfig

        from batchscore.engines.registry import reads_greedy
        from batchscore.models import DEFAULT_MODEL, batchscore_home, resolve_model
        from batchscore.prepare.read import load_tokenizer

        unknown = sorted(k for k in keys if "." not in k and k not in IGNORED_KEYS)
        if unknown:
            raise ValueError(f"--model_args: unknown key(s) {', '.join(unknown)} for the batchscore backend; it takes "
                             f"{', '.join(OWN_KEYS)} and dotted job keys (engine.token_budget=4096)")
        self.reads_greedy = reads_greedy(str(engine))
        if not self.reads_greedy:
            log.warning("lm-eval on batchscore's %s engine: is_greedy is not read there and is reported False for "
                        "every request (metrics built on it, such as a loglikelihood task's acc, are wrong); "
                        "engine=torch reads it", engine)
        self.model_spec = str(model or pretrained or DEFAULT_MODEL)
        self.model_dir = resolve_model(self.model_spec)
        self.dtype, self.engine = str(dtype), str(engine)
        self.job_keys = {k: v for k, v in keys.items() if "." in k}
        self.work_dir = Path(work_dir) if work_dir else batchscore_home() / "lm-eval"
        self.progress = bool(progress)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.add_bos_token = bool(add_bos_token)
        self.custom_prefix_token_id = prefix_token_id
        if max_length:
            self._max_length = int(max_length)
        else:
            from lm_eval.models.utils import resolve_max_length

            self._max_length = resolve_max_length(AutoConfig.from_pretrained(self.model_dir), self.tokenizer)

    # ------------------------------------------------------------------ lm-eval's hf tokenization

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """lm-eval's `hf` rule: special tokens as `add_bos_token` says unless the caller says, and
        none when the text already starts with the prefix token's text."""
        from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    # ------------------------------------------------------------------ requests

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of every (cache key, context tokens, continuation tokens)."""
        if not requests:
            return []
        open_rows: dict[tuple[int, ...], int] = {}  # context -> the row its next continuation joins
        contexts: list[tuple[int, ...]] = []
        options: list[dict[tuple[int, ...], int]] = []  # per row: continuation -> option
        where = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval asked the log-likelihood of an empty continuation")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens is longer than max_length "
                                 f"{self.max_length}")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            head, tail = tuple(whole[: len(whole) - len(continuation)]), tuple(continuation)
            row = open_rows.get(head)
            if row is not None and tail not in options[row] and \
                    sum(map(len, options[row])) + len(tail) > OPTION_TOKENS_PER_ROW:
                row = None  # a full row: the context's later continuations start another (sharing its prefix)
            if row is None:
                row = open_rows[head] = len(contexts)
                contexts.append(head)
                options.append({})
            where.append((row, options[row].setdefault(tail, len(options[row]))))
        logp, greedy = self._score(contexts, [list(o) for o in options])
        results = [(float(logp[r][k]), bool(greedy[r][k])) for r, k in where]
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-likelihood over lm-eval's rolling windows (every token predicted
        once, with as much context as `max_length` allows), all texts' windows in one job."""
        from lm_eval import utils

        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows)
        totals = np.zeros(len(requests))
        np.add.at(totals, np.asarray(owners, dtype=np.int64), [logp for logp, _ in scores])
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, float(total))
        return [float(t) for t in totals]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        tasks = sorted({getattr(r, "task_name", None) or "?" for r in requests})
        sys.stderr.write(f"batchscore: the lm-eval task(s) {', '.join(tasks)} generate text (generate_until); the "
                         "batchscore backend scores text and does not generate it. Run loglikelihood and "
                         "perplexity tasks (multiple_choice, loglikelihood, loglikelihood_rolling) on it, and "
                         "generation tasks on lm-eval's hf or vllm backend.\n")
        raise GenerationRefused(2)

    # ------------------------------------------------------------------ the job

    def _score(self, contexts: list[tuple[int, ...]], options: list[list[tuple[int, ...]]]
               ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each row's options' total log-probability and greedy flag, from one batchscore job
        whose folder is named by what it scores (a rerun resumes or reads the finished output)."""
        from batchscore.jobfile import _set_dotted, config_from_dict
        from batchscore.run.runner import run_job

        table = pa.table({
            "row": pa.array(np.arange(len(contexts), dtype=np.int64)),
            "context": pa.array([np.asarray(c, dtype=np.int32) for c in contexts], type=pa.list_(pa.int32())),
            "continuations": pa.array([[np.asarray(o, dtype=np.int32) for o in row] for row in options],
                                      type=pa.list_(pa.list_(pa.int32()))),
        })
        folder = self.work_dir / self._digest(contexts, options)
        folder.mkdir(parents=True, exist_ok=True)
        source = folder / "requests.parquet"
        if not source.exists():
            tmp = folder / ".requests.parquet.tmp"
            pq.write_table(table, tmp)
            tmp.replace(source)
        raw: dict[str, Any] = {
            "model": self.model_spec,
            "input": {"path": str(source), "id_column": "row", "token_ids_column": "context",
                      "choices_column": "continuations"},
            "engine": {"kind": self.engine, "dtype": self.dtype},
            "output": {"path": str(folder / "scores.parquet"), "logprobs": True, "greedy": self.reads_greedy,
                       "max_error_rate": 1.0},
        }
        for key, value in self.job_keys.items():
            _set_dotted(raw, key, value)
        config = config_from_dict(raw, source=str(folder / "job"))
        log.info("lm-eval: %d requests as %d rows of one job in %s", sum(len(o) for o in options), len(contexts),
                 folder)
        run_job(config, progress=self.progress, metrics=str(folder / "run.json"))
        out = pq.read_table(folder / "scores.parquet", columns=["row", "status", "error", "logp_choices"]
                            + (["greedy_choices"] if config.output.greedy else []))
        status = out.column("status").to_pylist()
        if any(s != "ok" for s in status):
            bad = next(i for i, s in enumerate(status) if s != "ok")
            raise RuntimeError(f"batchscore could not score lm-eval's context {bad} ({len(contexts[bad])} tokens): "
                               f"{out.column('error')[bad].as_py()} (the job: {folder})")
        logp = [np.asarray(v, dtype=np.float64) for v in out.column("logp_choices").to_pylist()]
        greedy = ([np.asarray(v, dtype=bool) for v in out.column("greedy_choices").to_pylist()]
                  if config.output.greedy else [np.zeros(len(v), dtype=bool) for v in logp])
        return logp, greedy


    def _digest(self, contexts: list[tuple[int, ...]], options: list[list[tuple[int, ...]]]) -> str:
        """The job folder's name: what the job scores (the model, dtype, engine, job keys and every
        row's tokens), so the same evaluation finds its job again."""
        digest = hashlib.sha256(json.dumps([self.model_spec, self.dtype, self.engine, self.job_keys],
                                           sort_keys=True, default=str).encode())
        for context, row in zip(contexts, options):
            lengths = [len(context), len(row), *map(len, row)]
            digest.update(np.asarray(lengths, dtype=np.int64).tobytes())
            digest.update(np.asarray([*context, *(t for option in row for t in option)], dtype=np.int64).tobytes())
        return digest.hexdigest()[:16]
