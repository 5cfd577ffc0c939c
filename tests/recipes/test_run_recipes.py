"""Run recipes in YAML (``recipes/*.yaml``) layered on a factory: ``--config-file`` first, then the overrides."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

from nemo_noise_plugin.cli import finetune as finetune_cli
from nemo_noise_plugin.jobs.launch.finetune import FinetuneError, run_finetune
from nemo_noise_plugin.recipes import RECIPES

REPO = pathlib.Path(__file__).resolve().parents[2]
RUN_RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def _quiet(_: str) -> None:
    pass


def _factory_named_in(path: pathlib.Path) -> str:
    match = re.search(r"--factory (\S+)", path.read_text())
    assert match, f"{path.name} names no --factory in its comment"
    return match.group(1)


def test_the_repository_ships_run_recipes():
    assert {path.name for path in RUN_RECIPES} >= {"tiny_neftune.yaml", "tiny_distillation_t2.yaml"}


@pytest.mark.parametrize("path", RUN_RECIPES, ids=lambda path: path.name)
def test_every_run_recipe_applies_to_the_factory_it_names(path, tmp_path):
    factory = _factory_named_in(path)
    assert factory in RECIPES
    # Recipes of HF models read their config from the hub: check their file on the tiny recipe of the same kind.
    target = factory if RECIPES[factory].embedded_corpus else factory.replace(factory.split("_noise_")[0], "tiny")
    config = run_finetune(target, [f"checkpoint.save={tmp_path}"], config_file=str(path), dryrun=True, print_fn=_quiet)
    expected = yaml.safe_load(path.read_text())
    for key, value in expected["model"]["noise"].items():
        assert getattr(config.model.noise, key) == value, key
    assert config.train.train_iters == expected["train"]["train_iters"]


def test_overrides_apply_after_the_config_file():
    path = REPO / "recipes" / "tiny_neftune.yaml"
    config = run_finetune(
        "tiny_noise_sft", ["model.noise.alpha=3"], config_file=str(path), dryrun=True, print_fn=_quiet
    )
    assert config.model.noise.alpha == 3.0
    assert config.train.train_iters == 60 and config.optimizer.lr == 0.001  # the file's other values stay


@pytest.mark.parametrize("factory", ["tiny_noise_sft", "tiny_noise_distillation"])
def test_a_to_yaml_export_fed_back_as_config_file_gives_the_same_config(factory, tmp_path):
    overrides = ["model.noise.alpha=7", "train.train_iters=9", "+env_vars.NCCL_DEBUG=INFO"]
    if factory == "tiny_noise_distillation":
        overrides.append("model.kd.temperature=3")
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    run_finetune(factory, overrides, to_yaml=str(first), print_fn=_quiet)
    config = run_finetune(factory, [], config_file=str(first), to_yaml=str(second), print_fn=_quiet)
    assert second.read_text() == first.read_text()
    assert (config.model.noise.alpha, config.train.train_iters, config.env_vars) == (7.0, 9, {"NCCL_DEBUG": "INFO"})


def test_the_torchrun_form_takes_a_config_file(capsys):
    argv = ["-f", "tiny_noise_sft", "--config-file", str(REPO / "recipes" / "tiny_neftune.yaml"), "--dryrun"]
    assert finetune_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "config file   " in out and "tiny_neftune.yaml" in out and "alpha=10.0" in out and "60 iterations" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            "model:\n  noise:\n    alpah: 3\n",
            r"model\.noise\.alpah is not a field of NoiseConfig; did you mean model\.noise\.alpha",
        ),
        ("model:\n  noise:\n    alpha: -1\n", r"model\.noise\.alpha=-1 is invalid"),
        ("model:\n  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n", r"a config file sets fields"),
        ("model: [1, 2\n", r"not valid YAML"),
        ("- 1\n- 2\n", r"expected a mapping of config fields \(e\.g\. .*\), got a list \(\[1, 2\]\)"),
        ("1: 2\n", r"config keys must be field names, got 1"),
        ("model: 5\n", r"^invalid --config-file or override: model=5 is invalid: expected a mapping of \w+ fields"),
        ("train: [1, 2]\n", r"train=\[1, 2\] is invalid: expected a mapping of TrainingConfig fields"),
        ("model:\n  noise: 3\n", r"model\.noise=3 is invalid: expected a mapping of NoiseConfig fields"),
    ],
)
def test_a_bad_config_file_is_an_error_naming_the_key(content, message, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(FinetuneError, match=message):
        run_finetune("tiny_noise_sft", config_file=str(path), dryrun=True, print_fn=_quiet)


def test_a_missing_config_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(FinetuneError, match=r"config file '.*nowhere\.yaml' is not a file"):
        run_finetune("tiny_noise_sft", config_file=str(tmp_path / "nowhere.yaml"), dryrun=True, print_fn=_quiet)
