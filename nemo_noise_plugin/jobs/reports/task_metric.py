"""The task metric of the instruction recipes: greedy exact match on the held-out splits, in one forward pass.

An answer counts when greedy decoding from the prompt reproduces the reference answer's tokens and then stops (the
end-of-turn token). Greedy decoding yields exactly that sequence iff, fed the reference, the model's argmax at every
answer position is the next reference token, so one teacher-forced forward pass per batch computes it exactly
(``exact_match``; the tests check it against the plain greedy loop, ``tests/support/generation.py``).
``task_batches`` builds the held-out splits (``TASK_REPORT_SPLITS``) as Bridge's loop has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nemo_noise_plugin.jobs.batches import collate, recipe_datasets
from nemo_noise_plugin.jobs.cpu.parallel import causal_attention_mask

__all__ = ["TASK_REPORT_SPLITS", "answer_positions", "exact_match", "task_batches"]


def answer_positions(labels: torch.Tensor, loss_mask: torch.Tensor, eos_id: int) -> list[torch.Tensor]:
    """Per row: the positions whose labels are the answer, up to and including the first ``eos_id`` label."""
    rows = []
    for row_labels, row_mask in zip(labels, loss_mask, strict=True):
        positions = row_mask.nonzero().flatten()
        ends = (row_labels[positions] == eos_id).nonzero().flatten()
        rows.append(positions[: int(ends[0]) + 1] if len(ends) else positions)
    return rows


def exact_match(
    model: nn.Module, batches: Sequence[dict[str, Any]], eos_id: int, *, noise_inputs: bool = False
) -> tuple[float, dict[str, float], list[bool]]:
    """Greedy exact match of ``model`` on ``batches`` (Bridge SFT batches): overall, per task, and per example.

    ``noise_inputs``: ``model`` is a noisy model noising in eval mode (``make_noisy`` with ``training_only=False``);
    batch ``i`` is its noise's iteration ``i`` and hands its loss mask (and its ``private_mask``, for
    ``tokens='spans'``) to the noise layer, as training does.
    """
    hits: list[bool] = []
    tasks: list[str] = []
    with torch.no_grad():
        for index, batch in enumerate(batches):
            if noise_inputs:
                model.noise_clock.start_iteration(index)
                with model.noise_batch_inputs(batch["loss_mask"], private_mask=batch.get("private_mask")):
                    logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
            else:
                logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
            predicted = logits.argmax(-1)
            for row, positions in enumerate(answer_positions(batch["labels"], batch["loss_mask"], eos_id)):
                hits.append(bool(torch.equal(predicted[row, positions], batch["labels"][row, positions])))
                tasks.append((batch.get("metadata") or [{}] * len(predicted))[row].get("task", "all"))
    per_task = {
        task: sum(h for h, t in zip(hits, tasks, strict=True) if t == task) / tasks.count(task)
        for task in sorted(set(tasks))
    }
    return sum(hits) / len(hits), per_task, hits


TASK_REPORT_SPLITS = ("validation", "test")
"""The held-out splits the task report scores: ``validation`` (Bridge's evaluation split) and ``test`` (never used
in training or model selection; absent when the dataset has no ``test.jsonl``)."""


def task_batches(state: Any, device: Any, held_out: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """Batches of every ``TASK_REPORT_SPLITS`` split the run's dataset has, one example per row, whole batches only
    (of the first ``held_out`` examples of each split when given).

    Built from Bridge's dataset provider and tokenizer as the run has them (``recipe_datasets``, unpacked); the CPU
    gets an explicit causal mask, a GPU none (the attention's own causal mask).
    """
    _, valid, test = recipe_datasets(state, test=True, unpacked=True)
    size = state.cfg.train.micro_batch_size
    mask = causal_attention_mask(state.cfg.model.seq_length) if torch.device(device).type == "cpu" else None
    found = {split: data for split, data in zip(TASK_REPORT_SPLITS, (valid, test), strict=True) if data is not None}
    counts = {split: len(data) if held_out is None else min(len(data), held_out) for split, data in found.items()}
    return {split: collate(data, counts[split] // size, size, mask, device) for split, data in found.items() if data}
