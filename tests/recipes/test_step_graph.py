"""``recipes.common.use_step_graph``: the full-iteration graph's settings, and the refusal of SFT rows it cannot replay.

The graph itself needs CUDA (tests/gpu/test_full_iteration_graph_gpu.py; the SmolLM2 step time with it:
benchmarks/SFT_THROUGHPUT.md); here the settings, the overrides that reach them, and the check that runs before any
model is built.
"""

from __future__ import annotations

import pytest

from nemo_noise_plugin.jobs.launch.launcher import check_run_settings
from nemo_noise_plugin.recipes.common import (
    STEP_GRAPH_WARMUP_STEPS,
    check_fixed_width_batches,
    check_graph_memory_pools,
    use_step_graph,
)
from nemo_noise_plugin.training.overrides import apply_overrides
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import SettingError
from tests.support.chat_sft import tiny_chat_sft_config, write_chat_tokenizer


@pytest.fixture
def sft_config(tmp_path):
    tokenizer_dir = write_chat_tokenizer(tmp_path / "tokenizer")
    return tiny_chat_sft_config(tmp_path / "run", tokenizer_dir)


def test_the_step_graph_sets_what_bridges_full_iteration_graph_needs(sft_config):
    is_full_iteration = import_bridge("megatron.bridge.utils.cuda_graph").is_full_iteration_cuda_graph
    assert not is_full_iteration(sft_config.model)
    sft_config.dataset.dataset_kwargs = {"answer_only_loss": True}  # kept beside the padding
    assert use_step_graph(sft_config) is sft_config
    model = sft_config.model
    assert is_full_iteration(model) and model.replays_training_steps  # the noise gets replayable keys
    assert (model.cuda_graph_warmup_steps, model.use_te_rng_tracker) == (STEP_GRAPH_WARMUP_STEPS, True)
    assert model.cuda_graph_use_single_mempool is False  # a validation graph captured after train() needs its own
    assert sft_config.rerun_state_machine.check_for_nan_in_loss is False  # Bridge refuses it under the graph
    assert sft_config.dataset.dataset_kwargs == {"answer_only_loss": True, "pad_to_max_length": True}
    check_fixed_width_batches(sft_config)
    check_run_settings(sft_config, dry=True)
    assert use_step_graph(sft_config, warmup_steps=5).model.cuda_graph_warmup_steps == 5


@pytest.mark.parametrize("warmup_steps", [0, -1, 1.5, True, "2"])
def test_a_warmup_that_is_not_a_positive_integer_is_refused(sft_config, warmup_steps):
    with pytest.raises(SettingError, match=r"warmup_steps=.* is invalid: expected an integer >= 1"):
        use_step_graph(sft_config, warmup_steps=warmup_steps)


def test_a_full_iteration_graph_over_sft_rows_padded_per_batch_is_refused_before_any_build(sft_config):
    """``model.cuda_graph_impl=full_iteration`` alone: the launcher's check names the padding setting; the override
    it suggests is accepted and passes."""
    apply_overrides(sft_config, ["model.cuda_graph_impl=full_iteration"])
    with pytest.raises(SettingError) as refused:
        check_run_settings(sft_config, dry=True)
    message = str(refused.value)
    assert message.startswith("dataset.dataset_kwargs.pad_to_max_length=None is invalid with ")
    assert "model.cuda_graph_impl=full_iteration: expected true" in message
    assert "dataset.dataset_kwargs={pad_to_max_length:true}" in message
    apply_overrides(sft_config, ["dataset.dataset_kwargs={pad_to_max_length:true}"])
    assert sft_config.dataset.dataset_kwargs == {"pad_to_max_length": True}
    check_fixed_width_batches(sft_config)


