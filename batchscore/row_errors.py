"""Typed row errors: why one row has no scores, as a kind the stages act on and a message people read.

A `RowError(kind, message)` is the message itself (a `str`: the output's `error` column, logs and
every `errors: dict[int, str]` hold it unchanged) with its `kind` beside it. The kind travels with
the row through the parts (output/parts.py's `error_kind` column), so a wire format picks the HTTP
status of a failed request (formats/openai_batch.py) and the server tells a request that never ran
from one that failed (serve/) by kind, never by searching the text.

Standard library only: every folder may import it.
"""

from __future__ import annotations

INPUT = "input"  # the row cannot be read, rendered or tokenized as given (a missing field, bad token ids)
TOO_LONG = "too_long"  # its prompt is longer than the model's or the engine's limit
NOT_SCORED = "not_scored"  # no result from the engine: the row was never scored (e.g. a run stopped early)
FAILED = "failed"  # scoring or answering it failed (an engine error, scores no answer can be read from)
KINDS = (INPUT, TOO_LONG, NOT_SCORED, FAILED)


class RowError(str):
    """One row's error: `kind` (one of KINDS) and its message (the string itself)."""

    def __new__(cls, kind: str, message: str) -> RowError:
        if kind not in KINDS:
            raise ValueError(f"unknown row error kind {kind!r} (known: {', '.join(KINDS)})")
        error = super().__new__(cls, message)
        error.kind = kind
        return error

    @property
    def message(self) -> str:
        return str.__str__(self)

    def at(self, where: str) -> RowError:
        """The same error, its message prefixed by where the row is (`file:line`)."""
        return RowError(self.kind, f"{where}: {self.message}")

    def __reduce__(self):  # pickled whole (Ray workers send results back)
        return RowError, (self.kind, self.message)

    def __repr__(self) -> str:
        return f"RowError({self.kind!r}, {self.message!r})"


def no_result() -> RowError:
    """A row no part holds a result for: never silently lost, written as an error row."""
    return RowError(NOT_SCORED, "not scored: no result from the engine")


def kind_of(error: str | None, default: str = INPUT) -> str | None:
    """The kind of a row's error (None: no error); `default` for a plain message (a parts folder
    written before kinds were recorded)."""
    if error is None:
        return None
    return error.kind if isinstance(error, RowError) else default


def typed(message: str | None, kind: str | None, default: str = INPUT) -> RowError | None:
    """A message read back with its recorded kind (None: `default`) as a RowError."""
    if message is None:
        return None
    return RowError(kind if kind in KINDS else default, message)


def with_kinds(errors: dict, kind: str = INPUT) -> dict:
    """`errors` (row -> message) with every plain message typed as `kind` (changed in place; the
    typed ones keep theirs); returned for convenience."""
    for row, message in errors.items():
        if message is not None and not isinstance(message, RowError):
            errors[row] = RowError(kind, message)
    return errors
