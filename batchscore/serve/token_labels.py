"""A chat request's own labels given as token ids (`logprob_token_ids`, as vLLM takes them):
each id read back as the text of that one token, with the served model's tokenizer."""

from __future__ import annotations

import threading


class TokenLabels:
    """`labels(ids) -> (texts, None) | (None, why not)`; the tokenizer loads on first use."""

    def __init__(self, model: str):
        self.model = model
        self._tokenizer = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                from batchscore.models import resolve_model

                self._tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(self.model)))
        return self._tokenizer

    def __call__(self, ids: list[int]) -> tuple[list[str] | None, str | None]:
        tokenizer = self.tokenizer()
        texts = []
        for token_id in ids:
            if token_id >= len(tokenizer):
                return None, f"token id {token_id} is not in the model's vocabulary ({len(tokenizer)} tokens)"
            text = tokenizer.decode([token_id])
            # a label is text: only an id that is that text's one token can be scored as asked
            if not text or tokenizer.encode(text, add_special_tokens=False) != [token_id]:
                return None, f"token id {token_id} ({text!r}) does not read back as that one token"
            texts.append(text)
        if len(set(texts)) != len(texts):
            return None, f"token ids {ids} read as repeated texts {texts}"
        return texts, None
