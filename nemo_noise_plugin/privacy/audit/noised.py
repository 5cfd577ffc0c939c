"""The exact decoder inputs training produces: the plugin's own noise layer and Philox streams on a table lookup."""

from __future__ import annotations

import dataclasses

import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.mechanisms import selected_tokens
from nemo_noise_plugin.noise.schedule import NoiseClock
from nemo_noise_plugin.privacy.audit.checks import check_masks, check_table, check_token_ids, to_device
from nemo_noise_plugin.validation import check_int

__all__ = ["noise_layer", "noised_embeddings", "noised_tokens", "real_tokens"]


def noise_layer(config: NoiseConfig) -> EmbeddingNoise:
    """The plugin's noise layer with no process groups: the audited batch is one whole global batch."""
    return EmbeddingNoise(config, sequence_parallel=False, pg_collection=None, megatron_groups=False)


@torch.no_grad()
def noised_embeddings(
    embedding_table: torch.Tensor,
    token_ids: torch.Tensor,
    noise_config: NoiseConfig,
    *,
    iteration: int = 0,
    loss_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    private_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[b, s, h]`` float32 decoder input that training computes for ``token_ids`` at ``iteration``.

    Looks the tokens up in ``embedding_table`` (``[V, h]``), transposes to Megatron's ``[s, b, h]`` and runs the
    plugin's noise layer as a training forward does: microbatch 0 of ``iteration``, one process, so row ``j`` of
    ``token_ids`` is sample ``j`` of the global batch and gets the noise training gives it. A configuration that
    adds no noise (``enabled=False`` or a zero magnitude) returns the clean lookup, as the model does. Learned
    absolute position embeddings, which some models add before the noise, are not included.
    ``loss_mask``/``padding_mask`` (``[b, s]``, padding True) are what the model's forward would get, and
    ``private_mask`` (``[b, s]``, True inside a private span) the batch's mask for ``tokens='spans'``.
    """
    check_table("embedding_table", embedding_table)
    check_token_ids(token_ids, embedding_table.size(0))
    check_masks(token_ids, loss_mask=loss_mask, padding_mask=padding_mask, private_mask=private_mask)
    check_int("iteration", iteration, minimum=0)
    device = embedding_table.device
    token_ids, loss_mask, padding_mask, private_mask = (
        to_device(device, value) for value in (token_ids, loss_mask, padding_mask, private_mask)
    )
    clean = embedding_table.detach()[token_ids].transpose(0, 1).contiguous()
    if not noise_config.is_active_configuration:
        return clean.transpose(0, 1).float()
    batch = NoiseBatchInputs(
        loss_mask=loss_mask, padding_mask=padding_mask, input_ids=token_ids, private_mask=private_mask
    )
    noised = noise_layer(noise_config)(clean, batch, NoiseClock(iteration=iteration))
    return noised.transpose(0, 1).float()


def real_tokens(
    config: NoiseConfig,
    embeddings: torch.Tensor,
    loss_mask: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, s]`` real-token mask (not padding) and true sequence lengths of ``[b, s, h]`` embeddings, as the noise
    layer sees them."""
    layer = noise_layer(dataclasses.replace(config, tokens="all"))  # valid tokens and lengths, whatever the part
    device = embeddings.device
    batch = NoiseBatchInputs(loss_mask=to_device(device, loss_mask), padding_mask=to_device(device, padding_mask))
    geometry = layer.geometry(embeddings.transpose(0, 1), batch, layer.layout())
    return geometry.valid.t(), geometry.lengths.t()


def noised_tokens(
    config: NoiseConfig,
    token_ids: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    private_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[b, s]`` True for the tokens the noise layer adds noise to: real (not padding), in the part ``tokens``
    selects (all, prompt, response or the ``private_mask``'s spans), not one of ``special_token_ids``; all False
    when ``config`` adds no noise."""
    if not config.is_active_configuration:
        return torch.zeros_like(token_ids, dtype=torch.bool)
    layer = noise_layer(config)
    device = token_ids.device
    batch = NoiseBatchInputs(
        loss_mask=to_device(device, loss_mask),
        padding_mask=to_device(device, padding_mask),
        input_ids=token_ids,
        private_mask=to_device(device, private_mask),
    )
    shape_only = torch.empty(token_ids.size(1), token_ids.size(0), 0, device=device)  # [s, b, -]: the geometry's view
    geometry = layer.geometry(shape_only, batch, layer.layout())
    return selected_tokens(config, geometry, token_ids).t()
