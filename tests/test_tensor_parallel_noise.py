"""Noise under tensor parallelism (two gloo processes): replicated without SP, per-shard with SP."""

from __future__ import annotations

import math

import pytest
import torch

from tests.multiprocess import run_on_gloo_ranks

SEQ, BATCH, HIDDEN = 16, 2, 64


def _noise_under_tp(rank: int, world_size: int, port: int, sequence_parallel: bool) -> dict:
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
    from nemo_noise_plugin.noisy_gpt import NoisyGPTModel
    from nemo_noise_plugin.testing.harness import (
        build_tiny_gpt,
        destroy_cpu_parallel,
        init_cpu_parallel,
        tiny_gpt_config,
    )

    init_cpu_parallel(rank=rank, world_size=world_size, port=port, tensor_model_parallel_size=2)
    try:
        noise_config = NoiseConfig(alpha=8.0, scaling="padded_length")
        torch.manual_seed(0)
        tokens = torch.randint(0, 256, (BATCH, SEQ))
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        if sequence_parallel:
            # Megatron's torch-norm fallback (no Apex/TE) rejects SP, so the SP case runs the real embedding
            # (which scatters along the sequence over the TP group) with the model's noise layer.
            config = tiny_gpt_config(tensor_model_parallel_size=2, sequence_parallel=True)
            embedding = LanguageModelEmbedding(
                config, vocab_size=256, max_sequence_length=SEQ, position_embedding_type="rope"
            )
            noise_layer = EmbeddingNoise(
                noise_config,
                sequence_parallel=True,
                pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
            )
            with torch.no_grad():
                embedded = embedding(input_ids=tokens, position_ids=positions)
        else:
            config = tiny_gpt_config(tensor_model_parallel_size=2)
            model = build_tiny_gpt(config, model_class=NoisyGPTModel, noise_config=noise_config)
            noise_layer = model.noise_layer
            with torch.no_grad(), model.noise_batch_inputs(None):
                embedded = model._preprocess(input_ids=tokens, position_ids=positions)[0]
        noise = noise_layer.sample(embedded, NoiseBatchInputs(), 0)
        return {
            "shape": tuple(embedded.shape),
            "noise": noise,
            "global_length": noise_layer.global_sequence_length(embedded),
        }
    finally:
        destroy_cpu_parallel()


@pytest.mark.multiprocess
def test_without_sequence_parallelism_tp_ranks_add_identical_noise():
    first, second = run_on_gloo_ranks(_noise_under_tp, 2, False)
    assert first["shape"] == (SEQ, BATCH, HIDDEN)
    assert torch.equal(first["noise"], second["noise"])
    assert first["noise"].abs().max() <= 8.0 / math.sqrt(SEQ * HIDDEN) * (1 + 1e-5)


@pytest.mark.multiprocess
def test_with_sequence_parallelism_each_rank_noises_its_own_positions_at_the_global_scale():
    first, second = run_on_gloo_ranks(_noise_under_tp, 2, True)
    assert first["shape"] == second["shape"] == (SEQ // 2, BATCH, HIDDEN)
    assert first["global_length"] == second["global_length"] == SEQ
    assert not torch.equal(first["noise"], second["noise"])
    bound = 8.0 / math.sqrt(SEQ * HIDDEN)  # the global length, not the local shard's
    for result in (first, second):
        assert 0.99 * bound <= result["noise"].abs().max() <= bound * (1 + 1e-5)
