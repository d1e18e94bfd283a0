"""Pre-tokenized prompts read a batch at a time as arrays (no Python list per row or token).

`flat_token_batch` takes an input batch whose token ids column is an Arrow list of integers and
returns its rows as one flat array plus lengths, with the same row errors `prepare_input` gives
(too long, outside the vocabulary, an option that does not fit). A batch it cannot take whole
(a row unread, null or negative, ids of another type, per-row choices) returns None: the caller
reads it row by row as before, so every message stays the reader's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from batchscore.io.readers import InputBatch
from batchscore.plan.options import OptionTokens
from batchscore.plan.validate import prompt_problems, row_maxima

_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass
class FlatBatch:
    """A batch's scorable rows as arrays, and its row errors."""

    row_ids: np.ndarray  # [R] int64
    tokens: np.ndarray  # [T] int32
    lengths: np.ndarray  # [R] int64
    option_sets: np.ndarray  # [R] int32: index into `options`, -1 none
    options: list[OptionTokens]
    errors: dict[int, str]


def flat_token_batch(batch: InputBatch, column: str, first_row_id: int, max_length: int | None,
                     vocab_size: int | None, limit_name: str, option_source=None) -> FlatBatch | None:
    """`batch`'s rows as a FlatBatch, or None when it must be read row by row (see the module)."""
    table = batch.table
    if column not in table.column_names or any(e is not None for e in batch.row_errors):
        return None
    if option_source is not None and option_source.labels is None:
        return None  # per-row choices: their checks are per row
    values = table.column(column).combine_chunks()
    if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)) \
            or not pa.types.is_integer(values.type.value_type) or values.null_count:
        return None
    if values.offset:
        values = pa.concat_arrays([values])  # offsets from zero
    flat = values.flatten()
    if flat.null_count:
        return None
    tokens = flat.to_numpy(zero_copy_only=False)
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) > _INT32_MAX):
        return None
    offsets = np.asarray(values.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    n = len(lengths)
    row_ids = first_row_id + np.arange(n, dtype=np.int64)
    ok = np.ones(n, dtype=bool)
    errors: dict[int, str] = {}
    for offset, problem in prompt_problems(lengths, row_maxima(tokens, lengths), max_length, vocab_size=vocab_size,
                                           limit_name=limit_name).items():
        errors[int(row_ids[offset])] = problem.at(batch.where(offset))  # typed
        ok[offset] = False
    options: list[OptionTokens] = []
    option_sets = np.full(n, -1, dtype=np.int32)
    if option_source is not None and ok.any():
        first = int(np.flatnonzero(ok)[0])
        where = lambda offset: batch.where(offset)  # noqa: E731
        row_tokens = lambda offset: tokens[offsets[offset] : offsets[offset + 1]]  # noqa: E731
        [(shared, problem)] = option_source.batch([row_tokens(first)], None, [None], [where(first)])
        if shared is None:
            return None  # a label with no tokens, or the first row too long: the row-by-row path names it
        # Pre-tokenized prompts take the labels tokenized alone, the same for every row; only
        # whether the longest fits after the prompt depends on the row.
        too_long = ok & (max_length is not None) & (lengths + int(shared.longest) - 1 > (max_length or 0))
        for offset in np.flatnonzero(too_long).tolist():
            [(_, message)] = option_source.batch([row_tokens(offset)], None, [None], [where(offset)])
            errors[int(row_ids[offset])] = message
            ok[offset] = False
        options = [shared]
        option_sets[ok] = 0
    keep = np.flatnonzero(ok)
    if len(keep) == n:
        kept_tokens = tokens
    else:
        kept = np.repeat(ok, lengths)
        kept_tokens = tokens[kept]
    return FlatBatch(row_ids[keep], np.ascontiguousarray(kept_tokens, dtype=np.int32), lengths[keep],
                     option_sets[keep], options, errors)
