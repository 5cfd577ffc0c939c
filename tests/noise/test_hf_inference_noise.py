"""Inference-time noise on a Hugging Face model: the Megatron layer's noise, its scale, KV-cache decoding, padding."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_noise_plugin.model import NoisyGPTModel
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.families import NOISE_FAMILIES
from nemo_noise_plugin.noise.hf_inference import EmbeddingNoiseHook, inference_noise, noised_inputs_embeds
from nemo_noise_plugin.privacy.audit.noised import noised_embeddings
from tests.support.models import build_tiny_gpt, causal_attention_mask

VOCAB, HIDDEN = 256, 64
PAD = 0

CASES: dict[str, dict] = {
    "uniform": dict(mechanism="uniform", alpha=5.0),
    "uniform_padded_response": dict(
        mechanism="uniform", alpha=5.0, scaling="padded_length", tokens="response", special_token_ids=[7]
    ),
    "gaussian_warmup": dict(mechanism="gaussian", sigma=2.0, scaling="absolute", warmup_steps=8),
    "gaussian_embedding_distance": dict(
        mechanism="gaussian",
        scaling="embedding_distance",
        embedding_distance=0.5,
        distance_multiple=2.0,
        tokens="prompt",
    ),
    "metric_dp": dict(mechanism="metric_dp", eta=5.0, clip_norm=4.0),
    "gaussian_mechanism": dict(mechanism="gaussian_mechanism", epsilon=2.0, clip_norm=4.0),
    "quantization": dict(mechanism="quantization", quantization_step=0.5),
    "relative": dict(mechanism="relative", relative_scale=0.3),
    "laplace": dict(mechanism="laplace", laplace_scale=0.2, clip_norm=4.0),
}
"""One inference case per family at least (norms of the table's rows straddle ``clip_norm=4``)."""

GENERATION_NOISE = NoiseConfig(mechanism="gaussian", sigma=0.05, scaling="absolute", seed=99)


def _config(case: str, **overrides) -> NoiseConfig:
    return NoiseConfig(**{**CASES[case], "training_only": False, "seed": 4321, **overrides})


def _table(seed: int = 0) -> torch.Tensor:
    """``[V, h]`` rows of norms from about 1.6 to 16, so clipping to 4 binds on some tokens and not on others."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(VOCAB, HIDDEN, generator=generator)
    return rows * torch.linspace(0.2, 2.0, VOCAB).unsqueeze(1)


def _llama(table: torch.Tensor | None = None):
    """A tiny LlamaForCausalLM (eval mode), its input embedding set to ``table`` when given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    if table is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(table)
    return model


def _right_padded_batch():
    """Token ids ``[3, 16]`` of true lengths 16, 11 and 5 (padding ``PAD``), their padding and loss masks."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 16), generator=generator)
    ids[0, 2] = ids[1, 9] = 7  # special_token_ids of one case
    padding = torch.zeros(3, 16, dtype=torch.bool)
    loss_mask = torch.zeros(3, 16)
    for row, length in enumerate((16, 11, 5)):
        padding[row, length:] = True
        ids[row, length:] = PAD
        loss_mask[row, 3 : length - 1] = 1.0
    return ids, padding, loss_mask


def _left_padded(ids: torch.Tensor, padding: torch.Tensor, loss_mask: torch.Tensor):
    """The same rows with their padding moved to the left (real tokens right-aligned)."""
    shifts = padding.sum(dim=1)
    roll = [torch.roll(row, int(k)) for row, k in zip(ids, shifts, strict=True)]
    roll_pad = [torch.roll(row, int(k)) for row, k in zip(padding, shifts, strict=True)]
    roll_loss = [torch.roll(row, int(k)) for row, k in zip(loss_mask, shifts, strict=True)]
    return torch.stack(roll), torch.stack(roll_pad), torch.stack(roll_loss)


def _megatron_decoder_input(config: NoiseConfig, table, ids, padding, loss_mask, iteration) -> torch.Tensor:
    """The ``[b, s, h]`` input a real Megatron-Core NoisyGPTModel's decoder gets in a forward (training_only=False)."""
    model = build_tiny_gpt(model_class=NoisyGPTModel, noise_config=config).eval()
    with torch.no_grad():
        model.embedding.word_embeddings.weight.copy_(table)
    model.noise_clock.start_iteration(iteration)
    seen = []
    handle = model.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("hidden_states", args[0] if args else None)),
        with_kwargs=True,
    )
    position_ids = torch.arange(ids.size(1)).unsqueeze(0).expand_as(ids)
    with torch.no_grad(), model.noise_batch_inputs(padding_mask=padding):
        model(ids, position_ids, causal_attention_mask(ids.size(1)), loss_mask=loss_mask)
    handle.remove()
    return seen[0].transpose(0, 1)


