"""The main job's default length: 60 steps for the default recipe (its report then measures a difference from the
control, docs/cli.md), 30 for the others; an explicit ``--steps`` always wins."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.cli.main_job import parse_args


def test_the_default_recipe_trains_60_steps():
    assert parse_args([]).steps == 60


@pytest.mark.parametrize("recipe", ["tiny_noise_distillation", "smollm2_135m_noise_sft"])
def test_the_other_recipes_train_30_steps(recipe):
    assert parse_args(["--recipe", recipe]).steps == 30


def test_an_explicit_steps_wins_and_stop_after_is_checked_against_the_default():
    assert parse_args(["--steps", "6"]).steps == 6
    assert parse_args(["--stop-after", "59"]).stop_after == 59
    with pytest.raises(SystemExit):
        parse_args(["--stop-after", "60"])
