"""The SmolLM2 recipes build from the ``hf_path`` they are given: any converted Hugging Face folder is used as given,
the model cache is not touched, and without one the default is the hub id (the jobs wing passes its offline folder:
``tests/jobs/models/test_offline.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_noise_plugin.jobs.models.fetch_wheel import MODEL_CACHE_ENV
from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401  (the session fixture)

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("name", ["smollm2_135m_noise_sft", "smollm2_135m_noise_distillation"])
def test_a_smollm2_recipe_defaults_hf_path_to_the_hub_id_and_registers_that_model(name):
    import inspect

    from nemo_noise_plugin.recipes import RECIPES
    from nemo_noise_plugin.recipes.smollm2 import SMOLLM2_HF_MODEL, smollm2_provider

    assert SMOLLM2_HF_MODEL == HUB_ID
    assert inspect.signature(RECIPES[name].function).parameters["hf_path"].default == HUB_ID
    assert inspect.signature(smollm2_provider).parameters["hf_path"].default == HUB_ID
    assert RECIPES[name].hf_model == HUB_ID
    assert RECIPES["tiny_noise_sft"].hf_model is None


@pytest.mark.slow
def test_the_sft_recipe_with_hf_path_uses_that_folder_and_not_the_model_cache(smollm2_hf_dir, monkeypatch, tmp_path):  # noqa: F811
    from nemo_noise_plugin.recipes.smollm2 import smollm2_135m_noise_sft_config

    folder = tmp_path / "my-smollm2"  # the converted folder somewhere else, as a user would pass it
    folder.mkdir()
    for path in smollm2_hf_dir.iterdir():
        (folder / path.name).symlink_to(path)
    cache = tmp_path / "model-cache"
    monkeypatch.setenv(MODEL_CACHE_ENV, str(cache))
    config = smollm2_135m_noise_sft_config(dir=str(tmp_path / "run"), hf_path=str(folder))
    assert config.tokenizer.tokenizer_model == str(folder)
    model = config.model
    assert (model.num_layers, model.hidden_size, model.num_query_groups) == (30, 576, 3)
    assert model.share_embeddings_and_output_weights and model._pre_wrap_hooks  # AutoBridge loads from `folder`
    assert not cache.exists()  # nothing looked for, made or locked in the model cache
    assert Path(config.dataset.dataset_root).is_relative_to(tmp_path / "run")