def _capture_lookups(model) -> tuple[list[torch.Tensor], object]:
    """Record every (already noised) embedding lookup of ``model``; returns the list and the hook handle."""
    seen: list[torch.Tensor] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, out: seen.append(out.detach().clone()))
    return seen, handle


def _clean(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.get_input_embeddings()(ids)


# (a) the Megatron layer's noise


def test_every_noise_family_has_an_inference_case():
    assert {case["mechanism"] for case in CASES.values()} == set(NOISE_FAMILIES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_noised_inputs_embeds_equal_the_megatron_decoder_input_bit_for_bit(megatron_cpu, case):
    config, table = _config(case), _table()
    ids, padding, loss_mask = _right_padded_batch()
    expected = _megatron_decoder_input(config, table, ids, padding, loss_mask, iteration=3)
    with torch.no_grad():
        got = noised_inputs_embeds(
            _llama(table), ids, config, attention_mask=~padding, loss_mask=loss_mask, iteration=3
        )
    assert not torch.equal(got, _clean(_llama(table), ids))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_left_padding_gives_the_same_tokens_the_noise_of_the_right_padded_batch(case):
    config, table = _config(case), _table()
    ids, padding, loss_mask = _right_padded_batch()
    expected = noised_embeddings(table, ids, config, iteration=5, loss_mask=loss_mask, padding_mask=padding)
    left_ids, left_padding, left_loss = _left_padded(ids, padding, loss_mask)
    model = _llama(table)
    with torch.no_grad():
        got = noised_inputs_embeds(
            model, left_ids, config, attention_mask=(~left_padding).long(), loss_mask=left_loss, iteration=5
        )
    assert torch.equal(got[~left_padding], expected[~padding])
    assert torch.equal(got[left_padding], _clean(model, left_ids)[left_padding])


def test_position_offset_continues_the_whole_sequence_per_row():
    model, config = _llama(_table()), _config("gaussian_mechanism")
    ids, padding, _ = _left_padded(*_right_padded_batch())
    mask = (~padding).long()
    whole = noised_inputs_embeds(model, ids, config, attention_mask=mask, iteration=2)
    before = mask[:, :12].sum(dim=1)  # each row's real tokens before column 12
    tail = noised_inputs_embeds(
        model, ids[:, 12:], config, attention_mask=mask[:, 12:], position_offset=before, iteration=2
    )
    restarted = noised_inputs_embeds(model, ids[:, 12:], config, attention_mask=mask[:, 12:], iteration=2)
    assert torch.equal(tail, whole[:, 12:])
    assert not torch.allclose(restarted, whole[:, 12:])


# (b) distribution and scale


def _noise_sample(config: NoiseConfig, rows: int = 4, length: int = 1024, mask=None) -> torch.Tensor:
    """``[rows, length, h]`` drawn noise: the output on a zero embedding table (nothing to clip, nothing to add)."""
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return noised_inputs_embeds(_llama(torch.zeros(VOCAB, HIDDEN)), ids, config, attention_mask=mask)


def test_gaussian_mechanism_noise_std_is_the_calibrated_sigma():
    config = NoiseConfig(mechanism="gaussian_mechanism", epsilon=3.0, clip_norm=1.0)
    noise = _noise_sample(config)
    # the analytic Gaussian mechanism at (3, 1e-5) and sensitivity 2C = 2; the classical bound would be 3.23
    assert config.dp_sigma == pytest.approx(2.7812, rel=1e-3)
    assert noise.std().item() == pytest.approx(config.dp_sigma, rel=0.01)
    assert noise.mean().item() == pytest.approx(0.0, abs=0.01)


def test_metric_dp_noise_mean_norm_is_d_over_eta():
    config = NoiseConfig(mechanism="metric_dp", eta=20.0)
    norms = _noise_sample(config).norm(dim=-1)
    assert norms.mean().item() == pytest.approx(HIDDEN / 20.0, rel=0.01)  # E|z| = d / eta = 3.2
    assert norms.std().item() == pytest.approx(math.sqrt(HIDDEN) / 20.0, rel=0.05)  # Gamma(d, 1/eta)


def test_laplace_noise_has_scale_b():
    noise = _noise_sample(NoiseConfig(mechanism="laplace", laplace_scale=0.3))
    assert noise.abs().mean().item() == pytest.approx(0.3, rel=0.01)
    assert noise.std().item() == pytest.approx(0.3 * math.sqrt(2.0), rel=0.015)


def test_uniform_true_length_noise_is_neftune_sized_by_each_rows_real_length():
    lengths = (1024, 256)
    mask = torch.zeros(2, 1024, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, -length:] = 1  # left padding
    noise = _noise_sample(NoiseConfig(mechanism="uniform", alpha=5.0), rows=2, mask=mask)
    for row, length in enumerate(lengths):
        bound = 5.0 / math.sqrt(length * HIDDEN)
        real = noise[row, -length:]
        assert real.abs().max().item() <= bound
        assert real.std().item() == pytest.approx(bound / math.sqrt(3.0), rel=0.02)
        assert torch.count_nonzero(noise[row, :-length]) == 0


@pytest.mark.parametrize("mechanism", ["gaussian_mechanism", "metric_dp", "laplace"])
def test_privacy_mechanisms_clip_each_token_to_clip_norm_before_the_noise(mechanism):
    quiet = dict(gaussian_mechanism=dict(epsilon=1e8), metric_dp=dict(eta=1e5), laplace=dict(laplace_scale=1e-5))
    config = NoiseConfig(mechanism=mechanism, clip_norm=4.0, **quiet[mechanism])
    model = _llama(_table())
    ids = torch.arange(VOCAB).view(4, -1)
    with torch.no_grad():
        norms = noised_inputs_embeds(model, ids, config).norm(dim=-1)
    clean_norms = _clean(model, ids).norm(dim=-1)
    assert (clean_norms > 4.0).any() and (clean_norms < 4.0).any()
    assert torch.allclose(norms, clean_norms.clamp_max(4.0), atol=0.01)


# (c) KV-cache generation


def _prompts():
    """Two prompts, the second left-padded by 3 (as a tokenizer with padding_side='left' gives them)."""
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 7, dtype=torch.long)
    ids[1, :3], mask[1, :3] = PAD, 0
    return ids, mask


def _generate(model, ids, mask, new_tokens: int = 6):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD)


