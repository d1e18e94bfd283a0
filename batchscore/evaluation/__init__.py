"""Evaluation harnesses on batchscore: lm-evaluation-harness's `batchscore` backend
(`lm_eval_backend.py`), the command that runs lm-eval with it (`command.py`) and the offline
sample tasks (`sample_tasks.py`). lm-eval is an optional extra: `pip install batchscore[lm-eval]`."""
