"""Document-QA workloads of real text with a known answer (speculative-prefill benchmark).

A document is a run of real English sentences (`haystack.py`, from the Python Language
Reference) with facts inserted at random depths: "The kayak of Li Wei is green." The prompt asks
about one fact and ends where the answer word comes next, so the label set (six colors, one
token each with a leading space) holds the ground truth:

    <document>

    Question: What color is the kayak of Li Wei?
    Answer: The kayak of Li Wei is

Two shapes:
  distinct  one document per row (1,500-2,000 prompt tokens by default), one fact, one question:
            long distinct prompts, nothing shared;
  shared    one document per group with one fact per member (`questions` facts), each member
            asking about its own: a long shared prefix (the document and "Question: What color
            is the") and short distinct suffixes.
Seeded and deterministic for a given tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchscore.bench.haystack import SENTENCES

COLORS = ("red", "blue", "green", "yellow", "black", "white")
NAMES = ("Maria Lopez", "Tom Becker", "Anna Schmidt", "Li Wei", "Omar Haddad", "Sara Novak", "Ivan Petrov",
         "Grace Okafor", "Lena Fischer", "Raj Patel", "Yuki Tanaka", "Carlos Mendes")
OBJECTS = ("locker", "bicycle", "umbrella", "front door", "kayak", "mailbox", "scarf", "tent", "teapot", "backpack")


@dataclass
class DocQAItem:
    """One prompt, the index of its right label, and the document (group) it belongs to."""

    text: str
    answer: int
    document: int


def label_words() -> list[str]:
    """The labels: each color with a leading space (the word that follows "... is")."""
    return [f" {color}" for color in COLORS]


def _document(rng: np.random.Generator, tokenizer, target_tokens: int, facts: list[str]) -> str:
    """Sentences drawn without repetition until about `target_tokens` tokens, `facts` inserted."""
    order = rng.permutation(len(SENTENCES))
    sentences, tokens = [], sum(len(tokenizer.encode(" " + f, add_special_tokens=False)) for f in facts)
    for index in order:
        if tokens >= target_tokens:
            break
        sentence = SENTENCES[int(index)]
        sentences.append(sentence)
        tokens += len(tokenizer.encode(" " + sentence, add_special_tokens=False))
    for fact in facts:
        sentences.insert(int(rng.integers(0, len(sentences) + 1)), fact)
    return " ".join(sentences)


def _question(obj: str, name: str) -> str:
    return f"\n\nQuestion: What color is the {obj} of {name}?\nAnswer: The {obj} of {name} is"


def distinct_documents(tokenizer, count: int, min_tokens: int = 1500, max_tokens: int = 2000,
                       seed: int = 0) -> list[DocQAItem]:
    """`count` prompts of min_tokens..max_tokens tokens, each its own document with one fact."""
    rng = np.random.default_rng(seed)
    items = []
    for document in range(count):
        name, obj = NAMES[int(rng.integers(len(NAMES)))], OBJECTS[int(rng.integers(len(OBJECTS)))]
        answer = int(rng.integers(len(COLORS)))
        question = _question(obj, name)
        room = int(rng.integers(min_tokens, max_tokens + 1)) - len(tokenizer.encode(question, add_special_tokens=False)) - 24
        text = _document(rng, tokenizer, room, [f"The {obj} of {name} is {COLORS[answer]}."]) + question
        items.append(DocQAItem(text, answer, document))
    return items


def shared_documents(tokenizer, documents: int, questions: int, min_tokens: int = 1500, max_tokens: int = 2000,
                     seed: int = 1) -> list[DocQAItem]:
    """`documents` documents with `questions` facts each (distinct objects and names), one
    member per fact asking about it."""
    if questions > min(len(NAMES), len(OBJECTS)):
        raise ValueError(f"at most {min(len(NAMES), len(OBJECTS))} questions per document")
    rng = np.random.default_rng(seed)
    items = []
    for document in range(documents):
        names = [NAMES[int(i)] for i in rng.choice(len(NAMES), questions, replace=False)]
        objects = [OBJECTS[int(i)] for i in rng.choice(len(OBJECTS), questions, replace=False)]
        answers = [int(a) for a in rng.integers(0, len(COLORS), questions)]
        facts = [f"The {o} of {n} is {COLORS[a]}." for o, n, a in zip(objects, names, answers)]
        room = int(rng.integers(min_tokens, max_tokens + 1)) - 24 - 16
        body = _document(rng, tokenizer, room, facts)
        for obj, name, answer in zip(objects, names, answers):
            items.append(DocQAItem(body + _question(obj, name), answer, document))
    return items