@torch.no_grad()
def _full_recompute_greedy(model, ids, mask, config, iteration, new_tokens: int = 6):
    """Greedy decoding without a cache: every step feeds the whole sequence through noised_inputs_embeds."""
    for _ in range(new_tokens):
        embeds = noised_inputs_embeds(model, ids, config, attention_mask=mask, iteration=iteration)
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        logits = model(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids, mask


def test_greedy_generate_with_the_hook_equals_a_full_recompute_loop_with_noised_inputs_embeds():
    model = _llama()
    ids, mask = _prompts()
    with torch.no_grad():
        clean_out = _generate(model, ids, mask)
    with inference_noise(model, GENERATION_NOISE, iteration=11) as hook:
        seen, handle = _capture_lookups(model)
        with torch.no_grad():
            out = _generate(model, ids, mask)
        handle.remove()
    assert hook.iteration == 11 and hook.next_iteration == 12
    expected, full_mask = _full_recompute_greedy(model, ids, mask, GENERATION_NOISE, iteration=11)
    assert torch.equal(out, expected)
    assert not torch.equal(out, clean_out)  # the noise changes what is generated
    whole = noised_inputs_embeds(
        model, expected[:, :-1], GENERATION_NOISE, attention_mask=full_mask[:, :-1], iteration=11
    )
    assert len(seen) == 6 and torch.equal(seen[0], whole[:, :7])
    for step, lookup in enumerate(seen[1:]):
        assert torch.equal(lookup[:, 0], whole[:, 7 + step])


def test_a_token_fed_at_cache_position_p_gets_the_noise_of_position_p_not_of_position_0():
    from transformers import DynamicCache

    model = _llama()
    ids, _ = _prompts()
    with inference_noise(model, GENERATION_NOISE) as hook, torch.no_grad():
        seen, handle = _capture_lookups(model)
        cache = DynamicCache(config=model.config)
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        model(ids[:, 5:6], past_key_values=cache, use_cache=True)
        handle.remove()
    assert hook.iteration == 0
    whole = noised_inputs_embeds(model, ids[:, :6], GENERATION_NOISE)
    restarted = noised_inputs_embeds(model, ids[:, 5:6], GENERATION_NOISE)
    assert torch.equal(seen[1], whole[:, 5:6])
    assert not torch.allclose(seen[1], restarted)


def test_each_generate_call_gets_fresh_noise_and_the_same_seed_reproduces_it():
    model = _llama()
    ids, mask = _prompts()

    def prompt_lookups(config, calls: int) -> list[torch.Tensor]:
        with inference_noise(model, config):
            seen, handle = _capture_lookups(model)
            with torch.no_grad():
                for _ in range(calls):
                    _generate(model, ids, mask, new_tokens=2)
            handle.remove()
        return seen[::2]  # each call's prefill lookup

    first, second = prompt_lookups(GENERATION_NOISE, calls=2)
    (again,) = prompt_lookups(GENERATION_NOISE, calls=1)
    (other_seed,) = prompt_lookups(NoiseConfig(**{**vars(GENERATION_NOISE), "seed": 100}), calls=1)
    real = mask.bool()
    assert not torch.allclose(first[real], second[real])
    assert torch.equal(first, again)
    assert not torch.allclose(first[real], other_seed[real])


def test_plain_forward_batches_get_fresh_iterations_and_detach_restores_the_clean_lookup():
    model = _llama()
    ids, mask = _prompts()
    hook = EmbeddingNoiseHook(GENERATION_NOISE, iteration=4).attach(model)
    seen, handle = _capture_lookups(model)
    with torch.no_grad():
        model(ids, attention_mask=mask)
        model(ids, attention_mask=mask)
    assert hook.next_iteration == 6
    hook.detach()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    handle.remove()
    for iteration, lookup in zip((4, 5), seen[:2], strict=True):
        expected = noised_inputs_embeds(model, ids, GENERATION_NOISE, attention_mask=mask, iteration=iteration)
        assert torch.equal(lookup, expected)
    assert not hook.attached and torch.equal(seen[2], _clean(model, ids))


def test_tokens_response_in_generate_noises_the_generated_tokens_and_not_the_prompt():
    config = NoiseConfig(**{**vars(GENERATION_NOISE), "tokens": "response"})
    model = _llama()
    ids, mask = _prompts()
    with inference_noise(model, config), torch.no_grad():
        seen, handle = _capture_lookups(model)
        out = _generate(model, ids, mask, new_tokens=4)
        handle.remove()
    assert torch.equal(seen[0], _clean(model, ids))
    full_mask = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
    loss_mask = torch.zeros_like(full_mask)
    loss_mask[:, 6:] = 1  # from the prompt's last token on
    whole = noised_inputs_embeds(model, out[:, :-1], config, attention_mask=full_mask, loss_mask=loss_mask)
    assert not torch.equal(whole[:, 7:], _clean(model, out[:, 7:-1]))
    for step, lookup in enumerate(seen[1:]):
        assert torch.equal(lookup[:, 0], whole[:, 7 + step])


# (d) padding


def test_padding_is_never_noised_by_noised_inputs_embeds_or_the_hook():
    model, config = _llama(_table()), _config("laplace")
    ids, padding, _ = _right_padded_batch()
    for batch_ids, batch_padding in ((ids, padding), _left_padded(ids, padding, torch.zeros(3, 16))[:2]):
        clean = _clean(model, batch_ids)
        got = noised_inputs_embeds(model, batch_ids, config, attention_mask=(~batch_padding).long())
        assert torch.equal(got[batch_padding], clean[batch_padding])
        assert (got[~batch_padding] != clean[~batch_padding]).all(dim=-1).all()
        with inference_noise(model, config), torch.no_grad():
            seen, handle = _capture_lookups(model)
            model(batch_ids, attention_mask=(~batch_padding).long())
            handle.remove()
        assert torch.equal(seen[0][batch_padding], clean[batch_padding])
        assert torch.equal(seen[0], got)


# (e) bad input


def test_a_noise_config_that_is_not_a_noise_config_is_a_clear_error():
    model = _llama()
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"noise_config=\{'mechanism': 'gaussian'\} is invalid: expected a .*NoiseConfig"
    ):
        noised_inputs_embeds(model, ids, {"mechanism": "gaussian"})
    with pytest.raises(ValueError, match="noise_config=None is invalid: expected a .*NoiseConfig"):
        EmbeddingNoiseHook(None)


