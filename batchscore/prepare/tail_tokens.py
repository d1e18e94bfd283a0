"""Options after a prompt without tokenizing the prompt again, and the tokenizer's batch call
without the transformers wrapper.

An option's tokens are those that follow the prompt's own when prompt + option is tokenized as
one text (prepare/options.py). For the tokenizers `tail_rule` accepts, that is exactly

    tokens(prompt + option) = prompt_tokens[:k] + tokens(prompt[c:] + option)

with c the start of the prompt's second-to-last pre-token and k its first token. Why:
- Added tokens are split out first as exact strings (none strips spaces or is normalized), the
  rest is cut into pre-tokens by one known regex (GPT-2's, Llama 3's, Qwen2's) and BPE runs on
  each pre-token alone: no token crosses a pre-token boundary. The post-processor only puts
  special tokens (BOS) in front, which prompt_tokens[:k] holds. The normalizer is none or NFC;
  with NFC the character at c must be ASCII: NFC never composes an ASCII character with what is
  before it, and a starter blocks marks after it, so NFC(text) = NFC(text[:c]) + NFC(text[c:]).
- These regexes have no look-behind or anchor: matching from c on ignores the text before c. A
  match at p depends only on the characters the engine reads from p, and in these patterns a read
  that reaches the prompt's end L covers one run (letters, digits, whitespace, punctuation then
  newlines, or at most 3 characters), which the prompt alone splits into at most 2 pre-tokens.
  Every pre-token before c has at least 2 after it, so its match reads only text before L: it is
  the same in prompt + option.
- An added token that the option would complete across c is ruled out per row (`crossing`), and
  a row whose tail does not tokenize as the prompt's last k.. tokens takes the full encode.
The tail is the same text for every prompt that ends with the same words ("...\nAnswer:"), so its
encode with each option is cached: the options of such rows cost no tokenizing. Options still
check the first rows of each tail against the full encode (OptionEncoder).
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

log = logging.getLogger("batchscore")

# The pre-tokenizer regexes the argument above was checked for (tokenizers' own spellings).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                  r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                 r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
KNOWN_SPLITS = (GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN)


# ---------------------------------------------------------------------------- the batch call


def backend_of(tokenizer):
    """The `tokenizers.Tokenizer` that `tokenizer(texts)` runs, when calling its `encode_batch`
    directly gives the same ids (transformers' TokenizersBackend, whose call only sets the
    special-token splitting and turns off truncation and padding); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode_plus = getattr(type(tokenizer), "_encode_plus", None)
    if backend is None or getattr(encode_plus, "__qualname__", "") != "TokenizersBackend._encode_plus":
        return None
    return backend


def encode_batch(tokenizer, texts: Sequence[str], add_special_tokens: bool, split_special_tokens: bool | None = None,
                 backend=None) -> list | None:
    """`tokenizer(texts, ...)`'s encodings (`.ids`, `.word_ids`...) straight from its backend
    (`backend`: that backend or a copy of it that differs in offsets only), or None where the
    wrapper must run (truncation or padding set on the backend)."""
    own = backend_of(tokenizer)
    if own is None or own.truncation is not None or own.padding is not None:
        return None
    backend = backend or own
    split = tokenizer.split_special_tokens if split_special_tokens is None else split_special_tokens
    if backend.encode_special_tokens != split:
        backend.encode_special_tokens = split
    return backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)


def encode_ids(tokenizer, texts: Sequence[str], add_special_tokens: bool,
               split_special_tokens: bool | None = None) -> list[list[int]]:
    """`tokenizer(texts, ...)["input_ids"]`, without the wrapper's per-text conversion where it can."""
    encodings = encode_batch(tokenizer, texts, add_special_tokens, split_special_tokens) if texts else []
    if encodings is None:
        kwargs = {} if split_special_tokens is None else {"split_special_tokens": split_special_tokens}
        return tokenizer(list(texts), add_special_tokens=add_special_tokens, **kwargs)["input_ids"]
    return [encoding.ids for encoding in encodings]


# ---------------------------------------------------------------------------- which tokenizers


@dataclass(frozen=True)
class TailRule:
    """A tokenizer the tail argument holds for: its backend (a copy with untrimmed offsets when
    the original trims them) and the texts of its added tokens."""

    backend: Any
    added: tuple[str, ...]
    ascii_cut: bool = False  # the text is normalized (NFC): cut only before an ASCII character
    inner: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)  # char -> (token, i): token[i] == char, i >= 1

    def __post_init__(self) -> None:
        inner: dict[str, list[tuple[str, int]]] = {}
        for token in self.added:
            for i in range(1, len(token)):
                inner.setdefault(token[i], []).append((token, i))
        self.inner.update({char: tuple(places) for char, places in inner.items()})


_RULES: "weakref.WeakKeyDictionary[Any, TailRule | None]" = weakref.WeakKeyDictionary()


def tail_rule(tokenizer) -> TailRule | None:
    """The TailRule of `tokenizer`, or None when the argument is not known to hold for it
    (options then take the full encode). Decided once per tokenizer."""
    try:
        return _RULES[tokenizer]
    except (KeyError, TypeError):
        pass
    rule = None
    backend = backend_of(tokenizer)
    if backend is not None:
        spec = json.loads(backend.to_str())
        why = why_not_tail(spec)
        if why is None:
            rule = TailRule(_untrimmed(backend, spec), tuple(t["content"] for t in spec.get("added_tokens") or ()),
                            spec.get("normalizer") is not None)
        else:
            log.debug("options take the full encode: %s", why)
    try:
        _RULES[tokenizer] = rule
    except TypeError:
        pass
    return rule


