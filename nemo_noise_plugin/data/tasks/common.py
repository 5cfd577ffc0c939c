"""What every task family's generator shares: chat rows with private spans, unique prompts, splits, JSONL bytes.

A family generator (``sentiment_reviews``, ``support_tickets``) builds each user prompt from *parts*, each part
public or private; ``compose`` joins them and records the private parts as character spans, so the offsets are
right by construction. Rows are written in the JSONL chat format of ``data/instructions/*.jsonl`` (read by
Megatron-Bridge's ``GPTSFTChatDataset``), with ``private_spans`` as a top-level field::

    {"messages": [{"role": "system", ...}, {"role": "user", ...}, {"role": "assistant", ...}],
     "task": NAME, "private_spans": [{"message": 1, "start": a, "end": b}, ...], ...}

``start``/``end`` are character offsets into ``messages[message]["content"]`` (end exclusive); spans are only on the
user message (index 1), sorted, non-empty and never overlapping.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "SPLITS",
    "USER_MESSAGE",
    "chat_row",
    "compose",
    "draw_unique",
    "shuffled",
    "write_jsonl",
]

SPLITS = ("training", "validation", "test")
"""The shipped splits, as in ``data.instruction_set.INSTRUCTION_SPLITS``."""

USER_MESSAGE = 1
"""The index of the user message in ``messages`` (system, user, assistant): the only message spans may mark."""


def compose(parts: Iterable[tuple[str, bool]]) -> tuple[str, list[dict[str, int]]]:
    """Join ``(text, private)`` parts into one string; return it and the private parts' spans on the user message.

    >>> compose([("Customer ", False), ("Ann Lee", True), (" asks: what is 2 + 3?", False)])
    ('Customer Ann Lee asks: what is 2 + 3?', [{'message': 1, 'start': 9, 'end': 16}])
    """
    text, spans = "", []
    for part, private in parts:
        if private:
            if not part:
                raise ValueError("a private part is empty: a span must cover at least one character")
            if spans and spans[-1]["end"] == len(text):
                raise ValueError(f"private part {part!r} touches the previous one: join them into one span")
            spans.append({"message": USER_MESSAGE, "start": len(text), "end": len(text) + len(part)})
        text += part
    return text, spans


def chat_row(
    system: str, user: str, answer: str, task: str, spans: Sequence[dict[str, int]] = (), **fields: Any
) -> dict[str, Any]:
    """One JSONL row: ``messages`` (system, user, assistant), ``task``, ``private_spans``, then ``fields``."""
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer},
    ]
    return {"messages": messages, "task": task, "private_spans": list(spans), **fields}


def draw_unique(
    draw: Callable[[], dict[str, Any]], count: int, seen: set[str], *, max_tries_per_row: int = 1000
) -> list[dict[str, Any]]:
    """``count`` rows from ``draw()`` whose user prompts are not in ``seen`` (which is updated): no prompt twice."""
    rows: list[dict[str, Any]] = []
    tries = 0
    while len(rows) < count:
        row = draw()
        prompt = row["messages"][USER_MESSAGE]["content"]
        tries += 1
        if tries > max_tries_per_row * count:
            raise RuntimeError(f"could not draw {count} distinct prompts: only {len(rows)} after {tries} draws")
        if prompt not in seen:
            seen.add(prompt)
            rows.append(row)
    return rows


def shuffled(rows: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """``rows`` in a seeded random order (a new list)."""
    result = list(rows)
    rng.shuffle(result)
    return result


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write one JSON object a line (``\\n`` endings, ASCII, keys in insertion order); return the row count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
            count += 1
    return count
