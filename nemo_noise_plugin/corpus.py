"""The embedded default dataset: a small English corpus shipped with the package, tokenised as bytes."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch

BYTE_VOCAB_SIZE = 256
PAD_TOKEN = 0


def corpus_bytes() -> bytes:
    """The shipped corpus file, as bytes."""
    return resources.files("nemo_noise_plugin").joinpath("data/corpus.txt").read_bytes()


def load_corpus_tokens() -> torch.Tensor:
    """The shipped corpus as a 1-D tensor of byte token ids."""
    return torch.tensor(list(corpus_bytes()), dtype=torch.long)


@dataclass
class LanguageModelingBatch:
    """One Megatron-style batch: ``[b, s]`` tokens, shifted labels, loss mask (0 on padding) and positions."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor


def sample_padded_batch(
    corpus: torch.Tensor, batch_size: int, sequence_length: int, generator: torch.Generator, min_length: int
) -> LanguageModelingBatch:
    """Random windows of random true length in ``[min_length, sequence_length]``, right-padded, as in SFT."""
    if not 2 <= min_length <= sequence_length < corpus.numel():
        raise ValueError(
            f"sequence_length={sequence_length} and min_length={min_length} must satisfy "
            f"2 <= min_length <= sequence_length < corpus size ({corpus.numel()})."
        )
    tokens = torch.full((batch_size, sequence_length), PAD_TOKEN, dtype=torch.long)
    labels = torch.full((batch_size, sequence_length), PAD_TOKEN, dtype=torch.long)
    loss_mask = torch.zeros(batch_size, sequence_length)
    for row in range(batch_size):
        length = int(torch.randint(min_length, sequence_length + 1, (1,), generator=generator))
        start = int(torch.randint(0, corpus.numel() - length - 1, (1,), generator=generator))
        window = corpus[start : start + length + 1]
        tokens[row, :length] = window[:-1]
        labels[row, :length] = window[1:]
        loss_mask[row, :length] = 1.0
    position_ids = torch.arange(sequence_length).unsqueeze(0).expand(batch_size, -1)
    return LanguageModelingBatch(tokens, labels, loss_mask, position_ids)
