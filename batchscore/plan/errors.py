"""The planner's error type, kept apart so every planner module can raise it."""

from __future__ import annotations


class PlanInputError(ValueError):
    """A request the planner cannot plan: empty prompt, non-integer or negative token ids."""
