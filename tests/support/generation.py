"""Greedy decoding with a Megatron model chunk: the plain loop that the task report's exact match is checked against."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from nemo_noise_plugin.jobs.cpu import causal_attention_mask

__all__ = ["greedy_decode"]


def greedy_decode(model: nn.Module, prompt: Sequence[int], eos_id: int, max_new_tokens: int = 16) -> list[int]:
    """Greedy decoding with a Megatron model chunk (full recompute per token): the new tokens, up to ``eos_id``."""
    tokens = list(prompt)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            width = len(tokens)
            ids = torch.tensor([tokens])
            logits = model(ids, torch.arange(width).unsqueeze(0), causal_attention_mask(width))
            token = int(logits[0, -1].argmax())
            new.append(token)
            if token == eos_id:
                break
            tokens.append(token)
    return new
