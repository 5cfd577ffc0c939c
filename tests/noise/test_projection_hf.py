"""Nearest-row projection at inference on a Hugging Face model: the training projection, generation on table rows."""

from __future__ import annotations

import dataclasses

import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.hf_inference import inference_noise, noised_inputs_embeds
from nemo_noise_plugin.noise.projection import nearest_rows
from tests.noise.test_projection import CLIP, HIDDEN, VOCAB, random_table, token_batch

SERVING = NoiseConfig(
    mechanism="gaussian_mechanism",
    clip_norm=CLIP,
    epsilon=40.0,
    tokens="prompt",
    projection="nearest_row",
    training_only=False,
    seed=8,
)


def _llama(table: torch.Tensor):
    """A tiny ``LlamaForCausalLM`` (eval mode) whose input embedding is ``table``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(table)
    return model


def _is_table_row(vectors: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``[N]`` True where a vector equals some row of ``table`` bit for bit."""
    return (vectors.unsqueeze(1) == table.unsqueeze(0)).all(dim=-1).any(dim=1)


def test_noised_inputs_embeds_project_exactly_as_the_megatron_model_does(megatron_cpu):
    from nemo_noise_plugin.model import NoisyGPTModel
    from tests.support.models import build_tiny_gpt

    table, batch = random_table(), token_batch()
    megatron = build_tiny_gpt(vocab_size=VOCAB, model_class=NoisyGPTModel, noise_config=SERVING).eval()
    with torch.no_grad():
        megatron.embedding.word_embeddings.weight.copy_(table)
        megatron.noise_clock.start_iteration(4)
        with megatron.noise_batch_inputs(batch["loss_mask"]):
            expected = megatron._preprocess(input_ids=batch["tokens"], position_ids=batch["position_ids"])[0]
        got = noised_inputs_embeds(_llama(table), batch["tokens"], SERVING, loss_mask=batch["loss_mask"], iteration=4)
    projected = megatron.projected_ids.t() >= 0
    assert 0 < int(projected.sum()) < projected.numel()
    assert torch.equal(got, expected.transpose(0, 1))
    assert bool(_is_table_row(got.reshape(-1, HIDDEN), table).all())
    assert torch.equal(got[~projected], table[batch["tokens"]][~projected])  # the response stays clean


def test_generation_under_the_hook_feeds_only_table_rows_and_the_nearest_ones():
    table = random_table()
    model = _llama(table)
    prompts = token_batch()["tokens"][:2, :6]
    config = dataclasses.replace(SERVING, tokens="all")
    lookups: list[torch.Tensor] = []
    with inference_noise(model, config, iteration=2):
        handle = model.get_input_embeddings().register_forward_hook(lambda m, i, out: lookups.append(out.clone()))
        with torch.no_grad():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=4, do_sample=False)
        handle.remove()
    with torch.no_grad():
        plain = noised_inputs_embeds(model, prompts, dataclasses.replace(config, projection="none"), iteration=2)
    assert len(lookups) == 4  # the prompt, then one lookup per new token but the last
    fed = torch.cat([lookup.reshape(-1, HIDDEN) for lookup in lookups])
    assert bool(_is_table_row(fed, table).all())
    assert torch.equal(
        lookups[0].reshape(-1, HIDDEN), table[nearest_rows(plain.reshape(-1, HIDDEN), table, clip_norm=CLIP)]
    )
