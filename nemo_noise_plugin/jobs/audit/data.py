"""What ``nemo noise audit`` attacks and scores: the named sources of audited tokens and the user's JSONL files.

``data=`` names ``AUDIT_DATA`` (the embedded corpus, the shipped validation chats, a seeded uniform sample of the
vocabulary) or a JSONL file of ``{"messages": [...]}``, ``{"input", "output"}`` or ``{"text"}`` rows
(``audit_data_rows``, checked by ``check_audit_data``); the held-out chats (``validation_chats``, the first
``AUDIT_CHATS``) give the SmolLM2 target its held-out loss and the spans its exact match scores (``answer_spans``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_noise_plugin.data.corpus import corpus_documents

__all__ = [
    "AUDIT_CHATS",
    "AUDIT_DATA",
    "DATA_SEED",
    "answer_spans",
    "audit_data_rows",
    "chat_texts",
    "check_audit_data",
    "padded",
    "row_text",
    "take_tokens",
    "uniform_sequences",
    "validation_chats",
]

AUDIT_DATA: dict[str, str] = {
    "corpus": "the embedded corpus (model=tiny's default)",
    "validation": "the shipped validation chats (model=smollm2's default without run=)",
    "uniform": "a seeded uniform sample of the vocabulary's ids, special ids excluded",
}
"""The named sources of audited tokens (``data=``); any other value is the path of a JSONL file."""
DATA_SEED = 1234
"""The seed of ``data=uniform``'s sample."""

AUDIT_CHATS = 80
"""How many of the shipped validation chats (the first, a shuffled mix of every task) the SmolLM2 audit attacks and
scores: the 80 it audited before the set grew to 440, so its cost and its numbers stay comparable."""


