"""The main job's noise flags come from the family registry: one flag per family that names one, checked per use."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.cli.main_job import build_noise_config, parse_args
from nemo_noise_plugin.noise.families import NOISE_FAMILIES

FLAGGED = [name for name, family in NOISE_FAMILIES.items() if family.cli_flag]


def test_the_flagged_families_are_neftune_gaussian_and_laplace():
    assert FLAGGED == ["uniform", "gaussian", "laplace"]


@pytest.mark.parametrize("name", FLAGGED)
def test_each_family_flag_sets_its_magnitude_field(name):
    family = NOISE_FAMILIES[name]
    option = "--" + family.cli_flag.replace("_", "-")
    noise = build_noise_config(parse_args(["--mechanism", name, option, "0.25"]))
    assert noise.mechanism == name and getattr(noise, family.magnitude_field) == 0.25


def test_a_flag_of_another_family_is_an_error_naming_the_flag_and_the_field_to_use():
    with pytest.raises(ValueError, match=r"--laplace-scale=0.2 is not used by mechanism 'uniform' \(only by laplace\)"):
        build_noise_config(parse_args(["--laplace-scale", "0.2"]))
    with pytest.raises(ValueError, match=r"--scaling=absolute is not used by mechanism 'laplace' \(only by uniform"):
        build_noise_config(parse_args(["--mechanism", "laplace", "--scaling", "absolute"]))


def test_no_clean_pretraining_for_a_from_scratch_distillation_recipe_is_refused(capsys):
    """Before (issue 36, finding 8) the run distilled from a randomly initialised teacher without a word."""
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--recipe", "tiny_noise_distillation", "--clean-pretrain-steps", "0"])
    assert stopped.value.code == 2
    assert (
        "--clean-pretrain-steps=0 is invalid with --recipe tiny_noise_distillation: expected an integer >= 1 "
        "(default 100), since this recipe trains from scratch and its distillation teacher would be the randomly "
        "initialised model." in capsys.readouterr().err
    )


def test_no_clean_pretraining_is_fine_for_a_recipe_without_a_teacher():
    assert parse_args(["--recipe", "tiny_noise_sft", "--clean-pretrain-steps", "0"]).clean_pretrain_steps == 0


def test_held_out_and_chats_reach_the_task_report(tmp_path):
    from nemo_noise_plugin.jobs.reports.artifacts import RunReport
    from nemo_noise_plugin.jobs.reports.callbacks import report_callbacks

    args = parse_args(["--recipe", "tiny_noise_sft", "--held-out", "8", "--chats", "2"])
    assert (args.held_out, args.chats) == (8, 2)
    (task,) = report_callbacks(["task"], None, RunReport(str(tmp_path)), task_options={"held_out": 8, "samples": 2})
    assert (task.held_out, task.samples) == (8, 2)


@pytest.mark.parametrize("flag", ["--held-out", "--chats"])
def test_held_out_or_chats_below_one_is_refused(flag, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args([flag, "0"])
    assert stopped.value.code == 2 and f"{flag}=0 is invalid: expected an integer >= 1." in capsys.readouterr().err


def test_scaling_embedding_distance_without_a_distance_is_refused_before_anything_is_built(tmp_path, capsys):
    """Issue 36, finding 10: ``--scaling embedding_distance`` was offered, then failed after the model and data were
    built, since no flag sets ``embedding_distance``."""
    from nemo_noise_plugin.cli.main_job import main

    assert main(["--scaling", "embedding_distance", "--output-dir", str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(
        "error: --scaling='embedding_distance' is invalid: expected a noise config that also sets embedding_distance"
    )
    assert "\n" not in line and not (tmp_path / "out" / "tiny_noise_sft").exists()


def test_scaling_embedding_distance_from_a_noise_config_that_sets_the_distance_is_taken(tmp_path):
    noise_yaml = tmp_path / "noise.yaml"
    noise_yaml.write_text("mechanism: gaussian\nscaling: embedding_distance\nembedding_distance: 0.8\n")
    noise = build_noise_config(parse_args(["--noise-config", str(noise_yaml)]))
    assert (noise.scaling, noise.embedding_distance) == ("embedding_distance", 0.8)
    noise_yaml.write_text("mechanism: gaussian\nscaling: embedding_distance\n")
    with pytest.raises(ValueError, match=rf"^--noise-config {noise_yaml} scaling='embedding_distance' is invalid"):
        build_noise_config(parse_args(["--noise-config", str(noise_yaml)]))
