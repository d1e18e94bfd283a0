"""lm-eval tasks that read only local files, made here: for the tests, the docs and `bench lm-eval`.

- `batchscore_mc`: multiple choice, 4 choices per question, 5-shot with the same preamble for
  every question (`sampler: first_n`, as MMLU's tasks do): arithmetic and ordering questions made
  from a seeded generator. Metrics acc and acc_norm.
- `batchscore_ppl`: perplexity (`loglikelihood_rolling`) of short made-up reports. Metrics
  word_perplexity, byte_perplexity, bits_per_byte.
- `batchscore_gen`: a generation task (`generate_until`), which the batchscore backend refuses.

lm-eval reads `dataset_path: json` with `data_files`; the YAML files name the data by absolute
path, so they are written per machine: `batchscore eval-tasks DIR`, then `--include_path DIR`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

FEWSHOT = 5
CITIES = ["Oslo", "Lima", "Cairo", "Perth", "Quito", "Osaka", "Porto", "Dakar", "Hanoi", "Tunis"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
THINGS = ["the river", "the market", "the harbour", "the old bridge", "the library", "the station"]


def _arithmetic(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    op = rng.choice(["+", "-", "*"])
    value = a + b if op == "+" else a - b if op == "-" else a * b
    wrong = set()
    while len(wrong) < 3:
        candidate = value + rng.choice([-10, -2, -1, 1, 2, 10, rng.randint(-30, 30)])
        if candidate != value:
            wrong.add(candidate)
    choices = [str(value), *map(str, sorted(wrong))]
    rng.shuffle(choices)
    return f"What is {a} {op} {b}?", choices, choices.index(str(value))


def _ordering(rng: random.Random) -> tuple[str, list[str], int]:
    day = rng.randrange(7)
    ahead = rng.randint(1, 3)
    answer = DAYS[(day + ahead) % 7]
    others = [d for d in DAYS if d != answer]
    choices = [answer, *rng.sample(others, 3)]
    rng.shuffle(choices)
    return f"Which day comes {ahead} day{'s' if ahead > 1 else ''} after {DAYS[day]}?", choices, choices.index(answer)


def mc_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        question, choices, answer = (_arithmetic if rng.random() < 0.6 else _ordering)(rng)
        rows.append({"question": question, "choices": choices, "answer": answer})
    return rows


def ppl_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        sentences = []
        for _ in range(rng.randint(3, 9)):
            city, day, thing = rng.choice(CITIES), rng.choice(DAYS), rng.choice(THINGS)
            sentences.append(rng.choice([
                f"On {day} the temperature in {city} rose to {rng.randint(-5, 35)} degrees.",
                f"Crowds gathered near {thing} in {city} after {rng.randint(2, 90)} boats came in.",
                f"The council of {city} met on {day} and voted {rng.randint(3, 9)} to {rng.randint(0, 3)}.",
                f"Rain closed {thing} for {rng.randint(1, 12)} hours, and trains to {rng.choice(CITIES)} ran late.",
            ]))
        rows.append({"text": " ".join(sentences)})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_sample_tasks(folder: str | Path, questions: int = 250, documents: int = 40) -> list[Path]:
    """Write the sample tasks' data and YAML files to `folder`; returns the YAML paths."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    _write_jsonl(folder / "mc_train.jsonl", mc_rows(FEWSHOT, seed=1))
    _write_jsonl(folder / "mc_test.jsonl", mc_rows(questions, seed=2))
    _write_jsonl(folder / "ppl_test.jsonl", ppl_rows(documents, seed=3))
    data = lambda **files: json.dumps({"data_files": {k: str(folder / v) for k, v in files.items()}})  # noqa: E731
    tasks = {
        "batchscore_mc.yaml": f"""task: batchscore_mc
dataset_path: json
dataset_kwargs: {data(train="mc_train.jsonl", test="mc_test.jsonl")}
output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
num_fewshot: {FEWSHOT}
fewshot_config:
  sampler: first_n
description: "Answer each question.\\n\\n"
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
""",
        "batchscore_ppl.yaml": f"""task: batchscore_ppl
dataset_path: json
dataset_kwargs: {data(test="ppl_test.jsonl")}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""",
        "batchscore_gen.yaml": f"""task: batchscore_gen
dataset_path: json
dataset_kwargs: {data(test="mc_test.jsonl")}
output_type: generate_until
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
""",
    }
    paths = []
    for name, text in tasks.items():
        (folder / name).write_text(text)
        paths.append(folder / name)
    return paths
