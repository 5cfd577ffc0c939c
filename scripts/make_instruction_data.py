"""Write the instruction set shipped with the package: small chat tasks with exact answers, and a held-out split.

    .venv/bin/python scripts/make_instruction_data.py   # rewrites nemo_noise_plugin/data/instructions/*.jsonl

Deterministic (seeded): running it again gives the same files. Tasks: addition, subtraction, unit conversions,
letter counts, upper-casing, first letters and number successors. Every answer is one short exact string.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "apple banana cherry garden river mountain window pencil rocket planet silver orange tiger dragon castle "
    "forest bridge candle mirror pocket rabbit summer winter violet yellow marble ladder cotton butter island "
    "jacket kitten lemon meadow needle ocean pepper quartz saddle tunnel velvet wagon zebra anchor basket "
    "cactus dolphin engine falcon glacier harbor igloo jungle koala lantern magnet nectar oyster parrot"
).split()
SYSTEM = "Reply with the exact answer only."
OUT = Path(__file__).resolve().parent.parent / "nemo_noise_plugin" / "data" / "instructions"


def tasks(rng: random.Random):
    """One (task, question, answer) per call of each generator, drawn from ``rng``."""
    a, b = rng.randint(10, 89), rng.randint(10, 89)
    yield "add", f"What is {a} + {b}?", str(a + b)
    a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
    yield "subtract", f"What is {a} - {b}?", str(a - b)
    hours = rng.randint(2, 12)
    yield "convert", f"How many minutes are in {hours} hours?", str(60 * hours)
    km = rng.randint(2, 19)
    yield "convert", f"How many metres are in {km} kilometres?", str(1000 * km)
    word = rng.choice(WORDS)
    yield "count", f"How many letters are in the word '{word}'?", str(len(word))
    word = rng.choice(WORDS)
    yield "upper", f"Write the word '{word}' in capital letters.", word.upper()
    word = rng.choice(WORDS)
    yield "first", f"What is the first letter of the word '{word}'?", word[0]
    n = rng.randint(10, 998)
    yield "next", f"What number comes after {n}?", str(n + 1)


def main() -> None:
    rng = random.Random(20261201)
    seen: set[str] = set()
    examples = []
    while len(examples) < 400:
        for task, question, answer in tasks(rng):
            if question in seen:
                continue
            seen.add(question)
            examples.append({"task": task, "question": question, "answer": answer})
    rng.shuffle(examples)
    splits = {"training": examples[:320], "validation": examples[320:400]}
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        with open(OUT / f"{name}.jsonl", "w") as handle:
            for row in rows:
                messages = [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": row["question"]},
                    {"role": "assistant", "content": row["answer"]},
                ]
                handle.write(json.dumps({"messages": messages, "task": row["task"]}) + "\n")
        print(f"{name}: {len(rows)} examples -> {OUT / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
