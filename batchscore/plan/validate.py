"""Validation of token-id input before planning.

Every error names the offending row (its `row_id`), so a job over millions of rows can say
which input line to fix.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from batchscore.errors import PlanInputError
from batchscore.plan.tree import TokenTable
from batchscore.plan.types import Request
from batchscore.row_errors import INPUT, TOO_LONG, RowError

_INT32_MAX = int(np.iinfo(np.int32).max)


def requests_from_token_lists(
    lists_or_arrays: Iterable, row_ids: Sequence[int] | None = None
) -> list[Request]:
    """Build one `Request` per token list, validating each; changes nothing it is given.

    `row_ids` defaults to 0, 1, 2, …. Raises `PlanInputError` naming the row when a token list
    is empty, not 1-D, holds non-integers (floats, strings, bools), negative ids or ids that do
    not fit in int32.
    """
    token_lists = list(lists_or_arrays)
    if row_ids is None:
        row_ids = range(len(token_lists))
    elif len(row_ids) != len(token_lists):
        raise PlanInputError(
            f"got {len(row_ids)} row ids for {len(token_lists)} token lists"
        )
    return [
        Request(int(row_id), _checked_tokens(row_id, tokens))
        for row_id, tokens in zip(row_ids, token_lists)
    ]


def prompt_problem(num_tokens: int, max_length: int | None, *, largest_token: int | None = None,
                   vocab_size: int | None = None, limit_name: str = "the model's context") -> RowError | None:
    """Why a prompt of `num_tokens` tokens cannot be scored (a typed row error: too long, or a bad
    input), or None when it can.

    The one check of a prompt's length and ids against a model, used where rows are read and by
    each engine (whose `limit_name` says whose limit `max_length` is).
    """
    if num_tokens == 0:
        return RowError(INPUT, "empty prompt: no tokens to score")
    if max_length is not None and num_tokens > max_length:
        return RowError(TOO_LONG, f"prompt is {num_tokens} tokens, longer than the maximum {max_length} ({limit_name})")
    if vocab_size is not None and largest_token is not None and largest_token >= vocab_size:
        return RowError(INPUT, f"token id {largest_token} is outside the model's vocabulary (size {vocab_size})")
    return None


def row_maxima(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[R] the largest token id of each of the rows `tokens` holds back to back (`lengths`), -1
    for an empty row: what `prompt_problems` checks against the vocabulary."""
    lengths = np.asarray(lengths, dtype=np.int64)
    maxima = np.full(len(lengths), -1, dtype=np.int64)
    filled = lengths > 0
    if filled.any():
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        maxima[filled] = np.maximum.reduceat(np.asarray(tokens), starts[filled])
    return maxima


def prompt_problems(lengths: np.ndarray, maxima: np.ndarray | None, max_length: int | None, *,
                    vocab_size: int | None = None, limit_name: str = "the model's context") -> dict[int, RowError]:
    """`prompt_problem` of many prompts at once (`lengths`, and `maxima` from `row_maxima`):
    {index: the RowError} of those that cannot be scored. One numpy mask finds them; only they
    are named one by one, so a batch of good rows costs no call per row."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bad = lengths == 0
    if max_length is not None:
        bad |= lengths > max_length
    if vocab_size is not None and maxima is not None:
        bad |= np.asarray(maxima) >= vocab_size
    named = {int(i): prompt_problem(int(lengths[i]), max_length,
                                    largest_token=int(maxima[i]) if maxima is not None and lengths[i] else None,
                                    vocab_size=vocab_size, limit_name=limit_name) for i in np.flatnonzero(bad)}
    return {i: problem for i, problem in named.items() if problem is not None}


def token_ids_problem(tokens) -> tuple[np.ndarray | None, str | None]:
    """(`tokens` as an int32 array, None), or (None, why they are not a list of token ids).

    The one check of a token list given by a user (`requests_from_token_lists`, a job's
    `input.token_ids_column`): flat, integers (not floats, strings or bools), not negative,
    within int32. An empty list passes here; `prompt_problem` refuses it.
    """
    if isinstance(tokens, (list, tuple)):  # numpy would make [True, 1] integers and [1, 2.0] one float array
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer))][:1]
        if bad:
            if isinstance(bad[0], (list, tuple, dict)):
                return None, f"token ids must be a flat list of integers, got a nested {type(bad[0]).__name__}"
            return None, f"token ids must be integers, got {bad[0]!r} ({type(bad[0]).__name__})"
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as exc:  # ragged nested lists and the like
        return None, f"token ids are not a flat list ({exc})"
    if arr.ndim != 1:
        return None, f"token ids must be a flat list, got shape {arr.shape}"
    if arr.size == 0:
        return arr.astype(np.int32), None
    # bool is an integer subtype in numpy but never a token id.
    if arr.dtype.kind not in "iu":
        return None, f"token ids must be integers, got {arr.dtype} values"
    if arr.min() < 0:
        return None, f"negative token id {int(arr.min())}"
    if arr.max() > _INT32_MAX:
        return None, f"token id {int(arr.max())} does not fit in int32"
    return arr.astype(np.int32, copy=False), None


def _checked_tokens(row_id: int, tokens) -> np.ndarray:
    """Return `tokens` as an int32 array, or raise PlanInputError naming `row_id`."""
    arr, problem = token_ids_problem(tokens)
    problem = problem or prompt_problem(len(arr), None)
    if problem:
        raise PlanInputError(f"row {row_id}: {problem}")
    return arr


def checked_table(requests: Sequence[Request]) -> TokenTable:
    """Validate `requests` and return their TokenTable (arrays shared, not copied).

    Raises PlanInputError naming the first bad row: not a 1-D int32 array, an empty prompt, a
    negative token id, or a row id used twice (then "each request exactly once" has no
    meaning). Changes nothing it is given.
    """
    seen: set[int] = set()
    arrays = []
    for request in requests:
        tokens = request.token_ids
        if tokens.dtype != np.int32 or tokens.ndim != 1:
            raise PlanInputError(f"row {request.row_id}: token ids must be a 1-D int32 array")
        if tokens.shape[0] == 0:
            raise PlanInputError(f"row {request.row_id}: empty token sequence")
        if request.row_id in seen:
            raise PlanInputError(f"row {request.row_id}: row id appears more than once")
        seen.add(request.row_id)
        arrays.append(tokens)
    # Seen as uint32, a negative int32 is above 2**31: one max() per row finds both negative
    # ids and the widest id (which picks the sort-key width).
    maxima = np.fromiter(
        (int(a.view(np.uint32).max()) for a in arrays), dtype=np.int64, count=len(arrays)
    )
    negative = np.flatnonzero(maxima > _INT32_MAX)
    if negative.size:
        row = int(negative[0])
        raise PlanInputError(
            f"row {requests[row].row_id}: negative token id {int(arrays[row].min())}"
        )
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    return TokenTable(arrays, lengths, int(maxima.max()) if arrays else 0)
