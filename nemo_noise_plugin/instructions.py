"""The instruction set shipped with the package, read through Megatron-Bridge's finetuning data path.

``nemo_noise_plugin/data/instructions/{training,validation}.jsonl`` hold a few hundred chat examples of small tasks
with exact answers (arithmetic, unit conversions, letter counts, upper-casing, first letters, successors; written
for this project by ``scripts/make_instruction_data.py``); ``validation`` is the held-out split. The SmolLM2 recipes
read them with Bridge's own ``GPTSFTDatasetConfig`` (HF chat template of the model's tokenizer, loss on the
assistant's answer only), with or without Bridge's offline sequence packing. Bridge writes index files (and packed
files) next to the JSONL, so the files are first copied into the run's directory (``write_instruction_files``).
"""

from __future__ import annotations

import json
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from nemo_noise_plugin.bridge_imports import import_bridge

__all__ = [
    "INSTRUCTION_SPLITS",
    "instruction_dataset_config",
    "instruction_examples",
    "instruction_files",
    "write_instruction_files",
]

INSTRUCTION_SPLITS = ("training", "validation")
"""The shipped splits; ``validation`` is held out (never trained on)."""


def instruction_files() -> dict[str, Path]:
    """The shipped JSONL file of each split."""
    folder = resources.files("nemo_noise_plugin") / "data" / "instructions"
    return {split: Path(str(folder / f"{split}.jsonl")) for split in INSTRUCTION_SPLITS}


def instruction_examples(split: str = "validation") -> list[dict[str, Any]]:
    """The examples of ``split`` as dicts with ``messages`` (system, user, assistant) and ``task``."""
    if split not in INSTRUCTION_SPLITS:
        raise ValueError(f"split={split!r} is invalid: expected one of {', '.join(INSTRUCTION_SPLITS)}.")
    with open(instruction_files()[split]) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_instruction_files(directory: str | os.PathLike) -> str:
    """Copy the shipped splits into ``directory`` (Bridge's ``dataset_root``) unless identical copies exist."""
    os.makedirs(directory, exist_ok=True)
    for split, source in instruction_files().items():
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
