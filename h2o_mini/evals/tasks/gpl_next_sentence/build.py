"""Builds gpl_next_sentence.jsonl: a next-sentence choice task made from the GPL-3 text.

Each item is one sentence of the licence (the context) and four candidate continuations: the sentence
that really follows it and three other sentences of the same text, in a seeded random order. A model
that reads English picks the true continuation far more often than the 25% of chance.

    python h2o_mini/evals/tasks/gpl_next_sentence/build.py [/usr/share/common-licenses/GPL-3]
"""
import json
import random
import re
import sys
from pathlib import Path

N_ITEMS, N_CHOICES, SEED = 100, 4, 0


def sentences(text: str) -> list[str]:
    flat = " ".join(text.split())
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+(?=[A-Z])", flat) if 6 <= len(s.split()) <= 40]


def build(text: str) -> list[dict]:
    rng = random.Random(SEED)
    sents = sentences(text)
    pairs = [(a, b) for a, b in zip(sents, sents[1:])]
    items = []
    for i in sorted(rng.sample(range(len(pairs)), N_ITEMS)):
        context, truth = pairs[i]
        others = rng.sample([s for s in sents if s not in (context, truth)], N_CHOICES - 1)
        choices = others + [truth]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "gold": choices.index(truth)})
    return items


if __name__ == "__main__":
    source = Path(sys.argv[1] if len(sys.argv) > 1 else "/usr/share/common-licenses/GPL-3")
    out = Path(__file__).with_name("gpl_next_sentence.jsonl")
    out.write_text("".join(json.dumps(item) + "\n" for item in build(source.read_text())))
    print(f"{out}: {N_ITEMS} items from {source}")
