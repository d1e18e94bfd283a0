"""One registry shape for every variant (engine kinds, wire formats): built-in entries first, in
their modules' order, whichever module was imported first; then the others as they registered."""

import subprocess
import sys
from dataclasses import dataclass

from batchscore.registry import Registry


@dataclass(frozen=True)
class Entry:
    name: str
    module: str


def test_built_in_entries_come_first_in_their_modules_order():
    registry = Registry(("json", "csv"), lambda entry: entry.module)  # importing them registers nothing
    for entry in (Entry("toy", "tests"), Entry("c", "csv"), Entry("j", "json"), Entry("later", "tests")):
        registry.register(entry)
    assert list(registry.entries()) == ["j", "c", "toy", "later"]
    registry.register(Entry("c", "csv"))  # replacing keeps the entry's place
    assert list(registry.entries()) == ["j", "c", "toy", "later"]
    registry.unregister("toy")
    assert list(registry.entries()) == ["j", "c", "later"] and registry.get("toy") is None


def test_engine_kinds_keep_their_order_whichever_kind_is_imported_first():
    code = ("import batchscore.engines.vllm.kind, batchscore.formats.openai_batch\n"
            "from batchscore.engines.registry import kind_names\n"
            "from batchscore.formats.registry import output_names\n"
            "print(kind_names(), output_names())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "('torch', 'vllm', 'auto') ('auto', 'parquet', 'jsonl', 'openai_batch')"
