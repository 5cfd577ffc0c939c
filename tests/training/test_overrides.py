"""Hydra-style overrides through Bridge's machinery, with the plugin's settings validated and every key checked."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.noise.config import NoiseConfig


@pytest.fixture(scope="module")
def io(megatron_cpu):
    from nemo_noise_plugin import recipes
    from nemo_noise_plugin.training import overrides as config_io

    return dict(config_io=config_io, recipes=recipes)


@pytest.fixture
def sft(io, tmp_path):
    return io["recipes"].tiny_noise_sft_config(dir=str(tmp_path), noise=NoiseConfig(alpha=7.0))


@pytest.fixture
def distillation(io, tmp_path):
    return io["recipes"].tiny_noise_distillation_config(dir=str(tmp_path))


def _rejects(io, config, overrides, message):
    with pytest.raises(io["config_io"].ConfigOverrideError) as error:
        io["config_io"].apply_overrides(config, overrides)
    assert message in str(error.value)
    return str(error.value)


def test_bridges_own_override_path_lets_an_invalid_alpha_through(sft):
    """Why apply_overrides exists: Bridge sets attributes on the existing NoiseConfig, skipping its validation."""
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    omegaconf_utils = import_bridge("megatron.bridge.training.utils.omegaconf_utils")
    omegaconf_utils.process_config_with_overrides(sft, cli_overrides=["model.noise.alpha=-1"])
    assert sft.model.noise.alpha == -1


def test_noise_overrides_reach_the_provider_as_a_validated_noise_config(io, sft):
    io["config_io"].apply_overrides(
        sft, ["model.noise.alpha=5", "model.noise.mechanism=gaussian", "model.noise.sigma=3"]
    )
    noise = sft.model.noise
    assert type(noise) is NoiseConfig
    assert (noise.alpha, noise.mechanism, noise.sigma) == (5.0, "gaussian", 3.0)
    assert type(noise.alpha) is float and type(noise.sigma) is float


def test_kd_and_training_overrides_are_applied(io, distillation):
    io["config_io"].apply_overrides(distillation, ["model.kd.temperature=2", "train.train_iters=7"])
    assert distillation.model.kd.temperature == 2.0 and type(distillation.model.kd.temperature) is float
    assert distillation.model.kd.kd_scale == 4.0
    assert distillation.train.train_iters == 7


def test_apply_overrides_returns_the_config_it_changed(io, sft):
    assert io["config_io"].apply_overrides(sft, ["model.noise.alpha=3"]) is sft


def test_force_add_sets_an_existing_key_and_plus_adds_to_a_mapping_field(io, sft):
    io["config_io"].apply_overrides(sft, ["++model.noise.alpha=12", "+tokenizer.hf_tokenizer_kwargs.use_fast=false"])
    assert sft.model.noise.alpha == 12.0
    assert sft.tokenizer.hf_tokenizer_kwargs == {"use_fast": False}


def test_deleting_a_field_restores_its_declared_default(io, sft):
    io["config_io"].apply_overrides(sft, ["~model.noise.alpha", "~train.train_iters"])
    assert sft.model.noise.alpha == NoiseConfig().alpha == 5.0
    assert sft.train.train_iters is None


def test_deleting_a_field_without_a_default_is_rejected(io, sft):
    _rejects(io, sft, ["~model"], "~model is invalid: ConfigContainer.model has no default to restore")


def test_an_unknown_noise_key_is_rejected_naming_it_and_the_close_match(io, sft):
    message = _rejects(io, sft, ["model.noise.alpah=3"], "model.noise.alpah is not a field of NoiseConfig")
    assert "did you mean model.noise.alpha?" in message


def test_a_plus_added_unknown_key_is_rejected_instead_of_skipped(io, sft):
    _rejects(io, sft, ["+model.noise.alpah=3"], "model.noise.alpah is not a field of NoiseConfig")
    _rejects(io, sft, ["+train.trian_iters=3"], "train.trian_iters is not a field of TrainingConfig")


def test_a_wrong_type_is_rejected_naming_the_key(io, sft):
    _rejects(
        io,
        sft,
        ["model.noise.alpha=abc"],
        "model.noise.alpha='abc' is invalid: expected a finite number >= 0. (from model.noise.alpha=abc)",
    )


def test_an_out_of_range_value_is_rejected_naming_the_key(io, sft, distillation):
    _rejects(io, sft, ["model.noise.alpha=-1"], "model.noise.alpha=-1 is invalid: expected a finite number >= 0")
    _rejects(io, distillation, ["model.kd.temperature=0"], "model.kd.temperature=0 is invalid: expected a finite")


def test_a_cross_field_error_names_the_key_and_the_override_that_caused_it(io, sft):
    message = _rejects(io, sft, ["model.noise.schedule=cosine"], "model.noise.decay_steps=0 is invalid with schedule")
    assert message.endswith("(from model.noise.schedule=cosine)")


def test_replacing_the_noise_config_by_a_scalar_is_rejected(io, sft):
    _rejects(io, sft, ["model.noise=5"], "model.noise=5 is invalid: expected a mapping of NoiseConfig fields")


def test_distillation_constraints_are_checked_against_the_overridden_model(io, distillation):
    _rejects(
        io,
        distillation,
        ["model.kd.hidden_loss=mse", "model.kd.hidden_layers=[4]", "model.kd.hidden_weight=1"],
        "model.kd.hidden_layers=[4] is invalid with num_layers=4: expected layer indices in 0..3",
    )
    io["config_io"].apply_overrides(
        distillation,
        ["model.num_layers=5", "model.kd.hidden_loss=mse", "model.kd.hidden_layers=[4]", "model.kd.hidden_weight=1"],
    )
    assert distillation.model.kd.hidden_layers == [4]


def test_a_rejected_override_list_leaves_the_config_unchanged(io, sft):
    train_iters, noise = sft.train.train_iters, sft.model.noise
    _rejects(io, sft, ["train.train_iters=1234", "model.noise.mechanism=gaussian", "model.noise.alpha=-1"], "alpha")
    assert sft.train.train_iters == train_iters != 1234
    assert sft.model.noise is noise and (noise.mechanism, noise.alpha) == ("uniform", 7.0)


def test_values_merged_from_a_yaml_file_are_validated_too(io, sft, tmp_path):
    path = tmp_path / "overrides.yaml"
    path.write_text("model:\n  noise:\n    alpha: -2\n")
    with pytest.raises(io["config_io"].ConfigOverrideError, match="model.noise.alpha=-2 is invalid"):
        io["config_io"].apply_overrides(sft, [], config_filepath=path)
    path.write_text("model:\n  noise:\n    alpha: 5\n    sigma: 12\ntrain:\n  train_iters: 9\n")
    io["config_io"].apply_overrides(sft, ["model.noise.mechanism=gaussian"], config_filepath=path)
    assert (sft.model.noise.sigma, sft.model.noise.mechanism, sft.train.train_iters) == (12.0, "gaussian", 9)


def test_the_overridden_config_still_passes_bridges_validation(io, sft):
    io["config_io"].apply_overrides(sft, ["model.noise.alpha=10", "train.train_iters=7"])
    sft.validate()
    assert (sft.model.noise.alpha, sft.train.train_iters) == (10.0, 7)


def test_deleting_a_null_field_is_rejected_with_the_reason(io, sft):
    _rejects(io, sft, ["~model.noise.clip_norm"], "~model.noise.clip_norm is invalid: its value is already null")


def test_an_override_equal_to_the_value_but_of_another_type_is_checked(io, distillation):
    """``1 == True``: ``model.noise.enabled=1`` must not pass as "untouched" (the rebuild checks it, naming the key)."""
    _rejects(io, distillation, ["model.noise.enabled=1"], "model.noise.enabled=1 is invalid: expected true or false")
    _rejects(io, distillation, ["model.kd.enabled=1"], "model.kd.enabled=1 is invalid: expected true or false")
    assert distillation.model.noise.enabled is True and distillation.model.kd.enabled is True


def test_a_full_iteration_cuda_graph_with_noise_on_passes_the_dry_run_checks(io, sft):
    """Full-iteration graphs carry noise since the keys are replayable (noise/replayable.py): no refusal left."""
    from nemo_noise_plugin.training.overrides import validate_plugin_settings

    config = io["config_io"].apply_overrides(sft, ["model.cuda_graph_impl=full_iteration"]) or sft
    assert config.model.cuda_graph_impl == "full_iteration" and config.model.noise.is_active_configuration
    validate_plugin_settings(config)


def test_core_attention_is_taken_from_an_override_and_a_wrong_one_is_refused_before_any_model(io, sft):
    from nemo_noise_plugin.training.overrides import validate_plugin_settings

    config = io["config_io"].apply_overrides(sft, ["model.core_attention=sdpa"]) or sft
    validate_plugin_settings(config)
    assert config.model.core_attention == "sdpa"
    config.model.core_attention = "flash"
    with pytest.raises(
        io["config_io"].ConfigOverrideError,
        match=r"^model\.core_attention='flash' is invalid: expected one of unfused, sdpa\.$",
    ):
        validate_plugin_settings(config)
