"""The noise layer: adds the configured noise to a decoder input in Megatron's ``[s, b, h]`` layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.lengths import group_rank, group_size, lengths_from_loss_mask, lengths_from_padding_mask


@dataclass
class NoiseBatchInputs:
    """What the noise layer needs from the batch besides the decoder input (masks as the model received them)."""

    loss_mask: torch.Tensor | None = None
    """``[b, s]`` loss mask (context-parallel shard when CP > 1)."""
    padding_mask: torch.Tensor | None = None
    """``[b, s]`` padding mask, True = padding (before any sequence-parallel scatter)."""


class EmbeddingNoise:
    """Adds noise to the first pipeline stage's decoder input; a stateless function of (config, step, ranks).

    Holds no parameters or buffers, so a model carrying it keeps the state-dict keys of a plain model.
    The random stream is seeded from (seed, step, data-parallel rank, context-parallel rank, and the tensor-parallel
    rank only under sequence parallelism), so data- and context-parallel replicas draw different noise while
    tensor-parallel ranks that hold replicated activations draw identical noise.
    """

    def __init__(self, config: NoiseConfig, *, sequence_parallel: bool, pg_collection: Any | None) -> None:
        self.config = config
        self.sequence_parallel = sequence_parallel
        self.pg_collection = pg_collection

    def _group(self, name: str) -> Any:
        return getattr(self.pg_collection, name, None) if self.pg_collection is not None else None

    def stream_seed(self, step: int) -> int:
        """The 64-bit generator seed for ``step`` on this rank (numpy ``SeedSequence`` mixing)."""
        tp_rank = group_rank(self._group("tp")) if self.sequence_parallel else 0
        words = [
            self.config.seed,
            step,
            group_rank(self._group("dp")),
            group_rank(self._group("cp")),
            tp_rank,
        ]
        return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))

    def global_sequence_length(self, decoder_input: torch.Tensor) -> int:
        """The padded global sequence length behind a local ``[s_local, b, h]`` decoder input."""
        tp = group_size(self._group("tp")) if self.sequence_parallel else 1
        return decoder_input.size(0) * tp * group_size(self._group("cp"))

    def sequence_lengths(self, decoder_input: torch.Tensor, batch: NoiseBatchInputs) -> torch.Tensor:
        """``L`` per sequence (``[b]``, float32) for the configured scaling."""
        global_length = self.global_sequence_length(decoder_input)
        batch_size = decoder_input.size(1)
        if self.config.scaling == "padded_length":
            return torch.full((batch_size,), float(global_length), device=decoder_input.device)
        if batch.padding_mask is not None:
            return lengths_from_padding_mask(batch.padding_mask, self._group("cp")).to(decoder_input.device)
        if batch.loss_mask is not None:
            return lengths_from_loss_mask(batch.loss_mask, global_length, self._group("cp")).to(decoder_input.device)
        raise ValueError(
            "NoiseConfig.scaling='true_length' needs the batch's loss_mask or padding_mask to find each "
            "sequence's length, and the forward call passed neither. Pass loss_mask= to the model's forward, "
            "or set noise.scaling='padded_length' (HF-compatible) or 'absolute'."
        )

    def scale(self, decoder_input: torch.Tensor, batch: NoiseBatchInputs) -> torch.Tensor:
        """Per-sequence noise magnitude ``m * c`` as a ``[1, b, 1]`` float32 tensor."""
        magnitude = float(self.config.magnitude)
        if self.config.scaling == "absolute":
            per_sequence = torch.full((decoder_input.size(1),), magnitude, device=decoder_input.device)
        else:
            lengths = self.sequence_lengths(decoder_input, batch).clamp_min(1.0)
            per_sequence = magnitude / torch.sqrt(lengths * decoder_input.size(2))
        return per_sequence.view(1, -1, 1)

    def sample(self, decoder_input: torch.Tensor, batch: NoiseBatchInputs, step: int) -> torch.Tensor:
        """The float32 noise that ``__call__`` adds for ``step`` (same shape as ``decoder_input``)."""
        generator = torch.Generator(device=decoder_input.device)
        generator.manual_seed(self.stream_seed(step))
        shape, device = decoder_input.shape, decoder_input.device
        if self.config.mechanism == "uniform":
            unit = torch.empty(shape, dtype=torch.float32, device=device).uniform_(-1.0, 1.0, generator=generator)
        else:
            unit = torch.randn(shape, dtype=torch.float32, device=device, generator=generator)
        return unit.mul_(self.scale(decoder_input, batch))

    def __call__(self, decoder_input: torch.Tensor, batch: NoiseBatchInputs, step: int) -> torch.Tensor:
        """Return ``decoder_input`` plus noise; gradients flow to the input unchanged."""
        noise = self.sample(decoder_input, batch, step)
        return (decoder_input.float() + noise).to(decoder_input.dtype)
