"""The task families shipped with the package: their JSONL files, their examples, and Bridge's dataset for them.

``TASK_FAMILIES`` names each family and what it is for. ``sentiment`` (gist: four-way review sentiment spread over
several words) and ``support`` (span: support messages whose customer identity is a private span) live under
``nemo_noise_plugin/data/tasks/<family>/{training,validation,test}.jsonl`` (``support`` also has ``canaries.jsonl``);
``instructions`` is the exact-answer instruction set of ``data.instruction_set``, kept unchanged as the negative
control. Reading them needs neither Faker nor VADER: the files were written by ``scripts/make_task_data.py``.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from nemo_noise_plugin.data.instruction_set import (
    INSTRUCTION_SPLITS,
    copy_split_files,
    instruction_dataset_config,
    instruction_files,
)
from nemo_noise_plugin.validation import check_choice

__all__ = [
    "CANARY_SPLIT",
    "TASK_FAMILIES",
    "task_dataset_config",
    "task_examples",
    "task_files",
    "write_task_files",
]

TASK_FAMILIES: dict[str, str] = {
    "sentiment": "gist: a review's sentiment (terrible, bad, good, great) from the mean valence of 5-8 of its words",
    "sentiment_long": "gist: the same four-way sentiment from 36-48 of a 64-80-word review's words (about 6.5x)",
    "support": "span: a ticket's category or an arithmetic answer; the customer's name, account, address private",
    "instructions": "negative control: eleven exact-answer tasks (data.instruction_set), every question token needed",
}
"""Each shipped family and what its answers need."""
CANARY_SPLIT = "canaries"
"""The extra file of the span family: held-out examples whose spans are canary strings found in no split."""
_CANARY_FAMILIES = ("support",)


def task_files(family: str) -> dict[str, Path]:
    """The shipped JSONL file of each split of ``family`` (and ``canaries`` for the span family).

    >>> sorted(task_files("support"))
    ['canaries', 'test', 'training', 'validation']
    """
    check_choice("family", family, tuple(TASK_FAMILIES))
    if family == "instructions":
        return instruction_files()
    folder = resources.files("nemo_noise_plugin") / "data" / "tasks" / family
    splits = (*INSTRUCTION_SPLITS, CANARY_SPLIT) if family in _CANARY_FAMILIES else INSTRUCTION_SPLITS
    return {split: Path(str(folder / f"{split}.jsonl")) for split in splits}


def task_examples(family: str, split: str = "validation") -> list[dict[str, Any]]:
    """The examples of ``family``'s ``split``: dicts with ``messages``, ``task`` and (new families) ``private_spans``.

    >>> example = task_examples("sentiment", "test")[0]
    >>> example["label"] in ("terrible", "bad", "good", "great"), example["private_spans"][0]["message"]
    (True, 1)
    """
    files = task_files(family)
    check_choice("split", split, tuple(files))
    with open(files[split], encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_task_files(family: str, directory: str | os.PathLike) -> str:
    """Copy ``family``'s training, validation and test files into ``directory`` (Bridge's ``dataset_root``).

    Identical copies are kept; a changed copy is replaced and Bridge's index files of the old one removed. The
    canaries are not copied: they are for the audit, never for training.
    """
    files = {split: path for split, path in task_files(family).items() if split != CANARY_SPLIT}
    return copy_split_files(files, directory)


def task_dataset_config(
    family: str,
    dataset_root: str | os.PathLike,
    *,
    seq_length: int,
    packed_sequence_size: int | None = None,
    seed: int = 1234,
) -> Any:
    """Bridge's ``GPTSFTDatasetConfig`` for ``family``, its files copied into ``dataset_root`` first.

    The same dataset as ``data.instruction_set.instruction_dataset_config`` (chat template, loss on the answer only,
    optional offline packing); Bridge ignores the extra fields (``private_spans``, ``label``, ...).

    >>> config = task_dataset_config("sentiment", "/tmp/sentiment_data", seq_length=128)  # doctest: +SKIP
    """
    root = write_task_files(family, dataset_root)
    return instruction_dataset_config(root, seq_length=seq_length, packed_sequence_size=packed_sequence_size, seed=seed)
