"""``tokens='spans'`` on the Hugging Face side and in the audit: training's span noise, a private mask per call."""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.hf_inference import EmbeddingNoiseHook, noised_inputs_embeds
from nemo_noise_plugin.privacy.audit import audit, nearest_neighbour_attack, noised_embeddings

VOCAB, HIDDEN, SEQ = 128, 32, 12

CONFIGS = {
    "gaussian_mechanism": NoiseConfig(
        mechanism="gaussian_mechanism", epsilon=3.0, clip_norm=2.0, tokens="spans", training_only=False, seed=5
    ),
    "uniform_true_length": NoiseConfig(alpha=8.0, tokens="spans", training_only=False, seed=6),
}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def _batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, VOCAB, (2, SEQ), generator=generator)
    attention_mask = torch.ones(2, SEQ, dtype=torch.long)
    attention_mask[1, 9:] = 0  # row 1: 9 real tokens, right padding
    input_ids[1, 9:] = 0
    private_mask = torch.zeros(2, SEQ, dtype=torch.bool)
    private_mask[0, 2:5] = True
    private_mask[1, 6:11] = True  # runs into the padding: padding is never noised
    return input_ids, attention_mask, private_mask


@pytest.mark.parametrize("name", list(CONFIGS))
def test_noised_inputs_embeds_give_the_span_tokens_training_noise_and_leave_the_rest_clean(name):
    model, (input_ids, attention_mask, private_mask) = _llama(), _batch()
    config = CONFIGS[name]
    with torch.no_grad():
        embeds = noised_inputs_embeds(
            model, input_ids, config, attention_mask=attention_mask, private_mask=private_mask
        )
        clean = model.get_input_embeddings()(input_ids)
    table = model.get_input_embeddings().weight
    training = noised_embeddings(table, input_ids, config, padding_mask=attention_mask == 0, private_mask=private_mask)
    assert torch.equal(embeds, training.to(embeds.dtype))
    touched = (embeds - clean).abs().amax(dim=-1) > 0
    assert torch.equal(touched, private_mask & (attention_mask == 1))
    assert int(touched.sum()) == 3 + 3


def test_spans_without_a_private_mask_is_a_clear_error():
    model, (input_ids, attention_mask, _) = _llama(), _batch()
    with pytest.raises(ValueError, match=r"private_mask=None is invalid with NoiseConfig.tokens='spans'"):
        noised_inputs_embeds(model, input_ids, CONFIGS["gaussian_mechanism"], attention_mask=attention_mask)
    with pytest.raises(ValueError, match=r"private_mask has shape \[2, 5\]: expected input_ids's shape \[2, 12\]"):
        noised_inputs_embeds(
            model,
            input_ids,
            CONFIGS["gaussian_mechanism"],
            attention_mask=attention_mask,
            private_mask=torch.zeros(2, 5, dtype=torch.bool),
        )


def test_the_hook_noises_the_prompt_spans_of_its_private_mask_and_no_generated_token():
    model, (input_ids, _, private_mask) = _llama(), _batch()
    input_ids, private_mask = input_ids[:1], private_mask[:1]  # one unpadded row
    config = NoiseConfig(mechanism="gaussian", sigma=0.5, scaling="absolute", tokens="spans", seed=2)
    hook = EmbeddingNoiseHook(config, iteration=7).attach(model)
    hook.private_mask = private_mask
    lookups = []
    recorder = model.get_input_embeddings().register_forward_hook(lambda m, i, o: lookups.append((i[0], o)))
    try:
        with torch.no_grad():
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=3, do_sample=False)
    finally:
        recorder.remove()
        hook.detach()
    (prompt_ids, prompt), *generated = lookups
    with torch.no_grad():
        expected = noised_inputs_embeds(model, input_ids, config, iteration=7, private_mask=private_mask)
        assert torch.equal(prompt, expected)
        assert len(generated) == 2
        for ids, embeds in generated:  # cached decoding: one new token a forward, never private
            assert torch.equal(embeds, model.get_input_embeddings()(ids))


def test_the_hook_without_a_private_mask_under_spans_is_a_clear_error():
    model, (input_ids, _, _) = _llama(), _batch()
    config = NoiseConfig(mechanism="gaussian", sigma=0.5, scaling="absolute", tokens="spans")
    hook = EmbeddingNoiseHook(config).attach(model)
    try:
        with pytest.raises(ValueError, match=r"EmbeddingNoiseHook.private_mask has shape None"), torch.no_grad():
            model(input_ids)
    finally:
        hook.detach()


def test_the_audit_counts_recovery_on_the_span_tokens_only():
    model, (input_ids, attention_mask, private_mask) = _llama(), _batch()
    table = model.get_input_embeddings().weight.detach()
    config = NoiseConfig(mechanism="gaussian_mechanism", epsilon=0.5, clip_norm=1.0, tokens="spans", seed=5)
    padding = attention_mask == 0
    report = audit(table, input_ids, config, ("nn_l2",), padding_mask=padding, private_mask=private_mask)
    protected = private_mask & ~padding
    assert report["tokens"]["real"] == int(protected.sum()) == 6
    noised = noised_embeddings(table, input_ids, config, padding_mask=padding, private_mask=private_mask)
    guesses = nearest_neighbour_attack(noised[protected], table, "l2").ids
    expected = float((guesses == input_ids[protected]).float().mean())
    assert report["attacks"]["nn_l2"]["overall"]["rate"] == pytest.approx(expected)
    assert expected < 1.0  # the clean tokens (all recovered) are not counted
