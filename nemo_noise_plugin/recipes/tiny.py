"""The tiny recipes: a small GPT (local layer spec, no Transformer Engine needed) for trying the plugin anywhere.

Both build a Bridge ``ConfigContainer`` around the plugin's providers. The data is the corpus shipped in the
package, written once as a Megatron indexed dataset of byte tokens (``nemo_noise_plugin.data.corpus``, under
``<dir>/<name>/data``) and read by Bridge's own GPT data pipeline with the null tokenizer (``data="mock"`` uses
Bridge's mock data instead), so they need no download; every setting is a dataclass field that overrides reach.

    from megatron.bridge.training.pretrain import pretrain
    from nemo_noise_plugin.training.forward_step import distillation_forward_step
    from nemo_noise_plugin.recipes import tiny_noise_distillation_config

    pretrain(tiny_noise_distillation_config(train_iters=50), distillation_forward_step)
"""

from __future__ import annotations

import os

import torch

from nemo_noise_plugin.data.corpus import CORPUS_VOCAB_SIZE, build_corpus_dataset
from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

TINY_MODEL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4)
"""The tiny GPT: ~3.3M parameters plus the embedding."""


CUDA_FREE_SETTINGS: dict = dict(
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
"""Transformer settings without CUDA-only fusions and without dropout (deterministic; runs on a CPU too)."""


def local_spec_settings() -> dict:
    """Provider settings for Megatron-Core's local layer spec: no Transformer Engine, ``CUDA_FREE_SETTINGS``.

    What the tiny recipes, the benchmarks and the CPU tests use, so they run wherever megatron-core does.
    """
    from megatron.core.transformer.enums import AttnBackend

    gpt_provider = import_bridge("megatron.bridge.models.gpt_provider")
    return dict(
        transformer_layer_spec=gpt_provider.local_layer_spec,
        attention_backend=AttnBackend.local,
        **CUDA_FREE_SETTINGS,
    )


def _tiny_model_settings(seq_length: int) -> dict:
    return dict(
        **TINY_MODEL,
        **local_spec_settings(),
        vocab_size=CORPUS_VOCAB_SIZE,
        seq_length=seq_length,
        make_vocab_size_divisible_by=128,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )


def _dataset(data: str, run_dir: str, seq_length: int):
    c = import_bridge("megatron.bridge.training.config")
    common = dict(
        seq_length=seq_length,
        random_seed=1234,
        reset_attention_mask=False,
        reset_position_ids=False,
        eod_mask_loss=False,
        num_dataset_builder_threads=1,
        dataloader_type="single",
        num_workers=0,
    )
    if data == "mock":
        return c.MockGPTDatasetConfig(**common)
    if data != "corpus":
        raise ValueError(f"tiny recipe: data={data!r} is invalid: expected 'corpus' (the shipped corpus) or 'mock'.")
    prefix = build_corpus_dataset(os.path.join(run_dir, "data"))
    return c.GPTDatasetConfig(data_path=prefix, split="9,1,0", **common)


def small_gpt_config(
    model,
    *,
    run_dir: str,
    train_iters: int,
    seq_length: int,
    lr: float,
    data: str = "corpus",
    vocab_size: int = CORPUS_VOCAB_SIZE,
):
    """A single-node Bridge ``ConfigContainer`` for a small GPT ``model``: Adam, bf16, DDP, null tokenizer.

    ``data`` is ``corpus`` (the shipped corpus, written under ``run_dir/data``) or ``mock``; checkpoints go to
    ``run_dir/checkpoints`` twice per run. The tiny recipes and the benchmarks start from it.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    c = import_bridge("megatron.bridge.training.config")
    tokenizer = import_bridge("megatron.bridge.training.tokenizers.config")
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
        dataset=_dataset(data, run_dir, seq_length),
        logger=c.LoggerConfig(log_interval=1),
        tokenizer=tokenizer.TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=vocab_size),
        checkpoint=c.CheckpointConfig(
            save=os.path.join(run_dir, "checkpoints"),
            load=os.path.join(run_dir, "checkpoints"),
            save_interval=max(train_iters // 2, 1),
            ckpt_format="torch_dist",
        ),
        rng=c.RNGConfig(seed=1234),
    )


def recipe_run_dir(dir: str | None, name: str) -> str:
    """A recipe's run folder: ``dir/name``, by default under ``./nemo_experiments``."""
    return os.path.join(dir if dir is not None else os.path.join(os.getcwd(), "nemo_experiments"), name)


def tiny_noise_sft_config(
    dir: str | None = None,
    name: str = "tiny_noise_sft",
    train_iters: int = 40,
    seq_length: int = 128,
    lr: float = 3e-4,
    noise: NoiseConfig | None = None,
    data: str = "corpus",
):
    """Noisy fine-tuning of the tiny GPT (NEFTune alpha 5 by default). Train with ``noise_forward_step``."""
    from nemo_noise_plugin.providers import NoisyGPTModelProvider

    model = NoisyGPTModelProvider(**_tiny_model_settings(seq_length), noise=noise or NoiseConfig(alpha=5.0))
    return small_gpt_config(
        model, run_dir=recipe_run_dir(dir, name), train_iters=train_iters, seq_length=seq_length, lr=lr, data=data
    )


def tiny_noise_distillation_config(
    dir: str | None = None,
    name: str = "tiny_noise_distillation",
    train_iters: int = 40,
    seq_length: int = 128,
    lr: float = 3e-4,
    noise: NoiseConfig | None = None,
    kd: KDConfig | None = None,
    data: str = "corpus",
):
    """Noisy student + frozen clean copy of itself, CE + forward KL. Train with ``distillation_forward_step``."""
    from nemo_noise_plugin.providers import NoisyDistillationProvider

    model = NoisyDistillationProvider(
        **_tiny_model_settings(seq_length), noise=noise or NoiseConfig(alpha=5.0), kd=kd or KDConfig()
    )
    return small_gpt_config(
        model, run_dir=recipe_run_dir(dir, name), train_iters=train_iters, seq_length=seq_length, lr=lr, data=data
    )
