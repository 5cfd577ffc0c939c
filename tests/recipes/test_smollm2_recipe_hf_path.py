"""The SmolLM2 recipes with ``hf_path``: any converted Hugging Face folder is used as given, and the model cache is not
touched (``ensure_smollm2_hf`` is only the default when ``hf_path`` is None).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_noise_plugin.data import smollm2_wheel as pretrained
from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401  (the session fixture)


def _must_not_run(*args, **kwargs):
    raise AssertionError("ensure_smollm2_hf was called although hf_path was given")


@pytest.mark.slow
def test_the_sft_recipe_with_hf_path_uses_that_folder_and_not_the_model_cache(smollm2_hf_dir, monkeypatch, tmp_path):  # noqa: F811
    from nemo_noise_plugin.recipes.smollm2 import smollm2_135m_noise_sft_config

    folder = tmp_path / "my-smollm2"  # the converted folder somewhere else, as a user would pass it
    folder.mkdir()
    for path in smollm2_hf_dir.iterdir():
        (folder / path.name).symlink_to(path)
    cache = tmp_path / "model-cache"
    monkeypatch.setenv(pretrained.MODEL_CACHE_ENV, str(cache))
    monkeypatch.setattr(pretrained, "ensure_smollm2_hf", _must_not_run)
    config = smollm2_135m_noise_sft_config(dir=str(tmp_path / "run"), hf_path=str(folder))
    assert config.tokenizer.tokenizer_model == str(folder)
    model = config.model
    assert (model.num_layers, model.hidden_size, model.num_query_groups) == (30, 576, 3)
    assert model.share_embeddings_and_output_weights and model._pre_wrap_hooks  # AutoBridge loads from `folder`
    assert not cache.exists()  # nothing looked for, made or locked in the model cache
    assert Path(config.dataset.dataset_root).is_relative_to(tmp_path / "run")
