"""Labels and per-row choices: what is scored after each prompt (the input half; the output half,
scores to columns, is scores/normalize.py).

A job scores either the same `labels` after every prompt, or each row's own options
(`input.choices_column`, a list<string> column). Either way an option is any non-empty text:

- Tokens: an option's tokens are the tokens that follow the prompt's own tokens when prompt text +
  option text is tokenized as one text (lm-evaluation-harness's rule), so merges at the boundary
  are handled the way lm-eval handles them. When an option's tokens there differ from the option
  tokenized alone, the job log says so once. Pre-tokenized prompts (`input.token_ids_column`) have
  no text: their options are tokenized alone.
- Scores: each option's total log-probability (the sum over its tokens, from the model's
  full-vocabulary softmax) is what the engines return; `score.normalize` (sum | token | byte) says
  how scores/normalize.py turns totals into the probabilities written.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from batchscore.plan.options import OptionTokens
from batchscore.prepare.prompts import special_token_pattern
from batchscore.prepare.tail_tokens import TailCache, tail_rule

log = logging.getLogger("batchscore")

NORMALIZE = ("sum", "token", "byte")


# ---------------------------------------------------------------------------- validation


def label_problems(labels: Sequence[str], choices_column: str | None, normalize: str) -> list[str]:
    """Problems of a job's `labels` / `input.choices_column` / `score.normalize` (config validation)."""
    problems = []
    if normalize not in NORMALIZE:
        problems.append(f"score.normalize: must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
    if choices_column is not None:
        if labels:
            problems.append("labels and input.choices_column: give one of them — fixed labels for every row, "
                            "or a list<string> column of each row's own options")
        return problems
    if len(labels) < 2:
        problems.append("labels: give at least two labels, e.g. labels: [Yes, No] "
                        "(or input.choices_column for each row's own options)")
        return problems
    empty = [i for i, label in enumerate(labels) if label == ""]
    if empty:
        problems.append(f"labels: label {empty[0]} is empty; every label needs some text")
    if len(set(labels)) != len(labels):
        problems.append(f"labels: must be distinct, got {list(labels)}")
    return problems


def choices_problem(value: Any) -> tuple[list[str] | None, str | None]:
    """(the row's options, None), or (None, why the value is not a list of two or more distinct
    non-empty strings: one option would get P = 1 whatever the model says, as a labels job with
    one label would, which the job file refuses).

    A string holding a JSON list of strings is accepted as that list: the JSONL reader turns a
    column whose rows mix types into text, lists included.
    """
    if value is None:
        return None, "is null (expected a list of option strings)"
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            decoded = None
        if not isinstance(decoded, list):
            return None, f"must be a list of option strings, got the string {_short(value)}"
        value = decoded
    if not isinstance(value, (list, tuple)):
        return None, f"must be a list of option strings, got {type(value).__name__} {_short(value)}"
    if len(value) == 0:
        return None, "is an empty list: no options to score"
    if len(value) == 1:
        return None, (f"holds one option ({_short(value[0])}): a choice needs at least two, "
                      "or its probability is 1 whatever the model says")
    for index, option in enumerate(value):
        if not isinstance(option, str):
            kind = "null" if option is None else f"{type(option).__name__} {_short(option)}"
            return None, f"option {index} is {kind}, not a string"
        if option == "":
            return None, f"option {index} is empty; every option needs some text"
    first: dict[str, int] = {}
    for index, option in enumerate(value):
        if first.setdefault(option, index) != index:  # two copies would split one option's probability
            return None, (f"option {index} {_short(option)} repeats option {first[option]}; "
                          "a row's options must be distinct")
    return list(value), None


def holds_token_lists(value: Any) -> bool:
    """A choices value given as token ids: a list whose first option is itself a list (of ids)."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and isinstance(value[0], (list, tuple, np.ndarray))


def token_choices_problem(value: Any, vocab_size: int | None = None) -> tuple[list[list[int]] | None, str | None]:
    """(a pre-tokenized row's options as token id lists, None), or (None, why not).

    With `input.token_ids_column`, `input.choices_column` may hold each option's token ids
    (list<list<int>>): the tokens scored after the prompt, as given (lm-eval's continuation
    tokens). One option is allowed: its total log-probability (`output.logprobs`, `logp_choices`)
    is the point of such a row; its normalized probability is 1. Repeated options are refused as
    for text (two copies would split one option's probability).
    """
    from batchscore.plan.validate import token_ids_problem

    lists = []
    for index, option in enumerate(value):
        tokens, problem = token_ids_problem(list(option) if isinstance(option, np.ndarray) else option)
        if problem:
            return None, f"option {index}: {problem}"
        if not len(tokens):
            return None, f"option {index} is an empty list of token ids; every option needs a token"
        if vocab_size is not None and int(tokens.max()) >= vocab_size:
            return None, (f"option {index}: token id {int(tokens.max())} is outside the model's vocabulary "
                          f"(size {vocab_size})")
        lists.append([int(t) for t in tokens])
    first: dict[tuple, int] = {}
    for index, tokens in enumerate(lists):
        if first.setdefault(tuple(tokens), index) != index:
            return None, f"option {index} repeats option {first[tuple(tokens)]}; a row's options must be distinct"
    return lists, None


def choices_for_output(choices, ok: np.ndarray) -> list | None:
    """Each row's options as read (for the `choice` column), from `choices` (an Arrow array of the
    choices column): a list for ok rows, None elsewhere. Options given as token ids are named by
    their ids as JSON text ("[323, 9]")."""
    if choices is None:
        return None
    values = choices.to_pylist()
    return [(([json.dumps([int(t) for t in option]) for option in v] if holds_token_lists(v)
              else choices_problem(v)[0]) if good else None) for v, good in zip(values, ok)]


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------- tokenization


@dataclass
class BoundaryReport:
    """Options whose tokens after the prompt differ from the option tokenized alone."""

    rows: int = 0
    example: str | None = None

    def note(self, row_label: str, option: str, after: list[int], alone: list[int], tokenizer) -> None:
        self.rows += 1
        if self.example is None:
            pieces = lambda ids: [tokenizer.decode([t]) for t in ids]  # noqa: E731
            self.example = (f"{row_label}: option {option!r} is {pieces(after)} after the prompt, "
                            f"{pieces(alone)} alone")

    def log_once(self, total_rows: int) -> None:
        if self.rows:
            log.warning("labels: in %d of %d rows an option's tokens depend on the end of the prompt "
                        "(e.g. %s); each option is scored as the tokens that follow the prompt's own tokens "
                        "when prompt + option are tokenized as one text, as lm-eval does. To avoid it, end "
                        "the prompt where a token ends (e.g. before a trailing space) and start the options "
                        "with that text (' Yes').", self.rows, total_rows, self.example)


class OptionEncoder:
    """Tokenizes options after their prompts (see the module docstring), interning equal results.

    Where the tokenizer allows it (prepare/tail_tokens.py) an option is tokenized after the
    prompt's last two pre-tokens only, once per distinct tail: the same ids as the full encode.
    The first `CHECK_ROWS` rows of each tail (at most `CHECK_BUDGET` rows a job) are also encoded
    in full and compared; on a difference the job logs it and encodes every later row in full.
    """

    CHECK_ROWS = 64
    CHECK_BUDGET = 4096

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.boundary = BoundaryReport()
        self._alone: dict[str, list[int]] = {}
        self._alone_split: dict[str, list[int]] = {}  # options from the data: special-token text split
        self._special = special_token_pattern(tokenizer)
        self._interned: dict[tuple[bytes, bytes], OptionTokens] = {}
        self._by_lists: dict[tuple, OptionTokens] = {}
        rule = tail_rule(tokenizer) if not getattr(tokenizer, "split_special_tokens", False) else None
        self.tails = TailCache(tokenizer, rule) if rule is not None else None
        self._checked = 0

    def alone(self, options: Sequence[str], split: bool = False) -> list[list[int]]:
        """Each option tokenized on its own (cached); `split`: options from the data, whose
        special-token text is tokenized as plain text (never a control token)."""
        cache = self._alone_split if split else self._alone
        missing = [o for o in dict.fromkeys(options) if o not in cache]
        if missing:
            encoded = self.tokenizer(missing, add_special_tokens=False, split_special_tokens=split)["input_ids"]
            cache.update(zip(missing, encoded))
        return [cache[o] for o in options]

    def data_option_pieces(self, texts: Sequence[str], options: Sequence[Sequence[str]],
                           pieces: Sequence[tuple[str, bool] | None] | None) -> list[tuple[str, bool] | None] | None:
        """Options read from the data (`input.choices_column`) are text, never control tokens: a row
        whose options hold special-token text (`<|im_end|>`) gets as its last piece the prompt's text
        after its last special token, tokenized with special tokens split (`after_prompts`: the
        options follow that piece; a special token is a hard boundary, so the piece's own tokens are
        the prompt's). Other rows keep `pieces`."""
        if self._special is None or not any(self._special.search(o) for opts in options for o in opts):
            return pieces
        out = list(pieces) if pieces is not None else [None] * len(texts)
        for i, opts in enumerate(options):
            if any(self._special.search(o) for o in opts):
                ends = [m.end() for m in self._special.finditer(texts[i])]
                out[i] = (texts[i][ends[-1]:] if ends else texts[i], True)
        return out

    def intern(self, token_lists: list[list[int]]) -> OptionTokens:
        """One shared OptionTokens per distinct list of option tokens."""
        key = tuple(map(tuple, token_lists))
        options = self._by_lists.get(key)
        if options is None:
            options = OptionTokens.from_lists(token_lists)
            options = self._interned.setdefault(options.key(), options)
            if len(self._by_lists) >= 65536:  # rows with their own options: keep the lookup small
                self._by_lists.clear()
            self._by_lists[key] = options
        return options

    def after_prompts(self, texts: Sequence[str], prompt_tokens: Sequence[Sequence[int]],
                      options: Sequence[Sequence[str]], row_labels: Sequence[str],
                      name=lambda index, text: f"option {index} {_short(text)}", chat: Sequence[bool] | None = None,
                      pieces: Sequence[tuple[str, bool] | None] | None = None,
                      cuts: Sequence[tuple[int, int] | None] | None = None,
                      ) -> list[tuple[list[list[int]] | None, str | None]]:
        """For each row, (the token ids of each option after its prompt, None) or (None, why not).

        texts[i] / prompt_tokens[i]: row i's prompt text and its tokens; options[i]: its options;
        row_labels[i]: how to name the row in messages; name(index, text): how to name an option;
        chat[i]: the prompt text holds a chat template's special tokens (then no BOS and the like
        are added when tokenizing, as for the prompt; default: every row); pieces[i]: for a prompt
        tokenized piece by piece (data holding special-token text), its last piece and whether
        that piece is data: options then follow that piece, tokenized the way the piece was;
        cuts[i]: the prompt's cut (k, c) from `PromptRenderer.encode_cuts` (None: encode in full).
        """
        fast = self._from_tails(texts, prompt_tokens, options, pieces, cuts) \
            if self.tails is not None and cuts is not None else {}
        check = [i for i in fast if self._to_check(fast[i][1])]
        full = self._full(texts, prompt_tokens, options, chat, pieces,
                          [i for i in range(len(texts)) if i not in fast] + check)
        for i in check:
            (pairs, _, _), _, k = fast[i]
            head = list(prompt_tokens[i][:k])
            wrong = next((o for o, pair, (_, _, whole) in zip(options[i], pairs, full[i])
                          if head + pair.tokens != list(whole)), None)
            if wrong is not None:
                log.warning("labels: tokenizing option %r after the end of the prompt alone differs from tokenizing "
                            "the whole prompt + option (%s); every row from here on is tokenized whole",
                            wrong, row_labels[i])
                self.tails = None
                full.update(self._full(texts, prompt_tokens, options, chat, pieces, [j for j in fast if j not in full]))
                fast = {}
                break
        results = []
        for i, (row_label, opts) in enumerate(zip(row_labels, options)):
            row, bad, noted = fast[i][0][2] if i in fast else \
                self._outcome(opts, [(after, differs) for after, differs, _ in full[i]])
            if noted is not None:
                self.boundary.note(row_label, opts[noted], row[noted], self._alone[opts[noted]], self.tokenizer)
            if bad is None:
                results.append((row, None))
            else:
                results.append((None, f"{name(bad, opts[bad])} adds no token after the prompt: tokenized with the "
                                      "prompt it merges into the prompt's last token(s); end the prompt before its "
                                      "trailing space or punctuation and start the options with it"))
        return results

    def _outcome(self, opts: Sequence[str], found: Sequence[tuple[list[int], bool]]
                 ) -> tuple[list[list[int]], int | None, int | None]:
        """A row's options from (tokens after the prompt, whether the joined text starts with
        other tokens than the prompt's) per option: (the options' tokens up to the first that adds
        no token, that option's index or None, the index of the first option before it to note in
        the boundary report or None)."""
        alone = self.alone(opts)
        row: list[list[int]] = []
        noted = None
        for index, (after, differs) in enumerate(found):
            if not after:
                return row, index, noted
            if noted is None and (after != list(alone[index]) or differs):
                noted = index
            row.append(after)
        return row, None, noted

    def _to_check(self, entry) -> bool:
        """Whether a row of this tail is also encoded in full (the first rows of each tail)."""
        if entry.checked >= self.CHECK_ROWS or self._checked >= self.CHECK_BUDGET:
            return False
        entry.checked += 1
        self._checked += 1
        return True

    def _from_tails(self, texts, prompt_tokens, options, pieces, cuts) -> dict[int, tuple[tuple, Any, int]]:
        """{row: ((its options' TailOptions, the crossing texts, its `_outcome`), its Tail, k)} for
        the rows whose options follow their prompt's tail alone (prepare/tail_tokens.py); other
        rows are left out. Rows of one tail and one list of options share one outcome."""
        wanted: dict[str, set[str]] = {}
        rows = []
        for i, cut in enumerate(cuts):
            if cut is None or (pieces is not None and pieces[i] is not None):
                continue
            tail = texts[i][cut[1]:]
            wanted.setdefault(tail, set()).update(options[i])
            rows.append((i, cut[0], cut[1], tail))
        self.tails.fill(wanted)
        ascii_cut = self.tails.rule.ascii_cut
        fast = {}
        for i, k, c, tail in rows:
            if ascii_cut and not tail[:1].isascii():  # a normalized text is cut before ASCII only
                continue
            entry = self.tails.tails[tail]
            if prompt_tokens[i][k:] != entry.ids:  # the prompt's own end is not the tail alone
                continue
            key = tuple(options[i])
            combo = entry.combos.get(key)
            if combo is None:
                pairs = [entry.options[option] for option in key]
                combo = entry.combos[key] = (pairs, tuple(x for pair in pairs for x in pair.crossing),
                                             self._outcome(key, [(pair.after, not pair.same_start) for pair in pairs]))
            if combo[1] and any(texts[i].endswith(x, 0, c) for x in combo[1]):
                continue
            fast[i] = (combo, entry, k)
        return fast

    def _full(self, texts, prompt_tokens, options, chat, pieces, rows: Sequence[int]) -> dict[int, list]:
        """{row: [(option tokens after the prompt, whether the joined text starts with other
        tokens than the prompt's own, the joined text's tokens)]} for `rows`: prompt + option
        tokenized as one text."""
        contexts = {}  # (text the options follow, its tokens, add_special, split_special)
        for i in rows:
            piece = pieces[i] if pieces is not None else None
            if piece is None:
                contexts[i] = (texts[i], prompt_tokens[i], not (chat[i] if chat is not None else True), False)
            else:
                contexts[i] = (piece[0], self.tokenizer(piece[0], add_special_tokens=False,
                                                        split_special_tokens=piece[1])["input_ids"], False, piece[1])
        joined = [(i, contexts[i][0] + option, contexts[i][2], contexts[i][3]) for i in rows for option in options[i]]
        encoded: list = [None] * len(joined)
        for flags in {(add, split) for _, _, add, split in joined}:
            at = [j for j, (_, _, add, split) in enumerate(joined) if (add, split) == flags]
            ids = self.tokenizer([joined[j][1] for j in at], add_special_tokens=flags[0],
                                 split_special_tokens=flags[1])["input_ids"]
            for j, tokens in zip(at, ids):
                encoded[j] = tokens
        result: dict[int, list] = {i: [] for i in rows}
        for (i, _, _, _), whole in zip(joined, encoded):
            tokens = contexts[i][1]
            n = len(tokens)
            result[i].append((list(whole[n:]), list(whole[:n]) != list(tokens), whole))
        return result


def max_length_name(configured: int | None, max_length: int | None) -> str:
    """Whose limit `max_length` (the longest prompt scored) is, for messages: the job's
    engine.max_length when it set that limit, else the model's context."""
    return "engine.max_length" if configured is not None and configured == max_length else "the model's context"


def option_length_problem(options: OptionTokens, texts: Sequence[str], prompt_len: int,
                          max_length: int | None, limit_name: str = "the model's context",
                          name=lambda index, text: f"option {index} {_short(text)}") -> str | None:
    """Why the longest option does not fit after a `prompt_len`-token prompt, or None.

    Scoring an option of n tokens takes in the prompt and the option's first n - 1 tokens.
    """
    if max_length is None or prompt_len + len(options.tokens) - 1 <= max_length:  # (every option fits: no numpy)
        return None
    needed = prompt_len + options.lengths - 1
    over = np.flatnonzero(needed > max_length)
    if not len(over):
        return None
    index = int(over[0])
    return (f"{name(index, texts[index])} is {int(options.lengths[index])} tokens: with the {prompt_len}-token "
            f"prompt that is {int(needed[index])} tokens, longer than the maximum {max_length} ({limit_name})")


# ---------------------------------------------------------------------------- rows -> options


class RowOptionSource:
    """Each input row's options as token ids (or why the row cannot be scored).

    labels: the job's fixed labels, or None with `choices_column`. `encoder` tokenizes; prompts
    that are text are passed per batch (`texts`), pre-tokenized prompts are not (options are then
    tokenized alone, or given as token ids: `token_choices_problem`). `max_length`: the longest
    sequence the engine takes in; `vocab_size`: the model's, which options given as ids must fit.
    """

    def __init__(self, labels: Sequence[str] | None, choices_column: str | None, encoder: OptionEncoder,
                 max_length: int | None = None, limit_name: str = "the model's context",
                 vocab_size: int | None = None) -> None:
        self.labels = list(labels) if labels else None
        self.choices_column = choices_column
        self.encoder = encoder
        self.max_length = max_length
        self.limit_name = limit_name
        self.vocab_size = vocab_size

    def batch(self, prompt_tokens: Sequence, texts: Sequence[str | None] | None, choices: Sequence | None,
              where: Sequence[str], chat: Sequence[bool] | None = None,
              pieces: Sequence[tuple[str, bool] | None] | None = None,
              cuts: Sequence[tuple[int, int] | None] | None = None) -> list[tuple[OptionTokens | None, str | None]]:
        """For every row of a batch with prompt tokens (None: the row has an error already),
        (its options, None) or (None, the row's error message, starting with `where[i]`).
        texts / chat / pieces / cuts: the rows' prompt texts, whether each holds a chat template's
        tokens, for prompts tokenized piece by piece the last piece, and the prompts' cuts (see
        `OptionEncoder.after_prompts`); texts None: pre-tokenized prompts, options are tokenized alone."""
        results: list[tuple[OptionTokens | None, str | None]] = [(None, None)] * len(prompt_tokens)
        todo, option_texts = [], []
        for i, tokens in enumerate(prompt_tokens):
            if tokens is None:
                continue
            if self.labels is not None:
                opts = self.labels
            elif texts is None and holds_token_lists(choices[i]):
                results[i] = self._given_tokens(choices[i], len(tokens), where[i])
                continue
            else:
                opts, problem = choices_problem(choices[i])
                if problem:
                    results[i] = (None, f"{where[i]}: field {self.choices_column!r} {problem}")
                    continue
            todo.append(i)
            option_texts.append(opts)
        if texts is not None:
            row_texts = [texts[i] for i in todo]
            row_pieces = [pieces[i] for i in todo] if pieces is not None else None
            if self.labels is None:  # options from the data: their special-token text stays text
                row_pieces = self.encoder.data_option_pieces(row_texts, option_texts, row_pieces)
            encoded = self.encoder.after_prompts(row_texts, [prompt_tokens[i] for i in todo],
                                                 option_texts, [where[i] for i in todo], self._name,
                                                 [chat[i] for i in todo] if chat is not None else None,
                                                 row_pieces, [cuts[i] for i in todo] if cuts is not None else None)
        else:
            encoded = [self._alone(opts) for opts in option_texts]
        for i, opts, (token_lists, problem) in zip(todo, option_texts, encoded):
            options = None if problem else self.encoder.intern(token_lists)
            problem = problem or option_length_problem(options, opts, len(prompt_tokens[i]), self.max_length,
                                                       self.limit_name, self._name)
            results[i] = (None, f"{where[i]}: {problem}") if problem else (options, None)
        return results

    def _given_tokens(self, value, prompt_len: int, where: str) -> tuple[OptionTokens | None, str | None]:
        """A pre-tokenized row's options given as token ids (or the row's error)."""
        token_lists, problem = token_choices_problem(value, self.vocab_size)
        if problem:
            return None, f"{where}: field {self.choices_column!r} {problem}"
        options = self.encoder.intern(token_lists)
        problem = option_length_problem(options, [json.dumps(t) for t in token_lists], prompt_len, self.max_length,
                                        self.limit_name, self._name)
        return (None, f"{where}: {problem}") if problem else (options, None)

    def _alone(self, opts: Sequence[str]) -> tuple[list[list[int]] | None, str | None]:
        token_lists = self.encoder.alone(opts, split=self.labels is None)
        empty = [i for i, tokens in enumerate(token_lists) if not tokens]
        if empty:
            return None, f"{self._name(empty[0], opts[empty[0]])} has no tokens"
        return token_lists, None

    def _name(self, index: int, text: str) -> str:
        """How messages name an option: `label 'Yes'`, or `field 'choices' option 2 'Paris'`."""
        if self.labels is not None:
            return f"label {_short(text)}"
        return f"field {self.choices_column!r} option {index} {_short(text)}"

    def single_token_ids(self, requests) -> list[int] | None:
        """The label token ids when every request has the same one-token labels (the one-position
        path), else None (every request is scored over its own options)."""
        if self.labels is None or not requests:
            return None
        first = requests[0].options
        if first is None or not first.single_token or any(r.options is not first for r in requests):
            return None
        return [int(t) for t in first.tokens]
