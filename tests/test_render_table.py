"""`PromptRenderer.render_table` (a batch rendered by Arrow's string kernels) equals `prompt`
row by row: texts and data spans; rows with a null field, and tables it cannot take, are left
to `prompt`."""

from __future__ import annotations

import pyarrow as pa

from batchscore.prepare.prompts import PromptRenderer, RequestRenderer


def test_render_table_equals_prompt_row_by_row(tokenizer):
    table = pa.table({"q": ["Is it?", "", "é 中文 🙂 <|im_end|>", None, "x\n\ny"],
                      "doc": pa.array(["a", "b\tc", "naïve", "d", None], type=pa.large_string()),
                      "n": [1, 2, 3, 4, 5]})
    rows = table.to_pylist()
    for template, system in [("Doc: {doc}\n\nQ: {q} {doc}\nA:", None), ("{q}", "Be brief."), ("{doc}{q}", None)]:
        renderer = PromptRenderer(tokenizer, template, system=system)
        whole = renderer.render_table(table.select(renderer.columns))
        assert whole is not None
        for row, got in zip(rows, whole):
            if any(row[c] is None for c in renderer.columns):
                assert got is None  # `prompt` names the null field
            else:
                assert got == renderer.prompt(row)
    assert PromptRenderer(tokenizer, "{q} {n}").render_table(table) is None  # a number: str() is Python's
    assert PromptRenderer(tokenizer, "{q}", chat=True).render_table(table) is None
    assert PromptRenderer(tokenizer, "{missing}").render_table(table) is None
    assert PromptRenderer(tokenizer, "{{ q }}", engine="jinja").render_table(table) is None
    assert RequestRenderer(tokenizer).render_table(pa.table({"prompt": ["a"], "messages": [None]})) is None
