"""The task report's frontier point: a run trained with noise states, in ``task_report.json`` and its summary, its
held-out exact match under its own noise at inference, the token recovery of the audit on its trained table over
noised held-out tokens, and the ledger's epsilon; and it records the run's noise for ``nemo noise audit run=``.

A tiny GPT with the tiny chat tokenizer stands in for SmolLM2 (as in ``test_sft_callbacks_bridge_state``), with
Bridge's ``GlobalState``, tokenizer, dataset provider and finetuning pipeline.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from tests.support.attention_variables import clean_attention_variables
from tests.support.chat_sft import tiny_chat_sft_config, write_chat_tokenizer

NOISE = NoiseConfig(mechanism="gaussian_mechanism", epsilon=30.0, clip_norm=1.0, special_token_ids=[1, 2])
"""The run's noise: the Gaussian mechanism, never on the chat markers ``<|im_start|>`` 1 and ``<|im_end|>`` 2."""


@pytest.fixture(autouse=True)
def clean_attention_settings():
    """Build the models from a clean slate of ``NVTE_*`` variables (``tests.support.attention_variables``)."""
    with clean_attention_variables():
        yield


@pytest.fixture
def bridge_state(tmp_path, megatron_cpu):
    """Bridge's ``GlobalState`` and the model after ``setup()``'s tokenizer and data steps, noise = ``NOISE``."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    tokenizer_dir = write_chat_tokenizer(tmp_path / "tokenizer")
    config = tiny_chat_sft_config(tmp_path / "run", tokenizer_dir, lr=1e-4, packed_sequence_size=None)
    provider = config.model
    provider.noise = NOISE
    provider.bf16, provider.params_dtype, provider.pipeline_dtype = False, torch.float32, torch.float32
    config.optimizer.bf16 = False
    state = import_bridge("megatron.bridge.training.state").GlobalState()
    state.cfg = config
    tokenizer = import_bridge("megatron.bridge.training.tokenizers.tokenizer").build_tokenizer(config.tokenizer)
    config.dataset.finalize()
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = provider.provide_distributed_model(
        use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
    )
    dataset_provider = import_bridge("megatron.bridge.data.utils").get_dataset_provider(config.dataset)
    dataset_provider([16, 8, 0], config.dataset, tokenizer=tokenizer)
    return state, model


def _context(state, model, user_state):
    callbacks = import_bridge("megatron.bridge.training.callbacks")
    return callbacks.CallbackContext(state=state, model=model, user_state=user_state)


def test_the_task_report_states_the_runs_frontier_point_and_its_noise(bridge_state, tmp_path, capsys):
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.jobs.reports.artifacts import RunReport
    from nemo_noise_plugin.jobs.reports.task_frontier import FRONTIER_TOKENS, input_embedding_table
    from nemo_noise_plugin.jobs.reports.task_report import TaskReport
    from nemo_noise_plugin.privacy.audit import noised_tokens
    from nemo_noise_plugin.privacy.ledger import privacy_ledger

    state, model = bridge_state
    report = RunReport(tmp_path / "reports")
    task = TaskReport(report, export=False)
    user_state: dict = {}
    task.on_train_start(_context(state, model, user_state))
    task.on_train_end(_context(state, model, user_state))
    report.finish()
    written = json.loads((report.folder / "task_report.json").read_text())

    # what nemo noise audit run= reads back: the noise as trained and the ledger's settings
    run = written["run"]
    assert NoiseConfig(**run["noise"]) == NOISE
    assert (run["seq_length"], run["train_iters"], run["global_batch_size"]) == (128, 4, 4)
    assert (run["training_examples"], run["epochs"]) == (4400, 1)

    frontier = written["frontier"]
    assert frontier["noise"] == "gaussian_mechanism epsilon=30"
    assert frontier["noise_config"]["training_only"] is False  # noise on the inputs at inference
    assert set(frontier["splits"]) == set(written["after"]["splits"])
    assert frontier["exact_match"] == frontier["splits"]["validation"]["exact_match"]
    assert all(0.0 <= split["exact_match"] <= 1.0 for split in frontier["splits"].values())
    assert set(frontier["recovery"]) == {"nn_l2", "nn_cosine", "lm_beam"}
    assert all(0.0 <= rate <= 1.0 for rate in frontier["recovery"].values())

    # only tokens that received noise are counted: real held-out tokens, the chat markers left out
    audited = frontier["audited_tokens"]
    expected = total = 0
    for batch in task.batches["validation"]:  # the rows the frontier audits: whole rows up to FRONTIER_TOKENS
        noised = noised_tokens(NOISE, batch["tokens"], loss_mask=batch["loss_mask"])
        for row, mask in enumerate(batch["loss_mask"]):
            if total < FRONTIER_TOKENS:
                total += int(mask.nonzero().max()) + 1
                expected += int(noised[row].sum())
    assert audited == expected and FRONTIER_TOKENS <= total and audited < total - 20  # markers: not noised
    assert frontier["audit"]["tokens"]["real"] == audited and 0 < frontier["distinct_ids"] <= audited
    table = input_embedding_table(unwrap_model(model[0]))
    assert frontier["audit"]["median_nearest_neighbour_distance"] > 0 and table.shape[1] == 64

    ledger = privacy_ledger(NoiseConfig(**frontier["noise_config"]), sequence_length=128, epochs=1)
    assert frontier["per_token_epsilon"] == 30.0
    assert frontier["per_sequence_epsilon"] == pytest.approx(ledger.per_sequence[0].epsilon)
    assert frontier["ledger"]["sequence_length"] == 128 and frontier["ledger"]["epochs"] == 1

    printed = capsys.readouterr().out
    assert "frontier point (gaussian_mechanism epsilon=30, on the inputs at inference)" in printed
    assert f"token recovery over {audited} noised held-out tokens" in printed and "per token 30" in printed


def test_a_run_without_noise_has_no_frontier_point_but_records_its_noise(bridge_state, tmp_path):
    from nemo_noise_plugin.jobs.reports.artifacts import RunReport
    from nemo_noise_plugin.jobs.reports.task_report import TaskReport

    state, model = bridge_state
    state.cfg.model.noise = dataclasses.replace(NOISE, enabled=False)
    report = RunReport(tmp_path / "reports")
    task = TaskReport(report, export=False)
    before = {"exact_match": 0.0, "per_task": {}, "splits": {}}
    user_state = {"task_report_before": before}
    state.train_state.step = 4  # resumed: the saved 'before' is used, only 'after' is measured
    task.on_train_start(_context(state, model, user_state))
    task.on_train_end(_context(state, model, user_state))
    report.finish()
    written = json.loads((report.folder / "task_report.json").read_text())
    assert "frontier" not in written and written["run"]["noise"]["enabled"] is False