def test_a_model_without_get_input_embeddings_is_a_clear_error():
    with pytest.raises(ValueError, match=r"model=Linear is invalid: expected a Hugging Face .*get_input_embeddings"):
        noised_inputs_embeds(torch.nn.Linear(2, 2), torch.ones(1, 4, dtype=torch.long), GENERATION_NOISE)
    with pytest.raises(ValueError, match="model=Linear is invalid"):
        EmbeddingNoiseHook(GENERATION_NOISE).attach(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(input_ids=torch.ones(4, dtype=torch.long)), r"input_ids has shape \[4\]: expected an integer \[b, s\]"),
        (dict(input_ids=torch.ones(1, 4)), r"input_ids has shape \[1, 4\]: expected an integer \[b, s\]"),
        (
            dict(input_ids=torch.full((1, 4), VOCAB)),
            r"input_ids has values in \[256, 256\]: expected ids in \[0, 255\]",
        ),
        (
            dict(attention_mask=torch.ones(1, 5)),
            r"attention_mask has shape \[1, 5\]: expected input_ids's shape \[1, 4\]",
        ),
        (dict(loss_mask=torch.ones(2, 4)), r"loss_mask has shape \[2, 4\]: expected input_ids's shape \[1, 4\]"),
        (dict(iteration=-1), r"iteration=-1 is invalid: expected an integer >= 0 and <= 4294967295"),
        (dict(position_offset=-2), r"position_offset=-2 is invalid: expected an integer >= 0"),
        (dict(position_offset=torch.tensor([1, 2])), r"position_offset has shape \[2\]: expected .* a \[1\] integer"),
    ],
)
def test_bad_arguments_of_noised_inputs_embeds_name_the_argument_the_value_and_what_is_allowed(kwargs, message):
    arguments = {"input_ids": torch.ones(1, 4, dtype=torch.long), **kwargs}
    with pytest.raises(ValueError, match=message):
        noised_inputs_embeds(_llama(), noise_config=GENERATION_NOISE, **arguments)


