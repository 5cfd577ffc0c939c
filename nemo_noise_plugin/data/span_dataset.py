"""Bridge's chat SFT data path with private spans: each batch carries the ``private_mask`` of ``tokens='spans'``.

``PrivateSpanSFTDatasetConfig`` is Bridge's ``GPTSFTDatasetConfig`` (same fields, same splits under
``dataset_root``, HF chat template, answer-only loss by default) whose datasets are ``PrivateSpanChatDataset``s:
Bridge's ``GPTSFTChatDataset`` plus a ``private_mask`` per example, aligned with ``tokens`` (the same shift by one,
truncation and padding; padding is never private). The spans come from each JSONL example's ``private_spans``
field (``data.private_spans``); every example of a split is checked when the dataset is read, before any model or
GPU memory exists, and a bad span is a ``SettingError`` naming the file, line and span. Offline packing is refused
(packed files are written by Bridge's packer, which drops the spans). Bridge's forward steps hand the batch's
``private_mask`` to the noise layer (``training.forward_step``).

Bridge looks a dataset config's provider up by type (``megatron.bridge.data.utils.get_dataset_provider``), first
match wins; making a ``PrivateSpanSFTDatasetConfig`` puts its type in front of its base there (once; importing this
module changes nothing), so Bridge's ``pretrain``/``finetune`` and the plugin's loops build these datasets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_noise_plugin.data.private_spans import private_token_mask, read_private_spans
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import SettingError

__all__ = ["PrivateSpanChatDataset", "PrivateSpanSFTDatasetConfig", "private_span_datasets_provider"]

_gpt_sft = import_bridge("megatron.bridge.data.datasets.gpt_sft")
_builders = import_bridge("megatron.bridge.data.builders.gpt_sft")
_conversation = import_bridge("megatron.bridge.data.conversation_processing")
_processing = import_bridge("megatron.bridge.data.sft_processing")


class PrivateSpanChatDataset(_gpt_sft.GPTSFTChatDataset):
    """``GPTSFTChatDataset`` whose examples and batches carry a ``private_mask`` (True inside a private span).

    Needs ``use_hf_tokenizer_chat_template=True`` (spans are mapped to tokens through the HF tokenizer's offsets).
    Every example's spans are checked on construction.
    """

    def __init__(self, file_path: str, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(file_path, tokenizer, **kwargs)
        if not self.use_hf_tokenizer_chat_template:
            raise SettingError(
                "use_hf_tokenizer_chat_template",
                False,
                "True (private spans are mapped to tokens through the HF tokenizer's offsets)",
                context=f" for {file_path}",
            )
        self.hf_tokenizer = _conversation.get_processor_tokenizer(tokenizer)
        for index in range(len(self.indexed_dataset)):
            self.private_mask_of(self.indexed_dataset[index], index)

    def _where(self, index: int | None) -> str:
        return f"{self.file_path}" + ("" if index is None else f" line {index + 1} (example {index})")

    def private_mask_of(
        self, example: dict[str, Any], index: int | None = None, input_ids: Any = None
    ) -> torch.Tensor | None:
        """The example's ``[n]`` private-token mask over its rendered chat tokens (None when it marks no span)."""
        where = self._where(index)
        try:
            messages = _conversation.normalize_chat_conversation(example)
        except ValueError as error:
            raise SettingError("messages", None, f"a chat example ({error})", context=f" in {where}") from error
        spans = read_private_spans(example, messages, where)
        if not spans:
            return None
        return private_token_mask(
            self.hf_tokenizer,
            messages,
            spans,
            where,
            input_ids=None if input_ids is None else input_ids.tolist(),
            **_conversation.chat_template_kwargs_from_example(example),
        )

    def _process_example(self, example: dict[str, Any]) -> dict[str, Any]:
        result = super()._process_example(example)
        input_ids = result["input_ids"]
        mask = self.private_mask_of(example, input_ids=input_ids)
        result["private_mask"] = torch.zeros(len(input_ids), dtype=torch.bool) if mask is None else mask
        return result

    def collate_fn(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        """Bridge's chat batch plus ``private_mask`` ``[b, s]`` bool, shifted, truncated and padded like ``tokens``."""
        collated = super().collate_fn(batch)
        width = collated["tokens"].size(1)
        private = torch.zeros(len(batch), width, dtype=torch.bool)
        for row, item in enumerate(batch):
            shifted = item["private_mask"][:-1][:width]  # tokens are input_ids[:-1]
            private[row, : shifted.numel()] = shifted
        collated["private_mask"] = private
        return collated


def _chat_preprocessing() -> Any:
    return _processing.ChatSFTPreprocessingConfig(loss_mode="assistant")


@dataclass(kw_only=True)
class PrivateSpanSFTDatasetConfig(_builders.GPTSFTDatasetConfig):
    """Bridge's ``GPTSFTDatasetConfig`` for chat JSONL with ``private_spans``: batches carry ``private_mask``.

    Chat preprocessing (HF chat template, answer-only loss) by default; offline packing is refused.
    """

    preprocessing: Any = field(default_factory=_chat_preprocessing)
    """Bridge's ``ChatSFTPreprocessingConfig`` (the only preprocessing private spans are defined for)."""

    def __post_init__(self) -> None:
        _register_provider()

    def validate(self) -> None:
        """Bridge's checks, then: chat preprocessing, a local ``dataset_root``, no offline packing."""
        super().validate()
        name = type(self).__name__
        if self.enable_offline_packing:
            raise SettingError(
                f"{name}.enable_offline_packing",
                True,
                "False",
                why=" (Bridge's offline packer writes token files without the private spans; train private spans "
                "unpacked)",
            )
        if not isinstance(self.preprocessing, _processing.ChatSFTPreprocessingConfig):
            raise SettingError(
                f"{name}.preprocessing",
                type(self.preprocessing).__name__,
                "a ChatSFTPreprocessingConfig (private spans index chat messages)",
            )
        if self.dataset_root is None:
            raise SettingError(f"{name}.dataset_root", None, "the folder of training.jsonl / validation.jsonl")


class PrivateSpanSFTDatasetBuilder(_builders.GPTSFTDatasetBuilder):
    """Bridge's SFT builder, building ``PrivateSpanChatDataset`` splits (the same paths, sample counts and seeds)."""

    def _split(self, path: Path, *, is_test: bool, **extra: Any) -> Any:
        if not Path(path).exists():
            return None
        options = {**self.dataset_kwargs, **extra}
        options.pop("chat", None)
        return PrivateSpanChatDataset(
            file_path=str(path),
            tokenizer=self.tokenizer,
            max_seq_length=self.seq_length,
            memmap_workers=self.memmap_workers,
            seed=self.seed,
            is_test=is_test,
            use_hf_tokenizer_chat_template=options.pop("use_hf_tokenizer_chat_template", True),
            loss_mode=options.pop("chat_loss_mode", "assistant"),
            tool_schemas=options.pop("tool_schemas", None),
            **options,
        )

    def _build_datasets(self) -> list[Any]:
        train = self._split(self.train_path, is_test=False, max_num_samples=self.max_train_samples)
        valid = self._split(self.validation_path, is_test=True) if self.do_validation else None
        test = self._split(self.test_path, is_test=True) if self.do_test else None
        return [train, valid, test]


def private_span_datasets_provider(
    train_val_test_num_samples: list[int],
    dataset_config: PrivateSpanSFTDatasetConfig,
    tokenizer: Any = None,
    pg_collection: Any = None,
) -> tuple[Any, Any, Any]:
    """Bridge's dataset-provider signature for ``PrivateSpanSFTDatasetConfig``: the train, validation, test splits.

    Example::

        config.dataset = PrivateSpanSFTDatasetConfig(seq_length=512, dataset_root=folder, do_test=False)
        finetune(config, noise_forward_step)  # with config.model.noise.tokens = "spans"
    """
    del train_val_test_num_samples, pg_collection
    if tokenizer is None:
        raise ValueError("private_span_datasets_provider needs the run's tokenizer (Bridge's setup passes it).")
    return tuple(PrivateSpanSFTDatasetBuilder(config=dataset_config, tokenizer=tokenizer).build())


def _register_provider() -> None:
    """Put this config's provider in front of its base's in Bridge's provider registry (first ``isinstance`` match
    wins there); the registry keeps its other entries and their order."""
    data_utils = import_bridge("megatron.bridge.data.utils")
    registry = data_utils._REGISTRY
    if PrivateSpanSFTDatasetConfig in registry:
        return
    entries = list(registry.items())
    registry.clear()
    registry[PrivateSpanSFTDatasetConfig] = private_span_datasets_provider
    registry.update(entries)
