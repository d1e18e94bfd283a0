"""The job-file checks of the post-processing keys every task shares (calibrate.from, the fit/eval
split, review and out-of-scope values). The tasks call them from their own `quality_problems`
(task.py), so the rules live beside the scores they shape, not in jobfile.py, and no task calls
back into the job-file reader.
"""

from __future__ import annotations

from batchscore.config import JobConfig


def common_quality_problems(config: JobConfig) -> list[str]:
    """The checks labels and questions jobs share: calibrate.from, the split, review and out_of_scope values."""
    problems = []
    method, cal = config.score.calibrate, config.calibrate
    review, scope = config.output.review, config.output.out_of_scope
    if cal.from_ is not None and method == "none":
        problems.append("calibrate.from: score.calibrate is none; set the method whose fitted values it holds")
    if not 0.0 < cal.holdout_fraction < 1.0:
        problems.append(f"calibrate.holdout_fraction: the share of labeled rows that fits, between 0 and 1 "
                        f"(exclusive), got {cal.holdout_fraction}")
    if cal.seed < 0:
        problems.append(f"calibrate.seed: must be ≥ 0, got {cal.seed}")
    if review is not None:
        if not 0.0 < review.max_error < 1.0:
            problems.append(f"output.review.max_error: an error rate between 0 and 1 (exclusive), got {review.max_error}")
        if not 0.0 < review.confidence < 1.0:
            problems.append(f"output.review.confidence: between 0 and 1 (exclusive), got {review.confidence}")
    if scope is not None:
        floor = scope.min_label_mass
        if isinstance(floor, str) and floor != "auto" or isinstance(floor, float) and not 0.0 <= floor <= 1.0:
            problems.append(f"output.out_of_scope.min_label_mass: a label mass between 0 and 1, or auto, got {floor!r}")
    return problems
