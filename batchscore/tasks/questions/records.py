"""The records of a questions job: each input row, what it asks and which reads answer it, and
the mapping from the run's rows (reads) back to them."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from batchscore.tasks.questions.requests import DecisionRequest


@dataclass
class Record:
    """One input row: what it asks, and which reads answer it (`first_read` .. + `num_reads`).
    `error`: why nothing of it can be answered (status 400); its one read then carries the error."""

    kind: str  # systemone | openai | chat | table
    request: DecisionRequest | None
    error: str | None
    first_read: int
    num_reads: int
    url: str | None = None  # openai_batch: the line's url (chat or text completion)


@dataclass
class DecisionInput:
    """The records of a decision job, their ids and kept columns, and each read's prompt length."""

    records: list[Record]
    ids: pa.Array  # [records] custom_id or the id column (row numbers by default)
    kept: pa.Table  # [records] output.keep_columns
    read_tokens: dict[int, int] = field(default_factory=dict)  # read -> prompt tokens (usage)

    @property
    def num_records(self) -> int:
        return len(self.records)
