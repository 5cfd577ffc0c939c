"""The noisy GPT model on real Megatron-Core: where noise goes, how large it is, and what stays untouched."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from nemo_noise_plugin.model import NoiseInjectionMixin, NoisyGPTModel, make_noisy
from nemo_noise_plugin.noise.config import NoiseConfig
from tests.support.models import build_tiny_gpt, tiny_gpt_config

HIDDEN = 64


def _pair(noise: NoiseConfig, **kwargs):
    """A plain GPTModel and a NoisyGPTModel with identical weights."""
    torch.manual_seed(7)
    plain = build_tiny_gpt(**kwargs)
    noisy = build_tiny_gpt(model_class=NoisyGPTModel, noise_config=noise, **kwargs)
    noisy.load_state_dict(plain.state_dict())
    return plain, noisy


def _noise_of(model, batch, use_loss_mask: bool = True) -> torch.Tensor:
    """The noise ``_preprocess`` adds for one forward: noised decoder input minus the clean embedding."""
    with torch.no_grad(), model.noise_batch_inputs(batch["loss_mask"] if use_loss_mask else None):
        noised = model._preprocess(input_ids=batch["input_ids"], position_ids=batch["position_ids"])[0]
        clean = model.embedding(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    return noised - clean


def _loss(model, batch, **overrides):
    kwargs = dict(labels=batch["labels"], loss_mask=batch["loss_mask"])
    kwargs.update(overrides)
    per_token = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], **kwargs)
    return (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def test_forward_and_backward_with_noise(megatron_cpu, batch):
    _, noisy = _pair(NoiseConfig(alpha=10.0))
    loss = _loss(noisy, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert noisy.embedding.word_embeddings.weight.grad.abs().sum() > 0
    assert noisy.noise_step == 1


def test_uniform_noise_is_bounded_by_alpha_over_sqrt_true_length_times_hidden(megatron_cpu, batch):
    alpha = 10.0
    _, noisy = _pair(NoiseConfig(alpha=alpha, scaling="true_length"))
    noise = _noise_of(noisy, batch)  # [s, b, h]
    for row, length in enumerate(batch["true_lengths"].int().tolist()):
        bound = alpha / math.sqrt(length * HIDDEN)
        values = noise[:length, row, :].flatten()
        assert torch.count_nonzero(noise[length:, row, :]) == 0, "padding is never noised"
        assert values.abs().max() <= bound * (1 + 1e-5)
        assert values.abs().max() >= 0.99 * bound
        # U(-m, m): mean 0, std m/sqrt(3); 4096 samples give a standard error of ~1.1% on the std.
        assert abs(values.mean().item()) < 0.05 * bound
        assert values.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)


def test_true_length_scaling_differs_from_padded_length_on_padded_rows(megatron_cpu, batch):
    _, true_length = _pair(NoiseConfig(alpha=5.0, scaling="true_length"))
    _, padded = _pair(NoiseConfig(alpha=5.0, scaling="padded_length"))
    true_std = _noise_of(true_length, batch).pow(2).sum(dim=(0, 2))
    padded_std = _noise_of(padded, batch).pow(2).sum(dim=(0, 2))
    # Same seed, same unit draws: the ratio is exactly sqrt(S / L) per sequence.
    expected = torch.sqrt(64.0 / batch["true_lengths"])
    assert torch.allclose(torch.sqrt(true_std / padded_std), expected, rtol=1e-4)


def test_padded_length_matches_hf_transformers_neftune_magnitude(megatron_cpu, batch):
    alpha = 15.0
    _, noisy = _pair(NoiseConfig(alpha=alpha, scaling="padded_length"))
    noise = _noise_of(noisy, batch)
    seq, _, hidden = noise.shape
    hf_magnitude = alpha / math.sqrt(seq * hidden)  # transformers' neftune_post_forward_hook on [b, s, h]
    assert noise.abs().amax(dim=(0, 2)).min() >= 0.99 * hf_magnitude
    assert noise.abs().max() <= hf_magnitude * (1 + 1e-5)


def test_gaussian_noise_std_is_sigma_over_sqrt_true_length_times_hidden(megatron_cpu, batch):
    sigma = 2.0
    _, noisy = _pair(NoiseConfig(mechanism="gaussian", sigma=sigma))
    noise = _noise_of(noisy, batch)
    for row, length in enumerate(batch["true_lengths"].int().tolist()):
        values = noise[:length, row, :].flatten()
        assert values.std().item() == pytest.approx(sigma / math.sqrt(length * HIDDEN), rel=0.05)
        assert abs(values.mean().item()) < 0.05 * values.std().item()


def test_absolute_scaling_uses_the_magnitude_directly(megatron_cpu, batch):
    _, noisy = _pair(NoiseConfig(alpha=0.3, scaling="absolute"))
    noise = _noise_of(noisy, batch, use_loss_mask=False)
    assert noise.abs().max() <= 0.3 * (1 + 1e-5)
    assert noise.std().item() == pytest.approx(0.3 / math.sqrt(3), rel=0.03)


def test_true_length_without_a_mask_is_a_clear_error(megatron_cpu, batch):
    _, noisy = _pair(NoiseConfig(scaling="true_length"))
    with pytest.raises(ValueError, match="scaling='true_length' needs the batch's loss_mask or padding_mask"):
        _noise_of(noisy, batch, use_loss_mask=False)


def test_padding_mask_gives_the_true_length(megatron_cpu, batch):
    _, noisy = _pair(NoiseConfig(alpha=10.0))
    padding_mask = batch["loss_mask"] == 0
    with torch.no_grad():
        noised = noisy._preprocess(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], padding_mask=padding_mask
        )[0]
        clean = noisy.embedding(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    bounds = 10.0 / torch.sqrt(batch["true_lengths"] * HIDDEN)
    assert torch.allclose((noised - clean).abs().amax(dim=(0, 2)), bounds, rtol=0.01)


def test_eval_mode_is_clean_and_equals_the_plain_model(megatron_cpu, batch):
    plain, noisy = _pair(NoiseConfig(alpha=15.0))
    plain.eval()
    noisy.eval()
    with torch.no_grad():
        assert torch.equal(_loss(noisy, batch), _loss(plain, batch))
    assert noisy.noise_step == 0


def test_training_only_false_adds_noise_in_eval(megatron_cpu, batch):
    plain, noisy = _pair(NoiseConfig(alpha=15.0, training_only=False))
    plain.eval()
    noisy.eval()
    with torch.no_grad():
        assert not torch.equal(_loss(noisy, batch), _loss(plain, batch))
    assert noisy.noise_step == 0, "evaluation forwards do not advance the training noise clock"


@pytest.mark.parametrize("config", [NoiseConfig(enabled=False), NoiseConfig(alpha=0.0)])
def test_disabled_or_zero_noise_trains_exactly_like_the_plain_model(megatron_cpu, batch, config):
    plain, noisy = _pair(config)
    plain_loss, noisy_loss = _loss(plain, batch), _loss(noisy, batch)
    plain_loss.backward()
    noisy_loss.backward()
    assert torch.equal(plain_loss, noisy_loss)
    for a, b in zip(plain.parameters(), noisy.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_gradients_reach_the_embedding_through_the_noise(megatron_cpu, batch):
    """The noisy model's gradients equal those of a plain model fed embedding + the same noise."""
    plain, noisy = _pair(NoiseConfig(alpha=10.0))
    noise = _noise_of(noisy, batch)  # draws step 0
    noisy.noise_clock.start_iteration(0)
    _loss(noisy, batch).backward()

    embedded = plain.embedding(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    _loss(plain, batch, decoder_input=embedded + noise).backward()

    expected = plain.embedding.word_embeddings.weight.grad
    actual = noisy.embedding.word_embeddings.weight.grad
    assert expected.abs().sum() > 0
    assert torch.allclose(actual, expected, rtol=1e-4, atol=1e-7)


def test_fixed_seed_gives_identical_noise_and_steps_and_seeds_differ(megatron_cpu, batch):
    _, first = _pair(NoiseConfig(alpha=5.0, seed=11))
    _, second = _pair(NoiseConfig(alpha=5.0, seed=11))
    _, other_seed = _pair(NoiseConfig(alpha=5.0, seed=12))
    step0_first, step0_second = _noise_of(first, batch), _noise_of(second, batch)
    assert torch.equal(step0_first, step0_second)
    assert not torch.equal(step0_first, _noise_of(other_seed, batch))
    first.noise_clock.start_iteration(1)
    assert not torch.equal(step0_first, _noise_of(first, batch))


def test_caller_supplied_decoder_input_is_never_noised(megatron_cpu, batch):
    plain, noisy = _pair(NoiseConfig(alpha=15.0))
    decoder_input = torch.randn(64, 4, HIDDEN)
    with torch.no_grad():
        expected = _loss(plain, batch, decoder_input=decoder_input)
        assert torch.equal(_loss(noisy, batch, decoder_input=decoder_input), expected)
    assert noisy.noise_step == 0


def test_non_first_pipeline_stage_is_never_noised(megatron_cpu, batch):
    plain, noisy = _pair(NoiseConfig(alpha=15.0), pre_process=False)
    hidden = torch.randn(64, 4, HIDDEN)
    with torch.no_grad():
        plain.set_input_tensor(hidden)
        noisy.set_input_tensor(hidden)
        assert torch.equal(_loss(noisy, batch), _loss(plain, batch))
    assert noisy.noise_step == 0


@pytest.mark.parametrize("in_lookup", [True, False], ids=["noise_in_lookup", "noise_on_output"])
def test_noise_applied_exactly_once_per_forward_and_not_to_mtp_embeddings(megatron_cpu, batch, in_lookup):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    config = tiny_gpt_config(mtp_num_layers=1)
    mtp_spec = get_gpt_mtp_block_spec(config, get_gpt_layer_local_spec(), use_transformer_engine=False)
    model = build_tiny_gpt(
        config, model_class=NoisyGPTModel, noise_config=NoiseConfig(alpha=5.0), mtp_block_spec=mtp_spec
    )
    model.fuse_noise_into_lookup = in_lookup
    calls = []
    layer = model.noise_layer

    class CountingNoise:
        def __call__(self, decoder_input, noise_batch, step):
            calls.append(("output", decoder_input.shape))
            return layer(decoder_input, noise_batch, step)

        def noised_lookup(self, weight, input_ids, noise_batch, step):
            noised = layer.noised_lookup(weight, input_ids, noise_batch, step)
            calls.append(("lookup", noised.shape))
            return noised

    model.noise_layer = CountingNoise()
    _loss(model, batch).backward()
    assert calls == [("lookup" if in_lookup else "output", torch.Size([64, 4, HIDDEN]))]


def test_state_dict_keys_match_and_weights_load_both_ways(megatron_cpu, batch):
    plain, noisy = _pair(NoiseConfig(alpha=5.0))
    assert list(plain.state_dict()) == list(noisy.state_dict())
    assert plain.sharded_state_dict().keys() == noisy.sharded_state_dict().keys()

    fresh_plain = build_tiny_gpt()
    fresh_plain.load_state_dict(noisy.state_dict(), strict=True)
    fresh_noisy = build_tiny_gpt(model_class=NoisyGPTModel, noise_config=NoiseConfig())
    fresh_noisy.load_state_dict(plain.state_dict(), strict=True)
    for model in (plain, fresh_plain, fresh_noisy):
        model.eval()
    with torch.no_grad():
        reference = _loss(plain, batch)
        assert torch.equal(_loss(fresh_plain, batch), reference)
        assert torch.equal(_loss(fresh_noisy, batch), reference)


def test_make_noisy_converts_a_built_model_in_place(megatron_cpu, batch):
    model = build_tiny_gpt()
    parameters = dict(model.named_parameters())
    keys = list(model.state_dict())
    returned = make_noisy(model, NoiseConfig(alpha=10.0))

    assert returned is model and isinstance(model, NoiseInjectionMixin) and isinstance(model, GPTModel)
    assert type(model) is NoisyGPTModel
    assert all(p is parameters[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    assert _noise_of(model, batch).abs().max() > 0
    # An untouched GPTModel keeps its class: nothing global changed.
    assert type(build_tiny_gpt()) is GPTModel


def test_make_noisy_handles_subclasses_and_rejects_other_modules(megatron_cpu):
    class CustomGPT(GPTModel):
        pass

    model = build_tiny_gpt(model_class=CustomGPT)
    make_noisy(model, NoiseConfig())
    assert isinstance(model, CustomGPT) and isinstance(model, NoiseInjectionMixin)
    assert type(model).__name__ == "NoisyCustomGPT"
    make_noisy(model, NoiseConfig(alpha=1.0))
    assert model.noise_config.alpha == 1.0
    with pytest.raises(TypeError, match="make_noisy expects a megatron.core GPTModel"):
        make_noisy(torch.nn.Linear(2, 2), NoiseConfig())