def padded(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequences`` right-padded with ``pad_id`` into ``[b, s]`` ids, and the ``[b, s]`` mask, True on padding."""
    length = max(len(sequence) for sequence in sequences)
    tokens = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    padding = torch.ones(len(sequences), length, dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
        padding[row, : len(sequence)] = False
    return tokens, padding


def take_tokens(
    sequences: Sequence[Sequence[int]], count: int, max_length: int, what: str = "the held-out text"
) -> list[list[int]]:
    """Sequences (each cut to ``max_length``) in order until they hold ``count`` tokens (the last one cut). A piece
    holds at least 2 tokens, so where only one token would be left the last piece takes 2 (``count + 1`` in all)."""
    if count < 2:
        raise ValueError(f"tokens={count} is invalid: expected at least 2 (an audited piece holds at least 2 tokens).")
    chosen, total = [], 0
    for sequence in sequences:
        piece = list(sequence)[: min(max_length, max(2, count - total))]
        if len(piece) >= 2:
            chosen.append(piece)
            total += len(piece)
        if total >= count:
            return chosen
    raise ValueError(
        f"tokens={count} is invalid: {what} has only {total} tokens (in pieces of max_length={max_length}); "
        "expected at most that many."
    )


def uniform_sequences(eligible: Sequence[int], count: int, max_length: int) -> list[list[int]]:
    """``count`` ids drawn from ``eligible`` without replacement (a new permutation once all are used; seeded with
    ``DATA_SEED``), in rows of ``max_length``."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    pool = torch.as_tensor(list(eligible), dtype=torch.long)
    drawn = torch.cat([pool[torch.randperm(len(pool), generator=generator)] for _ in range(-(-count // len(pool)))])
    ids = drawn[:count].tolist()
    return [ids[start : start + max_length] for start in range(0, count, max_length)]


# What is audited: named sources and the user's JSONL files


def check_audit_data(data: str, model: str) -> str:
    """``data`` checked for ``model``: a name of ``AUDIT_DATA`` that the model has, or the path of a readable JSONL
    file whose rows ``audit_data_rows`` accepts; ``ValueError`` naming the setting, the value and what is allowed."""
    allowed = ("corpus", "uniform") if model == "tiny" else ("validation", "uniform")
    if data in AUDIT_DATA:
        if data not in allowed:
            raise ValueError(
                f"data={data!r} is invalid with model={model}: expected {', '.join(allowed)} or a JSONL file."
            )
        return data
    if model == "tiny":
        raise ValueError(
            f"data={data!r} is invalid with model=tiny: expected {' or '.join(allowed)} (the tiny model has no "
            "tokenizer for a JSONL file; audit a JSONL file with model=smollm2 or run=)."
        )
    audit_data_rows(data)
    return data


def audit_data_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a JSONL file of audited text, checked: ``{"messages": [{"role", "content"}, ...]}`` (the shipped
    instruction format, rendered with the model's chat template), ``{"input", "output"}`` (input, a space, output)
    or ``{"text"}``; ``ValueError`` naming ``data=``, the line and what is expected."""
    file = Path(path).expanduser()
    expected = 'expected a JSONL file of {"messages": [...]}, {"input", "output"} or {"text"} rows'
    if not file.is_file():
        reason = "it is a folder" if file.is_dir() else "no such file"
        raise ValueError(f"data={path!r} is invalid: {reason}; {expected} (or one of {', '.join(AUDIT_DATA)}).")
    rows = []
    with open(file, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"data={path!r} is invalid at line {number}: not JSON ({error.msg}); {expected}."
                ) from None
            if not _is_audit_row(row):
                raise ValueError(f"data={path!r} is invalid at line {number}: {line.strip()[:80]!r}; {expected}.")
            rows.append(row)
    if not rows:
        raise ValueError(f"data={path!r} is invalid: the file has no rows; {expected}.")
    return rows


def _is_audit_row(row: Any) -> bool:
    if not isinstance(row, dict):
        return False
    if "messages" in row:
        messages = row["messages"]
        return (
            isinstance(messages, list)
            and bool(messages)
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        )
    if "text" in row:
        return isinstance(row["text"], str) and bool(row["text"])
    return isinstance(row.get("input"), str) and isinstance(row.get("output"), str)


def row_text(row: dict[str, Any], tokenizer: Any) -> str:
    if "messages" in row:
        return tokenizer.apply_chat_template(row["messages"], tokenize=False)
    if "text" in row:
        return row["text"]
    return f"{row['input']} {row['output']}"


def validation_chats(held_out: str | os.PathLike[str] | None = None) -> list[dict[str, Any]] | None:
    """The first ``AUDIT_CHATS`` chats of ``held_out`` (a JSONL file), else of the shipped validation split; None
    when neither is there."""
    from importlib import resources

    path = resources.files("nemo_noise_plugin").joinpath("data/instructions/validation.jsonl")
    if held_out is not None:
        path = Path(held_out)
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [record for record in records if "messages" in record][:AUDIT_CHATS]


def chat_texts(tokenizer: Any, held_out: str | os.PathLike[str] | None = None) -> list[list[int]]:
    """Token ids of the first ``AUDIT_CHATS`` validation chats (``held_out``'s, else the shipped split's) in the chat
    template, else the corpus lines."""
    records = validation_chats(held_out)
    if records:
        texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in records]
        return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    return [tokenizer(bytes(doc[:-1]).decode("utf-8", "replace"))["input_ids"] for doc in corpus_documents()]


def answer_spans(
    tokenizer: Any, held_out: str | os.PathLike[str] | None = None
) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The first ``AUDIT_CHATS`` validation chats (``held_out``'s, else the shipped split's) as token ids and, for
    each, the span ``[start, end)`` of the reference answer and its end-of-turn token (what greedy decoding must
    produce for an exact match)."""
    sequences, spans = [], []
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for example in validation_chats(held_out) or []:
        messages = example["messages"]
        prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        if full[: len(prompt)] != prompt or end_of_turn not in full[len(prompt) :]:
            continue  # the chat template does not split at the answer: not a well-defined exact match
        sequences.append(full)
        spans.append((len(prompt), full.index(end_of_turn, len(prompt)) + 1))
    return sequences, spans