def test_one_memory_pool_for_the_training_and_validation_graphs_is_refused_before_any_build(sft_config):
    """Megatron's default (one pool) under a full-iteration graph with evaluation: the launcher names the setting and
    why; without evaluation, and with the step graph's own pools, the same run passes."""
    use_step_graph(sft_config)
    assert sft_config.validation.eval_iters  # the SFT recipe evaluates
    apply_overrides(sft_config, ["model.cuda_graph_use_single_mempool=true"])
    with pytest.raises(SettingError) as refused:
        check_run_settings(sft_config, dry=True)
    message = str(refused.value)
    assert message.startswith("model.cuda_graph_use_single_mempool=True is invalid with model.cuda_graph_impl=")
    assert "evaluation iterations: expected false" in message and "train() returns" in message
    check_fixed_width_batches(sft_config)  # the padding is not what is refused
    apply_overrides(sft_config, ["validation.eval_iters=0"])
    check_graph_memory_pools(sft_config)  # no evaluation: no second graph in the pool
    apply_overrides(sft_config, ["validation.eval_iters=2", "model.cuda_graph_use_single_mempool=false"])
    check_run_settings(sft_config, dry=True)


def test_eager_runs_and_mock_data_need_no_padding(sft_config, tmp_path):
    from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config

    check_fixed_width_batches(sft_config)  # no graph: rows padded per batch are fine
    mock = tiny_noise_sft_config(str(tmp_path / "tiny"))
    mock.model.cuda_graph_impl = "full_iteration"
    check_fixed_width_batches(mock)  # Megatron's mock GPT data is always seq_length wide


@pytest.fixture(scope="module")
def smollm2_config_dir(tmp_path_factory):
    """A config-only HF folder of SmolLM2's architecture: the recipes read no weights when they build their config."""
    import json

    from tests.support.recipe_snapshot import SMOLLM2_CONFIG

    folder = tmp_path_factory.mktemp("smollm2_config")
    (folder / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    return folder


def test_both_smollm2_recipes_graph_unpacked_rows_by_default(smollm2_config_dir, tmp_path):
    from nemo_noise_plugin.recipes.smollm2 import (
        smollm2_135m_noise_distillation_config,
        smollm2_135m_noise_sft_config,
    )

    common = dict(dir=str(tmp_path), hf_path=str(smollm2_config_dir))
    sft = smollm2_135m_noise_sft_config(**common)
    assert (sft.model.cuda_graph_impl, sft.model.core_attention) == ("full_iteration", "sdpa")
    assert sft.dataset.dataset_kwargs == {"pad_to_max_length": True}
    packed = smollm2_135m_noise_sft_config(**common, packed_sequence_size=256)
    assert packed.model.cuda_graph_impl == "none" and not packed.dataset.dataset_kwargs
    eager = smollm2_135m_noise_sft_config(**common, step_graph=False, core_attention="unfused")
    assert (eager.model.cuda_graph_impl, eager.model.core_attention) == ("none", "unfused")
    assert eager.rerun_state_machine.check_for_nan_in_loss is True
    distillation = smollm2_135m_noise_distillation_config(**common)
    assert (distillation.model.cuda_graph_impl, distillation.model.core_attention) == ("full_iteration", "sdpa")
    assert (
        distillation.model.replays_training_steps and distillation.dataset.dataset_kwargs == sft.dataset.dataset_kwargs
    )
    eager = smollm2_135m_noise_distillation_config(**common, step_graph=False, core_attention="unfused")
    assert (eager.model.cuda_graph_impl, eager.model.core_attention) == ("none", "unfused")


def test_the_recipe_refuses_a_step_graph_over_packed_rows_and_a_step_graph_that_is_not_a_bool(
    smollm2_config_dir, tmp_path
):
    from nemo_noise_plugin.recipes.smollm2 import smollm2_135m_noise_sft_config

    common = dict(dir=str(tmp_path), hf_path=str(smollm2_config_dir))
    with pytest.raises(SettingError, match=r"dataset.enable_offline_packing=True is invalid: expected False with"):
        smollm2_135m_noise_sft_config(**common, packed_sequence_size=256, step_graph=True)
    with pytest.raises(SettingError, match=r"step_graph='yes' is invalid: expected True, False or None"):
        smollm2_135m_noise_sft_config(**common, step_graph="yes")
