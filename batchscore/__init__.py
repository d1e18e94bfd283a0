"""batchscore: offline LLM batch scoring with global prefix sharing.

    import batchscore
    summary = batchscore.run_job(batchscore.load_job("jobs/sample.yaml"))
    scores = batchscore.score_dataframe(df, template="...{text}...", labels=["Yes", "No"])
"""

import os

from batchscore.version import __version__

# Nothing is ever downloaded from a model hub: set before any module imports huggingface_hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__all__ = ["run_job", "load_job", "score_dataframe", "JobConfig", "RunSummary"]


def __getattr__(name):
    # Lazy: `import batchscore.plan` must not pull in the runner's heavier dependencies.
    if name in ("run_job", "RunSummary"):
        from batchscore.run import runner

        return getattr(runner, name)
    if name == "load_job":
        from batchscore.jobfile import load_job

        return load_job
    if name == "JobConfig":
        from batchscore.config import JobConfig

        return JobConfig
    if name == "score_dataframe":
        from batchscore.api import score_dataframe

        return score_dataframe
    raise AttributeError(f"module 'batchscore' has no attribute {name!r}")
