"""Run configs naming the plugin's classes survive Bridge's YAML round trip; other targets stay rejected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig


@pytest.fixture(scope="module")
def bridge(megatron_cpu):
    from nemo_noise_plugin import recipes
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    return dict(
        recipes=recipes,
        ConfigContainer=import_bridge("megatron.bridge.training.config").ConfigContainer,
        instantiate_utils=import_bridge("megatron.bridge.utils.instantiate_utils"),
    )


def _round_trip(bridge, config, path):
    config.to_yaml(str(path))
    return bridge["ConfigContainer"].from_yaml(str(path))


def _edited_yaml(path, edit):
    with open(path) as handle:
        values = yaml.safe_load(handle)
    edit(values)
    with open(path, "w") as handle:
        yaml.safe_dump(values, handle)


def test_importing_the_providers_module_allows_the_plugins_classes_and_nothing_else(bridge):
    from nemo_noise_plugin import providers

    allowlist = bridge["instantiate_utils"].target_allowlist
    assert providers.TARGET_PREFIX == "nemo_noise_plugin."
    assert allowlist.is_allowed("nemo_noise_plugin.providers.NoisyGPTModelProvider")
    assert allowlist.is_allowed("nemo_noise_plugin.distillation.config.KDConfig")
    assert not allowlist.is_allowed("nemo_noise_plugin_extra.providers.NoisyGPTModelProvider")
    assert not allowlist.is_allowed("os.system")


def test_the_sft_recipe_round_trips_through_yaml(bridge, tmp_path):
    from nemo_noise_plugin.providers import NoisyGPTModelProvider

    noise = NoiseConfig(mechanism="gaussian", sigma=3.0, scaling="padded_length", special_token_ids=[1, 2])
    config = bridge["recipes"].tiny_noise_sft_config(dir=str(tmp_path), train_iters=7, noise=noise)
    reloaded = _round_trip(bridge, config, tmp_path / "run_config.yaml")
    text = (tmp_path / "run_config.yaml").read_text()
    assert "_target_: nemo_noise_plugin.providers.NoisyGPTModelProvider" in text
    assert "_target_: nemo_noise_plugin.noise.config.NoiseConfig" in text
    assert type(reloaded.model) is NoisyGPTModelProvider
    assert type(reloaded.model.noise) is NoiseConfig and reloaded.model.noise == noise
    assert reloaded.model == config.model
    assert reloaded.train.train_iters == 7
    assert reloaded.to_dict() == config.to_dict()


def test_the_distillation_recipe_round_trips_through_yaml(bridge, tmp_path):
    from nemo_noise_plugin.providers import NoisyDistillationProvider

    kd = KDConfig(loss="jsd", jsd_beta=0.3, temperature=2.0, top_k=8, hidden_loss="mse", hidden_layers=[0, 2])
    config = bridge["recipes"].tiny_noise_distillation_config(dir=str(tmp_path), noise=NoiseConfig(alpha=15.0), kd=kd)
    config.model.teacher_shares_frozen_modules = True
    reloaded = _round_trip(bridge, config, tmp_path / "run_config.yaml")
    assert type(reloaded.model) is NoisyDistillationProvider
    assert type(reloaded.model.kd) is KDConfig and reloaded.model.kd == kd
    assert reloaded.model.noise.alpha == 15.0
    assert reloaded.model.teacher_shares_frozen_modules is True
    assert reloaded.to_dict() == config.to_dict()


def test_a_yaml_naming_a_target_outside_the_allowlist_is_rejected_before_import(bridge, tmp_path):
    path = tmp_path / "run_config.yaml"
    marker = tmp_path / "ran"
    bridge["recipes"].tiny_noise_sft_config(dir=str(tmp_path)).to_yaml(str(path))
    _edited_yaml(
        path, lambda values: values["model"].update(noise={"_target_": "os.system", "_args_": [f"touch {marker}"]})
    )
    with pytest.raises(Exception, match="'os.system' is not allowed because it is not in the allowlist"):
        bridge["ConfigContainer"].from_yaml(str(path))
    assert not marker.exists()


def test_a_look_alike_of_the_plugin_prefix_is_rejected(bridge, tmp_path):
    path = tmp_path / "run_config.yaml"
    bridge["recipes"].tiny_noise_sft_config(dir=str(tmp_path)).to_yaml(str(path))
    _edited_yaml(path, lambda values: values["model"]["noise"].update(_target_="nemo_noise_plugin_extra.NoiseConfig"))
    with pytest.raises(Exception, match="'nemo_noise_plugin_extra.NoiseConfig' is not allowed"):
        bridge["ConfigContainer"].from_yaml(str(path))


def test_an_invalid_noise_value_in_yaml_fails_naming_the_field(bridge, tmp_path):
    path = tmp_path / "run_config.yaml"
    bridge["recipes"].tiny_noise_sft_config(dir=str(tmp_path)).to_yaml(str(path))
    _edited_yaml(path, lambda values: values["model"]["noise"].update(alpha=-1.0))
    with pytest.raises(Exception, match=r"NoiseConfig.alpha=-1.0 is invalid: expected a finite number >= 0"):
        bridge["ConfigContainer"].from_yaml(str(path))


def test_load_config_yaml_reloads_a_run_config_in_a_fresh_process(bridge, tmp_path):
    path = tmp_path / "run_config.yaml"
    config = bridge["recipes"].tiny_noise_distillation_config(dir=str(tmp_path), kd=KDConfig(temperature=4.0))
    config.to_yaml(str(path))
    script = (
        "from nemo_noise_plugin.training.overrides import load_config_yaml\n"
        f"config = load_config_yaml({str(path)!r})\n"
        "print(type(config.model).__name__, config.model.kd.temperature, config.model.noise.alpha)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env={**os.environ}, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "NoisyDistillationProvider 4.0 5.0"


OLD_KD_TARGET = "nemo_noise_plugin.distillation.kd_config.KDConfig"
"""Where ``KDConfig`` lived before the house plan; run YAML written then names it, and no module is left there."""


def _old_kd_yaml(bridge, tmp_path, temperature):
    path = tmp_path / "old_run_config.yaml"
    config = bridge["recipes"].tiny_noise_distillation_config(dir=str(tmp_path), kd=KDConfig(temperature=temperature))
    config.to_yaml(str(path))
    _edited_yaml(path, lambda values: values["model"]["kd"].update(_target_=OLD_KD_TARGET))
    return path


def test_a_run_yaml_naming_kdconfigs_old_path_reloads_as_the_kdconfig_of_now(bridge, tmp_path):
    from nemo_noise_plugin.training.overrides import load_config_yaml

    path = _old_kd_yaml(bridge, tmp_path, temperature=3.0)
    with pytest.raises(Exception, match="kd_config"):  # Bridge's own loader cannot import the old path
        bridge["ConfigContainer"].from_yaml(str(path))
    reloaded = load_config_yaml(path)
    assert type(reloaded.model.kd) is KDConfig and reloaded.model.kd.temperature == 3.0


def test_a_config_file_naming_kdconfigs_old_path_sets_the_recipes_kdconfig(bridge, tmp_path):
    from nemo_noise_plugin.training.overrides import MOVED_TARGETS, apply_overrides

    assert MOVED_TARGETS == {OLD_KD_TARGET: "nemo_noise_plugin.distillation.config.KDConfig"}
    path = _old_kd_yaml(bridge, tmp_path, temperature=6.0)
    config = bridge["recipes"].tiny_noise_distillation_config(dir=str(tmp_path / "run"))
    assert config.model.kd.temperature != 6.0
    apply_overrides(config, [], config_filepath=path)
    assert type(config.model.kd) is KDConfig and config.model.kd.temperature == 6.0
