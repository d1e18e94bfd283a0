"""Templates render only plain column fields; labels must be single, distinct tokens."""

import pytest

from batchscore.errors import LabelError, PromptTemplateError
from batchscore.prepare.prompts import (PromptRenderer, label_token_ids,
                                parse_template)


def test_render_fills_columns_and_keeps_escaped_braces():
    template = parse_template("Q: {query} {{literal}} P: {title}")
    assert template.columns == ["query", "title"]
    assert template.render({"query": "boots", "title": "T", "other": 1}) == "Q: boots {literal} P: T"


@pytest.mark.parametrize("bad", ["{a.__class__}", "{a[0]}", "{a!s}", "{a:10}", "{0}x{", "{}"])
def test_unsafe_or_malformed_templates_are_refused(bad):
    with pytest.raises(PromptTemplateError):
        parse_template(bad)


def test_null_field_raises_keyerror_naming_it():
    with pytest.raises(KeyError, match="query"):
        parse_template("{query}").render({"query": None})


def test_labels_are_single_tokens(tokenizer):
    ids = label_token_ids(tokenizer, ["Yes", "No"])
    assert len(ids) == 2 and ids[0] != ids[1]
    with pytest.raises(LabelError, match="not one"):
        label_token_ids(tokenizer, ["Absolutely", "Nope, never"])


def test_chat_rendering_uses_the_models_template(tokenizer):
    renderer = PromptRenderer(tokenizer, "Is {x} blue?", system="Be brief.", chat=True)
    text = renderer.text({"x": "the sky"})
    assert "<|im_start|>system\nBe brief." in text
    assert text.rstrip().endswith("<|im_start|>assistant")
    tokens = renderer.encode([text])[0]
    assert tokenizer.decode(tokens) == text
