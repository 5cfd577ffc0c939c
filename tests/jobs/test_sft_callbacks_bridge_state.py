"""The report callbacks on an instruction (SFT) recipe, with the tokenizer and datasets as Bridge's ``setup()`` leaves
them: Bridge's loop gives ``config.dataset`` (a ``GPTSFTDatasetConfig``) no tokenizer, so a callback that reads
``config.dataset.tokenizer`` crashes on a GPU before step 1 (issue 23) while the CPU loop, which used to set it,
hid the crash. Here a tiny GPT with a tiny chat tokenizer stands in for SmolLM2; everything else is real: Bridge's
``GlobalState``, ``build_tokenizer``, dataset provider and finetuning pipeline, and the plugin's callbacks.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import torch

from nemo_noise_plugin.data.instruction_set import instruction_examples
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from tests.support.attention_variables import clean_attention_variables
from tests.support.chat_sft import tiny_chat_sft_config, write_chat_tokenizer


def test_bridge_setup_gives_the_tokenizer_only_to_dataset_configs_that_declare_one():
    """What the fixture below repeats is what Bridge 0.6.2's ``setup()`` does; this fails when upstream changes it."""
    source = inspect.getsource(import_bridge("megatron.bridge.training.setup").setup)
    assert "tokenizer = build_tokenizer(cfg.tokenizer)" in source
    assert 'if hasattr(cfg.dataset, "tokenizer"):\n        cfg.dataset.tokenizer = tokenizer' in source
    builders = import_bridge("megatron.bridge.data.builders.gpt_sft")
    assert "tokenizer" not in {field.name for field in dataclasses.fields(builders.GPTSFTDatasetConfig)}


@pytest.fixture(params=[None, 256], ids=["unpacked", "packed"])
def bridge_state(request, tmp_path, megatron_cpu):
    """Bridge's ``GlobalState`` and the model after the steps of ``setup()`` that concern tokenizer and data, with
    Bridge's offline packing off and on (the reports then read one example per row all the same)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    tokenizer_dir = write_chat_tokenizer(tmp_path / "tokenizer")
    config = tiny_chat_sft_config(tmp_path / "run", tokenizer_dir, lr=1e-4, packed_sequence_size=request.param)
    provider = config.model
    provider.bf16, provider.params_dtype, provider.pipeline_dtype = False, torch.float32, torch.float32
    config.optimizer.bf16 = False
    state = import_bridge("megatron.bridge.training.state").GlobalState()
    state.cfg = config
    # Bridge's setup(): the tokenizer from config.tokenizer, given to config.dataset only if it has the field
    tokenizer = import_bridge("megatron.bridge.training.tokenizers.tokenizer").build_tokenizer(config.tokenizer)
    if hasattr(config.dataset, "tokenizer"):
        config.dataset.tokenizer = tokenizer
    config.dataset.finalize()
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = provider.provide_distributed_model(
        use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
    )
    # ... then the datasets, through Bridge's provider bound to that tokenizer (this prepares the index files)
    dataset_provider = import_bridge("megatron.bridge.data.utils").get_dataset_provider(config.dataset)
    train, valid, _ = dataset_provider([16, 8, 0], config.dataset, tokenizer=tokenizer)
    assert len(train) > 0 and len(valid) > 0
    return state, model


@pytest.fixture(autouse=True)
def clean_attention_settings():
    """Build the models from a clean slate of ``NVTE_*`` variables (``tests.support.attention_variables``)."""
    with clean_attention_variables():
        yield


def _context(state, model, user_state):
    callbacks = import_bridge("megatron.bridge.training.callbacks")
    return callbacks.CallbackContext(state=state, model=model, user_state=user_state)


def test_task_report_scores_every_held_out_split_from_bridges_datasets(bridge_state, tmp_path):
    from nemo_noise_plugin.jobs.reports.artifacts import RunReport
    from nemo_noise_plugin.jobs.reports.task_report import TaskReport

    state, model = bridge_state
    assert not hasattr(state.cfg.dataset, "tokenizer")  # as Bridge leaves a finetuning dataset config
    report = RunReport(tmp_path / "reports")
    task = TaskReport(report, export=False)
    user_state: dict = {}
    task.on_train_start(_context(state, model, user_state))
    task.on_train_end(_context(state, model, user_state))
    report.finish()
    written = json.loads((report.folder / "task_report.json").read_text())
    size = state.cfg.train.micro_batch_size
    for moment in ("before", "after"):
        splits = written[moment]["splits"]
        assert set(splits) >= {"validation"}
        for split, result in splits.items():
            examples = instruction_examples(split)
            assert 0.0 <= result["exact_match"] <= 1.0
            # every task of the split is scored (the whole batches cover them all in the shipped files)
            scored = len(examples) // size * size
            assert set(result["per_task"]) == {e["task"] for e in examples[:scored]}
        assert written[moment]["exact_match"] == splits["validation"]["exact_match"]
    assert not hasattr(state.cfg.dataset, "tokenizer")  # the callbacks did not patch the config either


def test_robustness_report_measures_bridges_validation_batches(bridge_state, tmp_path):
    from nemo_noise_plugin.jobs.reports.artifacts import RunReport
    from nemo_noise_plugin.jobs.reports.robustness import REPORT_MULTIPLES, RobustnessReport

    state, model = bridge_state
    robustness = RobustnessReport(state.cfg.model.noise, RunReport(tmp_path / "reports"), "bridge state")
    user_state: dict = {}
    robustness.on_train_start(_context(state, model, user_state))
    robustness.on_train_end(_context(state, model, user_state))
    written = json.loads((robustness.folder / "robustness.json").read_text())
    assert [len(written[name]) for name in ("before", "after")] == [len(REPORT_MULTIPLES)] * 2
    assert written["after"][0]["kl"] == pytest.approx(0.0, abs=1e-6)  # level 0 is the clean model itself
    assert all(point["kl"] > 0 for point in written["after"][1:])
    # the held-out batches are Bridge's validation examples, one per row (packed or not), loss on the answers only
    masks = [batch["loss_mask"] for batch in robustness.batches]
    assert all(0 < mask.sum() < mask.numel() for mask in masks)
    assert all("cu_seqlens" not in batch for batch in robustness.batches)
    assert all(batch["tokens"].shape[0] == state.cfg.train.micro_batch_size for batch in robustness.batches)
