"""Noise that overflows the model's numbers is refused naming its setting, not trained on as NaN (issue 36,
finding 5): when the model is built (``make_noisy``, every provider), in an audit sweep, and at run time."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

from nemo_noise_plugin.model import make_noisy
from nemo_noise_plugin.noise.bounds import DeferredFiniteCheck, check_noise_fits, noise_norm_bound
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.schedule import NoiseClock
from nemo_noise_plugin.validation import SettingError
from tests.support.models import build_tiny_gpt, tiny_gpt_config

SQRT_FLOAT32_MAX = math.sqrt(torch.finfo(torch.float32).max)  # 1.84e19: the norm layers square the embeddings


def test_the_bound_is_twice_the_norm_of_the_largest_per_token_noise():
    # uniform, true length: alpha / sqrt(1 * d) per coordinate at most, norm sqrt(d) * that / sqrt(3), times 2
    assert noise_norm_bound(NoiseConfig(alpha=5.0), 64) == pytest.approx(2 * 5.0 / math.sqrt(3))
    assert noise_norm_bound(NoiseConfig(mechanism="gaussian", sigma=3.0, scaling="absolute"), 64) == 2 * 3.0 * 8
    assert noise_norm_bound(NoiseConfig(mechanism="metric_dp", eta=100.0), 64) == pytest.approx(2 * 64 / 100.0)


def test_make_noisy_refuses_an_alpha_whose_noise_is_inf_in_the_norm_layers(megatron_cpu):
    with pytest.raises(SettingError) as refused:
        make_noisy(build_tiny_gpt(), NoiseConfig(alpha=1e30))
    message = str(refused.value)
    assert message.startswith("NoiseConfig.alpha=1e+30 is invalid with mechanism='uniform', hidden_size=")
    assert f"per-token noise norm stays below {SQRT_FLOAT32_MAX:.3g}" in message and "loss NaN." in message


def test_a_metric_dp_eta_this_small_is_refused_naming_eta():
    with pytest.raises(SettingError, match=r"^NoiseConfig.eta=1e-20 is invalid with mechanism='metric_dp'"):
        check_noise_fits(NoiseConfig(mechanism="metric_dp", eta=1e-20), 64)


def test_the_limit_is_the_models_dtype():
    config = NoiseConfig(mechanism="gaussian", sigma=100.0, scaling="absolute")  # norm about 2 * 100 * 8 = 1600
    check_noise_fits(config, 64, torch.float32)
    words = r"hidden_size=64 and float16: expected .* stays below 256 \(this one reaches about 1.6e\+03\)"
    with pytest.raises(SettingError, match=words):
        check_noise_fits(config, 64, torch.float16)


def test_a_run_whose_noised_embeddings_are_not_finite_stops_naming_the_setting():
    """Relative noise scales with each token's embedding, so no bound refuses it: the layer's check stops it."""
    hidden = tiny_gpt_config().hidden_size
    config = NoiseConfig(mechanism="relative", relative_scale=3e38)
    layer = EmbeddingNoise(config, sequence_parallel=False, pg_collection=None, megatron_groups=False)
    embedded = torch.full((4, 2, hidden), 10.0)  # rms 10: noise of about 3e39, inf in float32
    batch = NoiseBatchInputs(
        loss_mask=torch.ones(2, 4), padding_mask=None, input_ids=torch.ones(2, 4, dtype=torch.long)
    )
    clock = NoiseClock()
    clock.start_iteration(7)
    with pytest.raises(SettingError) as stopped:
        layer(embedded, batch, clock)
    assert str(stopped.value) == (
        "NoiseConfig.relative_scale=3e+38 is invalid with mechanism='relative': expected a noise level whose noised "
        "embeddings stay finite: at iteration 7 they hold inf or NaN; training stopped."
    )


def test_the_training_models_layer_defers_the_check_and_still_stops_at_once_on_the_cpu(megatron_cpu):
    """The model's layer reads the check without a GPU sync (``DeferredFiniteCheck``); CPU tensors need no
    deferral, so a CPU run stops at the iteration itself, as before."""
    model = make_noisy(build_tiny_gpt(), NoiseConfig(mechanism="relative", relative_scale=3e38))
    assert isinstance(model.noise_layer.finite_check, DeferredFiniteCheck)
    embedded = torch.full((4, 2, model.config.hidden_size), 10.0)
    batch = NoiseBatchInputs(loss_mask=torch.ones(2, 4), input_ids=torch.ones(2, 4, dtype=torch.long))
    clock = NoiseClock()
    clock.start_iteration(3)
    with pytest.raises(SettingError, match="at iteration 3 they hold inf or NaN; training stopped"):
        model.noise_layer(embedded, batch, clock)
    assert model.noise_layer.finite_check.queued_iterations == []


def test_a_copied_layer_gets_its_own_empty_deferred_check():
    """The distillation teacher is a deep copy of the student: CUDA events do not copy, and a copy owes no checks."""
    layer = EmbeddingNoise(NoiseConfig(), sequence_parallel=False, pg_collection=None, defer_finite_check=True)
    copied = copy.deepcopy(layer)
    restored = pickle.loads(pickle.dumps(layer))
    for other in (copied, restored):
        assert isinstance(other.finite_check, DeferredFiniteCheck) and other.finite_check is not layer.finite_check
        assert other.finite_check.queued_iterations == []
    assert EmbeddingNoise(NoiseConfig(), sequence_parallel=False, pg_collection=None).finite_check is None


def test_an_audit_sweep_refuses_a_level_that_would_write_nan_rows():
    from nemo_noise_plugin.privacy.audit.sweep import audit_sweep, parse_sweeps

    table = torch.randn(32, 16)
    with pytest.raises(SettingError, match=r"^NoiseConfig.alpha=1e\+30 is invalid"):
        audit_sweep(
            table,
            torch.randint(0, 32, (2, 8)),
            NoiseConfig(),
            parse_sweeps("alpha:5,1e30", "uniform"),
            loss_mask=torch.ones(2, 8),
        )


def test_an_audit_sweep_with_only_the_direction_attack_on_a_non_clipping_level_names_it():
    """attacks=direction on uniform noise (no clipping) was reported as ``attacks=[] is invalid``."""
    from nemo_noise_plugin.privacy.audit.sweep import audit_sweep, parse_sweeps

    with pytest.raises(
        ValueError,
        match=r"^attacks includes 'direction' but the noise config \(mechanism='uniform'.*"
        r"does not clip: expected a clipped mechanism",
    ):
        audit_sweep(
            torch.randn(32, 16),
            torch.randint(0, 32, (2, 8)),
            NoiseConfig(),
            parse_sweeps("alpha:5", "uniform"),
            ("direction",),
            loss_mask=torch.ones(2, 8),
        )


@pytest.mark.parametrize(
    ("count", "lengths"),
    [(2, [2]), (65, [64, 2]), (129, [64, 64, 2]), (128, [64, 64]), (10, [10])],
)
def test_take_tokens_takes_a_two_token_last_piece_where_one_token_is_left(count, lengths):
    """tokens=65 / 129 at max_length 64 said the corpus "has only 64 tokens": a 1-token remainder was dropped."""
    from nemo_noise_plugin.jobs.audit.data import take_tokens

    pieces = take_tokens([list(range(100))] * 5, count, 64)
    assert [len(piece) for piece in pieces] == lengths


def test_take_tokens_refuses_fewer_than_two_tokens():
    """tokens=1 said the corpus "has only 0 tokens"."""
    from nemo_noise_plugin.jobs.audit.data import take_tokens

    with pytest.raises(ValueError, match=r"^tokens=1 is invalid: expected at least 2"):
        take_tokens([list(range(100))], 1, 64)
