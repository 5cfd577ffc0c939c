"""The jobs wing passes a recipe the offline folder of its pretrained model (``jobs.models.offline``): only when the
call names no ``hf_path``, only for a recipe that declares a model, and through every front door's recipe loader."""

from __future__ import annotations

import inspect

import pytest

from nemo_noise_plugin.jobs.models import offline
from nemo_noise_plugin.recipes.smollm2 import SMOLLM2_HF_MODEL


@pytest.fixture
def made(monkeypatch, tmp_path):
    """The SmolLM2 offline folder replaced by a folder of the test's, counting how often it is asked for."""
    calls = []

    def make():
        calls.append(1)
        return tmp_path / "offline-smollm2"

    monkeypatch.setitem(offline.OFFLINE_FOLDERS, SMOLLM2_HF_MODEL, make)
    return calls, str(tmp_path / "offline-smollm2")


def _recipe(dir: str | None = None, train_iters: int = 20, hf_path: str = SMOLLM2_HF_MODEL) -> tuple:
    return dir, train_iters, hf_path


def test_a_call_without_hf_path_gets_the_offline_folder(made):
    calls, folder = made
    wrapped = offline.with_offline_model("smollm2_135m_noise_sft", _recipe)
    assert wrapped() == (None, 20, folder)
    assert wrapped("runs", train_iters=3) == ("runs", 3, folder)
    assert len(calls) == 2


def test_a_call_naming_hf_path_is_passed_through_and_makes_nothing(made):
    calls, _ = made
    wrapped = offline.with_offline_model("smollm2_135m_noise_distillation", _recipe)
    assert wrapped(hf_path="/models/mine") == (None, 20, "/models/mine")
    assert wrapped(None, 5, SMOLLM2_HF_MODEL) == (None, 5, SMOLLM2_HF_MODEL)  # the hub id, asked for by name
    assert calls == []


def test_a_recipe_without_a_pretrained_model_is_returned_unchanged(made):
    assert offline.with_offline_model("tiny_noise_sft", _recipe) is _recipe
    assert offline.with_offline_model("not_registered", _recipe) is _recipe
    assert offline.offline_folder("tiny_noise_sft") is None
    assert made[0] == []


def test_the_wrapper_keeps_the_recipes_signature_for_the_argument_checks(made):
    wrapped = offline.with_offline_model("smollm2_135m_noise_sft", _recipe)
    assert inspect.signature(wrapped) == inspect.signature(_recipe)
    assert wrapped.__wrapped__ is _recipe


def test_the_finetune_flows_recipe_loader_hands_smollm2_the_offline_folder(made):
    from nemo_noise_plugin.jobs.launch.finetune import load_recipe
    from nemo_noise_plugin.recipes import RECIPES

    loaded = load_recipe("smollm2_135m_noise_sft")
    assert loaded.__wrapped__ is RECIPES["smollm2_135m_noise_sft"].function
    assert load_recipe("tiny_noise_sft") is RECIPES["tiny_noise_sft"].function
