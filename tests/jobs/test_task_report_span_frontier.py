"""The task report's frontier point of a span run (``NoiseConfig.tokens='spans'``): exact match under the run's own
span noise, and token recovery on the private-span tokens only, with the ledger's epsilon per span.

A tiny GPT with the tiny chat tokenizer stands in for SmolLM2 (as in ``test_task_report_frontier``), trained on the
shipped ``support`` chats through Bridge's private-span dataset (``PrivateSpanSFTDatasetConfig``).
"""

from __future__ import annotations

import json

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from tests.support.attention_variables import clean_attention_variables
from tests.support.chat_sft import tiny_chat_sft_config, write_chat_tokenizer

NOISE = NoiseConfig(mechanism="gaussian_mechanism", epsilon=30.0, clip_norm=1.0, tokens="spans")
FRONTIER_TOKENS = 60


@pytest.fixture(autouse=True)
def clean_attention_settings():
    with clean_attention_variables():
        yield


@pytest.fixture
def span_state(tmp_path, megatron_cpu):
    """Bridge's ``GlobalState`` and model after ``setup()``'s tokenizer and data steps, on support chats with spans."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_noise_plugin.data.span_dataset import PrivateSpanSFTDatasetConfig
    from nemo_noise_plugin.data.tasks.shipped import task_files

    root = tmp_path / "data"
    root.mkdir()
    for split, count in (("training", 8), ("validation", 8)):
        lines = task_files("support")[split].read_text().splitlines()[:count]
        (root / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    tokenizer_dir = write_chat_tokenizer(tmp_path / "tokenizer")
    config = tiny_chat_sft_config(tmp_path / "run", tokenizer_dir, lr=1e-4, packed_sequence_size=None, seq_length=256)
    config.dataset = PrivateSpanSFTDatasetConfig(
        seq_length=256, dataset_root=str(root), do_test=False, dataloader_type="single", num_workers=0
    )
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
    dataset_provider([8, 8, 0], config.dataset, tokenizer=tokenizer)
    return state, model


def _context(state, model, user_state):
    callbacks = import_bridge("megatron.bridge.training.callbacks")
    return callbacks.CallbackContext(state=state, model=model, user_state=user_state)


def test_a_span_runs_frontier_point_recovers_only_its_span_tokens(span_state, tmp_path, capsys):
    from nemo_noise_plugin.jobs.reports.artifacts import RunReport
    from nemo_noise_plugin.jobs.reports.task_report import TaskReport
    from nemo_noise_plugin.privacy.span_ledger import span_ledger, span_token_counts

    state, model = span_state
    report = RunReport(tmp_path / "reports")
    task = TaskReport(report, export=False, frontier_tokens=FRONTIER_TOKENS, frontier_attacks=("nn_l2", "nn_cosine"))
    user_state: dict = {}
    task.on_train_start(_context(state, model, user_state))
    task.on_train_end(_context(state, model, user_state))
    report.finish()
    frontier = json.loads((report.folder / "task_report.json").read_text())["frontier"]

    # the rows audited: whole validation rows until their private_mask holds FRONTIER_TOKENS span tokens
    masks, total = [], 0
    for batch in task.batches["validation"]:
        for private in batch["private_mask"]:
            if total < FRONTIER_TOKENS:
                masks.append(private)
                total += int(private.sum())
    prompt_tokens = sum(int((batch["loss_mask"] == 0).sum()) for batch in task.batches["validation"])
    assert frontier["audited_tokens"] == total >= FRONTIER_TOKENS and total < prompt_tokens / 4  # spans, not prompts
    assert frontier["audit"]["tokens"]["real"] == total
    assert frontier["noise_config"]["tokens"] == "spans" and frontier["noise_config"]["training_only"] is False
    assert set(frontier["recovery"]) == {"nn_l2", "nn_cosine"}
    assert all(0.0 <= rate <= 1.0 for rate in frontier["recovery"].values())
    assert 0.0 <= frontier["exact_match"] <= 1.0  # scored with the span noise on (no private_mask would raise)

    counts = span_token_counts(torch.stack(masks))
    protected = frontier["protected"]
    assert protected["tokens"] == "private-span tokens" and protected["spans"] == sum(map(len, counts)) > len(masks)
    expected = span_ledger(NoiseConfig(**frontier["noise_config"]), counts, epochs=frontier["ledger"]["epochs"])
    spans = protected["span_ledger"]
    assert spans["per_example_epsilon"]["max"] == pytest.approx(max(e.epsilon for e in expected.examples))
    assert spans["per_span_epsilon"]["max"] > frontier["per_token_epsilon"] == 30.0

    printed = capsys.readouterr().out
    assert f"token recovery over {total} noised private-span tokens ({protected['spans']} spans" in printed
    assert "per span " in printed and "per example " in printed
