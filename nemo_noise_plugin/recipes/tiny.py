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
from typing import TYPE_CHECKING, Any

from nemo_noise_plugin.recipes.common import (
    bf16_settings,
    default_kd,
    default_noise,
    finetuning_config,
    local_spec_settings,
    recipe_run_dir,
)
from nemo_noise_plugin.recipes.registry import register_recipe
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

if TYPE_CHECKING:
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig

__all__ = [
    "TINY_MODEL",
    "small_gpt_config",
    "tiny_noise_distillation_config",
    "tiny_noise_sft_config",
]

TINY_MODEL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4)
"""The tiny GPT: ~3.3M parameters plus the embedding."""


def _tiny_model_settings(seq_length: int) -> dict:
    from nemo_noise_plugin.data.corpus import CORPUS_VOCAB_SIZE

    return dict(
        **TINY_MODEL,
        **local_spec_settings(),
        vocab_size=CORPUS_VOCAB_SIZE,
        seq_length=seq_length,
        make_vocab_size_divisible_by=128,
        **bf16_settings(),
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
    from nemo_noise_plugin.data.corpus import build_corpus_dataset

    prefix = build_corpus_dataset(os.path.join(run_dir, "data"))
    return c.GPTDatasetConfig(data_path=prefix, split="9,1,0", **common)


def small_gpt_config(
    model: Any,
    *,
    run_dir: str,
    train_iters: int,
    seq_length: int,
    lr: float,
    data: str = "corpus",
    vocab_size: int | None = None,
):
    """A single-node Bridge ``ConfigContainer`` for a small GPT ``model``: ``common.finetuning_config`` with Bridge's
    GPT data and the null tokenizer (``vocab_size``, default the corpus's ``CORPUS_VOCAB_SIZE``), 8 sequences a step
    in micro-batches of 2, no warm-up.

    ``data`` is ``corpus`` (the shipped corpus, written under ``run_dir/data``) or ``mock``; checkpoints go to
    ``run_dir/checkpoints`` twice per run. The tiny recipes and the benchmarks start from it.
    """
    if vocab_size is None:
        from nemo_noise_plugin.data.corpus import CORPUS_VOCAB_SIZE

        vocab_size = CORPUS_VOCAB_SIZE
    return finetuning_config(
        model,
        run_dir=run_dir,
        dataset=_dataset(data, run_dir, seq_length),
        tokenizer=dict(tokenizer_type="NullTokenizer", vocab_size=vocab_size),
        train_iters=train_iters,
        lr=lr,
        global_batch_size=8,
        micro_batch_size=2,
        lr_warmup_iters=0,
    )


def student_config(
    providers: tuple[type, type],
    model_settings: dict[str, Any],
    dir: str | None,
    name: str,
    *,
    noise: NoiseConfig | None,
    kd: KDConfig | None,
    **run: Any,
):
    """``small_gpt_config`` of a small model built from ``model_settings`` by ``providers`` (the plugin's noisy
    provider, and its distillation provider when ``kd`` is given: a noisy student of its clean copy); ``run`` is
    ``small_gpt_config``'s ``train_iters``, ``seq_length``, ``lr`` and ``data``."""
    noisy, distillation = providers
    settings = dict(model_settings, noise=default_noise(noise))
    model = noisy(**settings) if kd is None else distillation(**settings, kd=kd)
    return small_gpt_config(model, run_dir=recipe_run_dir(dir, name), **run)


def _tiny_config(dir: str | None, name: str, *, noise: NoiseConfig | None, kd: KDConfig | None = None, **run: Any):
    """The tiny GPT as the plugin's provider (a noisy student of its clean copy with ``kd``) in ``small_gpt_config``."""
    from nemo_noise_plugin.providers import NoisyDistillationProvider, NoisyGPTModelProvider

    providers = (NoisyGPTModelProvider, NoisyDistillationProvider)
    return student_config(providers, _tiny_model_settings(run["seq_length"]), dir, name, noise=noise, kd=kd, **run)


@register_recipe("tiny_noise_sft", embedded_corpus=True, reports=("robustness",))
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
    return _tiny_config(dir, name, train_iters=train_iters, seq_length=seq_length, lr=lr, data=data, noise=noise)


@register_recipe("tiny_noise_distillation", embedded_corpus=True, reports=("robustness",), clean_pretrain_steps=100)
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
    return _tiny_config(
        dir, name, train_iters=train_iters, seq_length=seq_length, lr=lr, data=data, noise=noise, kd=default_kd(kd)
    )
