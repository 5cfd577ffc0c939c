"""A whole CPU training run with ``tokens='spans'``: Bridge's provider registry builds the private-span datasets,
their batches carry ``private_mask`` and the noisy forward step trains on it."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from tests.support.chat_sft import tiny_chat_sft_config, write_chat_tokenizer


@pytest.mark.slow
def test_a_cpu_run_trains_on_the_span_masks_of_the_jsonl(tmp_path, monkeypatch, megatron_cpu):
    from nemo_noise_plugin.data.span_dataset import PrivateSpanSFTDatasetConfig
    from nemo_noise_plugin.jobs.cpu.loop import run_cpu_loop
    from nemo_noise_plugin.training.forward_step import noise_forward_step

    monkeypatch.setenv("MASTER_PORT", str(29600 + torch.randint(0, 900, ()).item()))
    rows = [
        {
            "messages": [
                {"role": "system", "content": "You are a calculator."},
                {"role": "user", "content": f"My number is {100 + i}. What is {i} + 2?"},
                {"role": "assistant", "content": str(i + 2)},
            ],
            "private_spans": [{"message": 1, "start": 13, "end": 16}],  # the three digits of 100 + i
        }
        for i in range(8)
    ]
    root = tmp_path / "data"
    root.mkdir()
    for split in ("training", "validation"):
        (root / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tiny_chat_sft_config(tmp_path / "run", write_chat_tokenizer(tmp_path / "tokenizer"), train_iters=2)
    config.dataset = PrivateSpanSFTDatasetConfig(
        seq_length=config.dataset.seq_length,
        dataset_root=str(root),
        do_test=False,
        dataloader_type="single",
        num_workers=0,
    )
    config.model.noise = NoiseConfig(mechanism="gaussian_mechanism", epsilon=5.0, clip_norm=1.0, tokens="spans")
    config.model.bf16, config.model.params_dtype, config.model.pipeline_dtype = False, torch.float32, torch.float32
    config.optimizer.bf16 = False
    seen, losses = [], []

    def step(state, data_iterator, model):
        batch = next(data_iterator)
        seen.append(int(batch["private_mask"].sum()))
        output, loss_function = noise_forward_step(state, iter([batch]), model)
        return output, lambda tensor: _kept(losses, loss_function(tensor))

    run_cpu_loop(config, step)
    assert seen == [8, 8]  # 4 examples a batch, "1xy" is two tokens of the tiny tokenizer each
    assert len(losses) == 2 and all(torch.isfinite(loss).all() for loss in losses)


def _kept(losses, result):
    losses.append(result[0].detach())
    return result
