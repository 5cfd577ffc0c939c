"""The instruction set shipped with the package, read through Megatron-Bridge's finetuning data path.

``nemo_noise_plugin/data/instructions/{training,validation,test}.jsonl`` hold 4400, 440 and 440 chat examples of
eleven small tasks with exact answers (``INSTRUCTION_TASKS``; written for this project by
``scripts/make_instruction_data.py``, 480 distinct questions a task, none shared between splits). Seven tasks answer
one number, word or letter; four (``LONG_ANSWER_TASKS``: spelling, reversing, sorting, counting a range) answer
tens of tokens, so answer length and copying can be measured. ``training`` is trained on, ``validation`` is held out
for model selection and the reports during training, ``test`` is held out from both, for a final measurement.
The SmolLM2 recipes read them with Bridge's own ``GPTSFTDatasetConfig`` (HF chat template of the model's tokenizer,
loss on the assistant's answer only), with or without Bridge's offline sequence packing; with ``do_test=False`` Bridge
neither reads nor packs ``test.jsonl``. Bridge writes index files (and packed files) next to the JSONL, so the files
are first copied into the run's directory (``write_instruction_files``).
"""

from __future__ import annotations

import json
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import check_choice

__all__ = [
    "INSTRUCTION_SPLITS",
    "INSTRUCTION_TASKS",
    "copy_split_files",
    "LONG_ANSWER_TASKS",
    "instruction_dataset_config",
    "instruction_examples",
    "instruction_files",
    "write_instruction_files",
]

INSTRUCTION_SPLITS = ("training", "validation", "test")
"""The shipped splits: ``training`` is trained on; ``validation`` is held out, for model selection and the reports
during training; ``test`` is held out from both (the recipes build no test dataset: ``do_test=False``)."""

INSTRUCTION_TASKS: dict[str, str] = {
    "add": "the sum of two two-digit numbers",
    "subtract": "the difference of two two-digit numbers, never negative",
    "convert": "a unit conversion (hours to minutes, kilometres to metres, ...)",
    "count": "the number of letters in a word",
    "upper": "a word in capital letters",
    "first": "the first letter of a word",
    "next": "the number after a given number",
    "spell": "a word spelled letter by letter with hyphens (s-u-m-m-e-r)",
    "reverse": "a list of 4 to 7 words or 5 to 10 numbers in reverse order",
    "sort": "a list of 5 to 10 numbers sorted from smallest to largest",
    "range": "the numbers from one to another, 6 to 12 of them ('Count from 17 to 25.' -> '17, 18, ..., 25')",
}
"""Each task's name (the ``task`` field of every example) and what its answer is."""

LONG_ANSWER_TASKS = ("spell", "reverse", "sort", "range")
"""The tasks whose answers are tens of tokens long (the others answer one number, word or letter)."""


def instruction_files() -> dict[str, Path]:
    """The shipped JSONL file of each split.

    >>> sorted(instruction_files())
    ['test', 'training', 'validation']
    """
    folder = resources.files("nemo_noise_plugin") / "data" / "instructions"
    return {split: Path(str(folder / f"{split}.jsonl")) for split in INSTRUCTION_SPLITS}


def instruction_examples(split: str = "validation") -> list[dict[str, Any]]:
    """The examples of ``split`` as dicts with ``messages`` (system, user, assistant) and ``task``.

    >>> example = instruction_examples("test")[0]
    >>> example["task"] in INSTRUCTION_TASKS, [m["role"] for m in example["messages"]]
    (True, ['system', 'user', 'assistant'])
    """
    check_choice("split", split, tuple(INSTRUCTION_SPLITS))
    with open(instruction_files()[split]) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_instruction_files(directory: str | os.PathLike) -> str:
    """Copy the shipped splits into ``directory`` (Bridge's ``dataset_root``) unless identical copies exist.

    ``test.jsonl`` is copied too; Bridge reads it only with ``do_test=True``.
    """
    return copy_split_files(instruction_files(), directory)


def copy_split_files(files: dict[str, Path], directory: str | os.PathLike) -> str:
    """Copy each split's JSONL (``files``: split -> path) into ``directory`` as ``<split>.jsonl``; identical copies
    are kept, a changed copy is replaced and Bridge's index files of the old one removed. Returns ``directory``."""
    os.makedirs(directory, exist_ok=True)
    for split, source in files.items():
        target = Path(directory) / f"{split}.jsonl"
        if not target.exists() or target.read_bytes() != source.read_bytes():
            shutil.copyfile(source, target)
            for index in target.parent.glob(f"{split}.jsonl.idx*"):  # Bridge's index of the old file
                index.unlink()
    return str(directory)


def instruction_dataset_config(
    dataset_root: str,
    *,
    seq_length: int,
    packed_sequence_size: int | None = None,
    seed: int = 1234,
) -> Any:
    """Bridge's ``GPTSFTDatasetConfig`` for the instruction set in ``dataset_root``: chat template, answer-only loss.

    ``packed_sequence_size`` turns on Bridge's offline packing (several examples per row, ``cu_seqlens``);
    packed files are written under ``dataset_root/packed`` on first use.
    """
    if packed_sequence_size is not None and packed_sequence_size < seq_length:
        raise ValueError(
            f"packed_sequence_size={packed_sequence_size} is invalid: expected None (no packing) or an integer "
            f">= seq_length={seq_length}."
        )
    builders = import_bridge("megatron.bridge.data.builders.gpt_sft")
    processing = import_bridge("megatron.bridge.data.sft_processing")
    packing = None
    if packed_sequence_size is not None:
        packing = import_bridge("megatron.bridge.data.packing.config").PackedSequenceSpecs(
            packed_sequence_size=packed_sequence_size, pad_seq_to_mult=1
        )
    return builders.GPTSFTDatasetConfig(
        seq_length=seq_length,
        dataset_root=dataset_root,
        preprocessing=processing.ChatSFTPreprocessingConfig(loss_mode="assistant"),
        enable_offline_packing=packing is not None,
        offline_packing_specs=packing,
        seed=seed,
        do_test=False,
        dataloader_type="single",
        num_workers=0,
    )