@pytest.mark.parametrize("scaling", ["true_length", "padded_length"])
def test_length_scaled_noise_needs_whole_sequences(scaling):
    config = NoiseConfig(mechanism="uniform", alpha=5.0, scaling=scaling)
    with pytest.raises(ValueError, match=f"scaling='{scaling}' is invalid for EmbeddingNoiseHook.*'absolute'"):
        EmbeddingNoiseHook(config)
    with pytest.raises(ValueError, match=f"position_offset=3 is invalid with NoiseConfig.scaling='{scaling}'"):
        noised_inputs_embeds(_llama(), torch.ones(1, 4, dtype=torch.long), config, position_offset=3)


def test_prompt_or_response_tokens_need_the_loss_mask_of_whole_sequences():
    config = NoiseConfig(**{**vars(GENERATION_NOISE), "tokens": "prompt"})
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="loss_mask=None is invalid with NoiseConfig.tokens='prompt'"):
        noised_inputs_embeds(_llama(), ids, config)
    with pytest.raises(ValueError, match="position_offset=1 is invalid with NoiseConfig.tokens='prompt'"):
        noised_inputs_embeds(_llama(), ids, config, loss_mask=torch.ones(1, 4), position_offset=1)


def test_the_hook_refuses_a_second_attach_a_partial_mask_and_a_lookup_outside_the_forward():
    model = _llama()
    ids, mask = _prompts()
    with inference_noise(model, GENERATION_NOISE) as hook:
        with pytest.raises(ValueError, match="already attached to LlamaForCausalLM: detach"):
            hook.attach(model)
        with pytest.raises(ValueError, match=r"attention_mask has shape \[2, 3\]: .*\[2, 0 \+ 7\]"):
            model(ids, attention_mask=mask[:, :3])
        with pytest.raises(RuntimeError, match="looked up outside a forward .*detach"):
            noised_inputs_embeds(model, ids, GENERATION_NOISE)
