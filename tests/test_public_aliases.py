"""Modules that moved keep their old import paths: each alias gives the very objects of the module it moved to.

The names are the old modules' public names (as of 4273ec9^, before the house plan moved them), so an import that
worked then works now; a name dropped from the new module, or an alias that copies instead of re-exporting, fails.
"""

from __future__ import annotations

import importlib

import pytest

MOVED = {
    "nemo_noise_plugin.privacy.calibration": (
        "nemo_noise_plugin.noise.calibration",
        [
            "analytic_gaussian_sigma",
            "classical_gaussian_sigma",
            "gaussian_mechanism_delta",
            "gaussian_mechanism_epsilon",
            "log_normal_cdf",
        ],
    ),
    "nemo_noise_plugin.distillation.kd_config": (
        "nemo_noise_plugin.distillation.config",
        ["HIDDEN_LOSSES", "KD_LOSSES", "KD_TOKEN_SELECTIONS", "HiddenLossKind", "KDConfig", "KDLossKind", "KDTokens"],
    ),
    "nemo_noise_plugin.training.launch": (  # the docs' ``from nemo_noise_plugin.training.launch import launch``
        "nemo_noise_plugin.jobs.launch.launcher",
        [
            "GPU_REQUIRED_MESSAGE",
            "GPUUnavailableError",
            "check_run_settings",
            "forward_step_for",
            "launch",
            "require_gpu",
            "saved_checkpoints",
            "training_entry_for",
        ],
    ),
}
"""Old module -> (new module, the old module's public names)."""


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_old_import_path_gives_the_same_objects_as_the_new_one(old):
    new, names = MOVED[old]
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_alias_docstring_names_the_new_module(old):
    assert f"Moved to ``{MOVED[old][0]}``" in importlib.import_module(old).__doc__


def test_the_old_launch_path_also_gives_the_main_jobs_launch_with_report():
    from nemo_noise_plugin.jobs.main_job import launch_with_report as new
    from nemo_noise_plugin.training.launch import launch_with_report as old

    assert old is new


def test_from_imports_of_the_old_calibration_path_compute_the_same_sigma():
    from nemo_noise_plugin.noise.calibration import analytic_gaussian_sigma as new
    from nemo_noise_plugin.privacy.calibration import analytic_gaussian_sigma as old

    assert old(1.0, 1e-5, 1.0) == new(1.0, 1e-5, 1.0) == pytest.approx(3.7305, abs=1e-3)


def test_an_old_yaml_target_path_of_kd_config_still_instantiates():
    """Run YAML files written before the move name ``nemo_noise_plugin.distillation.kd_config.KDConfig``."""
    from hydra.utils import instantiate

    from nemo_noise_plugin.distillation.config import KDConfig

    kd = instantiate({"_target_": "nemo_noise_plugin.distillation.kd_config.KDConfig", "temperature": 2.0})
    assert type(kd) is KDConfig and kd.temperature == 2.0
