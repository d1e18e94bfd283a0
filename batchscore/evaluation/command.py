"""`batchscore eval ARGS...`: lm-evaluation-harness's own command line with the `batchscore`
backend registered. lm-eval 0.4.13 resolves `--model NAME` against its built-in registry only (the
`lm_eval.models` entry point that batchscore declares is read by later lm-eval releases), so this
command imports the backend, which registers it, and hands every argument to lm-eval unchanged.
"""

from __future__ import annotations

import sys

INSTALL = "pip install 'batchscore[lm-eval]'"


USAGE = """batchscore eval: lm-evaluation-harness's command line with the `batchscore` model backend
registered; every argument goes to lm-eval unchanged (its own help follows).

Example:

    batchscore eval-tasks out/tasks
    batchscore eval --model batchscore --model_args dtype=float32 --tasks batchscore_mc --include_path out/tasks

--model_args of the batchscore backend: model, dtype, engine, work_dir, max_length, add_bos_token,
prefix_token_id, progress, and dotted job keys (engine.token_budget=8192); docs/jobs.md,
"lm-evaluation-harness on batchscore".

"""


def run_lm_eval(args: list[str]) -> int:
    """Run lm-eval's CLI on `args` with the batchscore backend registered; its exit code."""
    if not args or args in (["-h"], ["--help"]):
        sys.stdout.write(USAGE)
        sys.stdout.flush()
        args = ["run", "--help"]
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as exc:
        sys.stderr.write(f"batchscore eval: lm-evaluation-harness is not installed ({exc}); {INSTALL}\n")
        return 2
    import batchscore.evaluation.lm_eval_backend  # noqa: F401  (registers --model batchscore)

    argv = sys.argv
    sys.argv = ["lm_eval", *args]
    try:
        cli_evaluate()
    except SystemExit as exc:  # argparse's --help / usage errors, a refused generation task
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        sys.argv = argv
    return 0
