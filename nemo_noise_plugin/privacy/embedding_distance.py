"""Sizing noise from the embedding table: ``scaling="embedding_distance"`` measured once from a model's vocabulary.

The nearest-neighbour attack starts to fail when the per-token noise norm reaches the distance between neighbouring
token embeddings, and that distance depends on the model (hidden size, initialisation, training). Expressing the
noise norm as a multiple of the vocabulary's median nearest-neighbour distance makes one setting mean the same
thing for every model. ``calibrate_noise_to_embeddings`` measures the distance once (a chunked search over the
table, ``O(query_chunk * vocab_chunk)`` extra memory) and returns the config with ``embedding_distance`` filled in;
store that config (it is a plain field, so it travels with the run's YAML and checkpoints).
"""

from __future__ import annotations

import dataclasses

import torch

from nemo_noise_plugin.noise.config import LENGTH_SCALED_MECHANISMS, NoiseConfig
from nemo_noise_plugin.privacy.audit.search import (
    DEFAULT_QUERY_CHUNK,
    DEFAULT_VOCAB_CHUNK,
    median_nearest_neighbour_distance,
)

__all__ = ["calibrate_noise_to_embeddings"]


def calibrate_noise_to_embeddings(
    config: NoiseConfig,
    table: torch.Tensor,
    *,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
) -> NoiseConfig:
    """``config`` with ``scaling="embedding_distance"`` and ``embedding_distance`` = the median nearest-neighbour
    L2 distance of ``table``'s rows (``[V, h]``, the whole vocabulary: gather vocabulary-parallel shards first).

    The per-token noise of ``uniform``/``gaussian`` then has root-mean-square norm ``distance_multiple *
    embedding_distance`` (times the schedule factor), whatever the table's hidden size and scale. ``config`` is not
    modified.
    """
    if config.mechanism not in LENGTH_SCALED_MECHANISMS:
        raise ValueError(
            f"NoiseConfig.mechanism={config.mechanism!r} is invalid for calibrate_noise_to_embeddings: expected "
            f"one of {', '.join(LENGTH_SCALED_MECHANISMS)} (the mechanisms that embedding_distance scaling sizes)."
        )
    distance = median_nearest_neighbour_distance(table, vocab_chunk=vocab_chunk, query_chunk=query_chunk)
    if not distance > 0.0:
        raise ValueError(
            f"table's median nearest-neighbour distance is {distance!r}: expected > 0 (more than half of the rows "
            "have an exact duplicate, so no noise norm can be sized from it)."
        )
    return dataclasses.replace(config, scaling="embedding_distance", embedding_distance=distance)
