"""The tiny recipes: a small GPT (local layer spec, no Transformer Engine needed) for trying the plugin anywhere.

Both build a Bridge ``ConfigContainer`` around the plugin's providers with Bridge's mock GPT data and the null
tokenizer, so they need no download; every setting is a dataclass field that overrides reach.

    from megatron.bridge.training.pretrain import pretrain
    from nemo_noise_plugin.forward_step import distillation_forward_step
    from nemo_noise_plugin.recipes import tiny_noise_distillation_config

    pretrain(tiny_noise_distillation_config(train_iters=50), distillation_forward_step)
"""

from __future__ import annotations

import os

import torch

from nemo_noise_plugin.bridge_imports import import_bridge
from nemo_noise_plugin.distillation.kd_config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig

TINY_MODEL = dict(num_layers=4, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8, vocab_size=1024)
"""The tiny GPT: ~13M parameters."""


def _tiny_model_settings(seq_length: int) -> dict:
    from megatron.core.transformer.enums import AttnBackend

    gpt_provider = import_bridge("megatron.bridge.models.gpt_provider")
    return dict(
        **TINY_MODEL,
        seq_length=seq_length,
        make_vocab_size_divisible_by=128,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        transformer_layer_spec=gpt_provider.local_layer_spec,
        attention_backend=AttnBackend.local,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _tiny_container(model, *, dir: str | None, name: str, train_iters: int, seq_length: int, lr: float):
    from megatron.core.distributed import DistributedDataParallelConfig

    c = import_bridge("megatron.bridge.training.config")
    tokenizer = import_bridge("megatron.bridge.training.tokenizers.config")
    run_dir = os.path.join(dir if dir is not None else os.path.join(os.getcwd(), "nemo_experiments"), name)
    return c.ConfigContainer(
        model=model,
        train=c.TrainingConfig(train_iters=train_iters, global_batch_size=8, micro_batch_size=2),
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
            lr_warmup_iters=0,
            start_weight_decay=0.0,
            end_weight_decay=0.0,
            weight_decay_incr_style="constant",
        ),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True),
        dataset=c.MockGPTDatasetConfig(
            seq_length=seq_length,
            random_seed=1234,
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
            num_dataset_builder_threads=1,
            dataloader_type="single",
            num_workers=0,
        ),
        logger=c.LoggerConfig(log_interval=1),
        tokenizer=tokenizer.TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=TINY_MODEL["vocab_size"]),
        checkpoint=c.CheckpointConfig(
            save=os.path.join(run_dir, "checkpoints"),
            load=os.path.join(run_dir, "checkpoints"),
            save_interval=max(train_iters // 2, 1),
            ckpt_format="torch_dist",
        ),
        rng=c.RNGConfig(seed=1234),
    )


def tiny_noise_sft_config(
    dir: str | None = None,
    name: str = "tiny_noise_sft",
    train_iters: int = 40,
    seq_length: int = 256,
    lr: float = 3e-4,
    noise: NoiseConfig | None = None,
):
    """Noisy fine-tuning of the tiny GPT (NEFTune alpha 5 by default). Train with ``noise_forward_step``."""
    from nemo_noise_plugin.providers import NoisyGPTModelProvider

    model = NoisyGPTModelProvider(**_tiny_model_settings(seq_length), noise=noise or NoiseConfig(alpha=5.0))
    return _tiny_container(model, dir=dir, name=name, train_iters=train_iters, seq_length=seq_length, lr=lr)


def tiny_noise_distillation_config(
    dir: str | None = None,
    name: str = "tiny_noise_distillation",
    train_iters: int = 40,
    seq_length: int = 256,
    lr: float = 3e-4,
    noise: NoiseConfig | None = None,
    kd: KDConfig | None = None,
):
    """Noisy student + frozen clean copy of itself, CE + forward KL. Train with ``distillation_forward_step``."""
    from nemo_noise_plugin.distillation.provider import NoisyDistillationProvider

    model = NoisyDistillationProvider(
        **_tiny_model_settings(seq_length), noise=noise or NoiseConfig(alpha=5.0), kd=kd or KDConfig()
    )
    return _tiny_container(model, dir=dir, name=name, train_iters=train_iters, seq_length=seq_length, lr=lr)