def why_not_tail(spec: dict) -> str | None:
    """Why a tokenizer (its tokenizer.json as a dict) is outside the argument, or None."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"a {normalizer.get('type')} normalizer"
    if normalizer is not None and any(t.get("normalized") for t in spec.get("added_tokens") or ()):
        return "added tokens matched after the normalizer"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return f"a {model.get('type')} model" + (" with dropout" if model.get("dropout") else "")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if [s.get("type") for s in steps] == ["ByteLevel"]:
        if steps[0].get("add_prefix_space") or not steps[0].get("use_regex", True):
            return "a ByteLevel pre-tokenizer that adds a prefix space or splits nothing"
    elif [s.get("type") for s in steps] == ["Split", "ByteLevel"]:
        split, byte_level = steps
        if (split.get("pattern") or {}).get("Regex") not in KNOWN_SPLITS or split.get("behavior") != "Isolated" \
                or split.get("invert") or byte_level.get("add_prefix_space") or byte_level.get("use_regex", True):
            return "a Split pre-tokenizer with a pattern or behaviour the argument was not checked for"
    else:
        return f"a pre-tokenizer {[s.get('type') for s in steps]}"
    for token in spec.get("added_tokens") or ():
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return f"the added token {token.get('content')!r} takes in the spaces beside it"
    post = spec.get("post_processor")
    posts = [] if post is None else post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for step in posts:
        if step.get("type") == "ByteLevel":
            continue
        single = step.get("single") if step.get("type") == "TemplateProcessing" else None
        if not single or "Sequence" not in single[-1] or any("Sequence" in piece for piece in single[:-1]):
            return f"a {step.get('type')} post-processor (special tokens after the text?)"
    return None


def _untrimmed(backend, spec: dict):
    """`backend`, or a copy whose ByteLevel post-processor keeps each token's whole character
    span (trimming moves a token's start past its leading space; the ids are the same)."""
    post = spec.get("post_processor")
    posts = [] if post is None else post.get("processors", []) if post.get("type") == "Sequence" else [post]
    trims = [step for step in posts if step.get("type") == "ByteLevel" and step.get("trim_offsets")]
    if not trims:
        return backend
    from tokenizers import Tokenizer

    for step in trims:
        step["trim_offsets"] = False
    return Tokenizer.from_str(json.dumps(spec))


def cut_of(encoding) -> tuple[int, int] | None:
    """(k, c): the first token and the first character of the prompt's second-to-last pre-token
    (an added token counts as one), or None for a prompt of fewer than two."""
    n = len(encoding)
    last = encoding.token_to_word(n - 1) if n else None
    if last is None or last < 1:
        return None
    tokens, chars = encoding.word_to_tokens(last - 1), encoding.word_to_chars(last - 1)
    if tokens is None or chars is None:
        return None
    return tokens[0], chars[0]


# ---------------------------------------------------------------------------- the cache


@dataclass
class Tail:
    """One prompt tail: its own tokens, and per option what tail + option gives."""

    ids: list[int]
    options: dict[str, "TailOption"] = field(default_factory=dict)
    combos: dict[tuple[str, ...], tuple] = field(default_factory=dict)  # OptionEncoder's, per list of options
    checked: int = 0  # rows of this tail checked against the full encode


@dataclass(frozen=True)
class TailOption:
    """encode(tail + option) (`tokens`) cut after the tail's own tokens: `after` (the option's
    tokens), `same_start` (the first tokens are the tail's own), `crossing`: texts that, ending
    the prompt before the tail, would form an added token with the tail + option (such rows take
    the full encode)."""

    tokens: list[int]
    after: list[int]
    same_start: bool
    crossing: tuple[str, ...]


class TailCache:
    """encode(tail + option) per distinct prompt tail, filled a batch at a time."""

    def __init__(self, tokenizer, rule: TailRule, limit: int = 65536) -> None:
        self.tokenizer = tokenizer
        self.rule = rule
        self.limit = limit  # tails, options and lists of options kept: prompts that end in their own
        self.tails: dict[str, Tail] = {}  # data, or rows with their own options, do not repeat

    def fill(self, wanted: dict[str, set[str]]) -> None:
        """Encode every tail and (tail, option) of `wanted` ({tail: options}) not cached yet."""
        if len(wanted) + sum(1 + len(e.options) + len(e.combos) for e in self.tails.values()) > self.limit:
            self.tails = {}
        new_tails = [tail for tail in wanted if tail not in self.tails]
        pairs = [(tail, option) for tail, options in wanted.items() for option in options
                 if tail not in self.tails or option not in self.tails[tail].options]
        texts = new_tails + [tail + option for tail, option in pairs]
        if not texts:
            return
        ids = [e.ids for e in encode_batch(self.tokenizer, texts, False, False, self.rule.backend)]
        for tail, tokens in zip(new_tails, ids):
            self.tails[tail] = Tail(tokens)
        for (tail, option), tokens in zip(pairs, ids[len(new_tails):]):
            entry = self.tails[tail]
            n = len(entry.ids)
            entry.options[option] = TailOption(tokens, tokens[n:], tokens[:n] == entry.ids,
                                               self._crossing(tail + option))

    def _crossing(self, text: str) -> tuple[str, ...]:
        """The starts x of added tokens x + y with y a start of `text` (both non-empty)."""
        return tuple(token[:i] for token, i in self.rule.inner.get(text[:1], ()) if text.startswith(token[i:]))
