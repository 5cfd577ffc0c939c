"""What the recipe families share (Bridge's ``recipes/common.py`` habit): the ConfigContainer, defaults, settings.

The ``ConfigContainer`` a fine-tuning run of the plugin gets (``finetuning_config``), the noise and KD defaults and
their attachment to a provider, the layer-spec and precision settings, one CUDA graph per training step
(``use_step_graph``), and the run folder. Each family module
(``tiny``, ``smollm2``, ``hf_models``) states only what differs: its model, data, tokenizer and sizes.

The module's top imports no torch and no Megatron (``import nemo_noise_plugin.recipes`` stays cheap); every function
imports what it builds with.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import SettingError, check_choice, check_int

if TYPE_CHECKING:
    from nemo_noise_plugin.distillation.config import KDConfig

__all__ = [
    "CUDA_FREE_SETTINGS",
    "DEFAULT_NOISE_ALPHA",
    "STEP_GRAPH_WARMUP_STEPS",
    "bf16_settings",
    "check_fixed_width_batches",
    "check_graph_memory_pools",
    "default_kd",
    "default_noise",
    "finetuning_config",
    "local_spec_settings",
    "noisy_provider",
    "recipe_run_dir",
    "use_step_graph",
]

DEFAULT_NOISE_ALPHA = 5.0
"""The recipes' noise when none is given: NEFTune with alpha 5 (``NoiseConfig(alpha=5.0)``)."""

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


def local_spec_settings(attention: str = "unfused") -> dict:
    """Provider settings for Megatron-Core's local layer spec: no Transformer Engine, ``CUDA_FREE_SETTINGS``.

    What the tiny and SmolLM2 recipes, the benchmarks and the CPU tests use, so they run wherever megatron-core does.
    ``attention`` is the plugin provider's ``core_attention`` (``model.sdpa_attention.CORE_ATTENTION``): ``sdpa``
    runs the local spec's attention on PyTorch's fused kernels (flash attention on a GPU), with the same weights;
    the default leaves the field out, so the settings also fit Bridge's own providers.
    """
    from megatron.core.transformer.enums import AttnBackend

    from nemo_noise_plugin.model.sdpa_attention import CORE_ATTENTION

    check_choice("attention", attention, CORE_ATTENTION)
    gpt_provider = import_bridge("megatron.bridge.models.gpt_provider")
    return dict(
        transformer_layer_spec=gpt_provider.local_layer_spec,
        attention_backend=AttnBackend.local,
        **({"core_attention": attention} if attention != "unfused" else {}),
        **CUDA_FREE_SETTINGS,
    )


def bf16_settings() -> dict:
    """Provider settings for bf16 weights and pipeline transfers (``bf16``, ``params_dtype``, ``pipeline_dtype``)."""
    import torch

    return dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)


def default_noise(noise: NoiseConfig | None) -> NoiseConfig:
    """``noise``, or the recipes' default (NEFTune, ``DEFAULT_NOISE_ALPHA``) when None."""
    return noise or NoiseConfig(alpha=DEFAULT_NOISE_ALPHA)


def default_kd(kd: KDConfig | None) -> KDConfig:
    """``kd``, or ``KDConfig()`` (CE + forward KL from the clean copy) when None: the distillation recipes' default."""
    from nemo_noise_plugin.distillation.config import KDConfig

    return kd or KDConfig()


def noisy_provider(source: Any, noise: NoiseConfig | None = None, kd: KDConfig | None = None) -> Any:
    """``source`` (an AutoBridge or Bridge-recipe provider) as the plugin's provider, hooks kept
    (``providers.noisy_provider_from``): noisy with ``default_noise(noise)``; a noisy student of its clean copy when
    ``kd`` is given."""
    from nemo_noise_plugin.providers.conversion import noisy_provider_from

    return noisy_provider_from(source, default_noise(noise), kd)


def recipe_run_dir(dir: str | None, name: str) -> str:
    """A recipe's run folder: ``dir/name``, by default under ``./nemo_experiments``."""
    return os.path.join(dir if dir is not None else os.path.join(os.getcwd(), "nemo_experiments"), name)


def finetuning_config(
    model: Any,
    *,
    run_dir: str,
    dataset: Any,
    tokenizer: Mapping[str, Any],
    train_iters: int,
    lr: float,
    global_batch_size: int,
    micro_batch_size: int,
    lr_warmup_iters: int,
) -> Any:  # Bridge's ConfigContainer (megatron.bridge is imported only through upstream.bridge_imports)
    """The single-node Bridge ``ConfigContainer`` of the plugin's recipes around ``model``.

    Adam (``lr``, decaying to ``lr / 10`` on a cosine schedule, no weight decay, gradients clipped at 1), bf16, DDP
    with fp32 gradient reduction, validation and checkpoints twice per run (checkpoints under ``run_dir/checkpoints``,
    resumed from there), logging every step, seed 1234.

    Args:
        model: The provider (``config.model``).
        run_dir: The run folder (``recipe_run_dir``); checkpoints go to ``run_dir/checkpoints``.
        dataset: The dataset config (``config.dataset``), built by the family.
        tokenizer: ``TokenizerConfig`` fields, e.g. ``dict(tokenizer_type="NullTokenizer", vocab_size=384)``.
        train_iters: Training steps.
        lr: The peak learning rate.
        global_batch_size: Sequences per step.
        micro_batch_size: Sequences per forward pass.
        lr_warmup_iters: Linear warm-up steps before the cosine decay.

    Returns:
        The ``ConfigContainer``.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    c = import_bridge("megatron.bridge.training.config")
    tokenizer_config = import_bridge("megatron.bridge.training.tokenizers.config")
    every_half_run = max(train_iters // 2, 1)
    return c.ConfigContainer(
        model=model,
        train=c.TrainingConfig(
            train_iters=train_iters, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size
        ),
        validation=c.ValidationConfig(eval_interval=every_half_run, eval_iters=2),
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
            lr_warmup_iters=lr_warmup_iters,
            start_weight_decay=0.0,
            end_weight_decay=0.0,
            weight_decay_incr_style="constant",
        ),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True),
        dataset=dataset,
        logger=c.LoggerConfig(log_interval=1),
        tokenizer=tokenizer_config.TokenizerConfig(**tokenizer),
        checkpoint=c.CheckpointConfig(
            save=os.path.join(run_dir, "checkpoints"),
            load=os.path.join(run_dir, "checkpoints"),
            save_interval=every_half_run,
            ckpt_format="torch_dist",
        ),
        rng=c.RNGConfig(seed=1234),
    )


# --- one CUDA graph per training step ------------------------------------------------------------------------------
# A small model's step is host-bound: the GPU waits while Python launches every kernel (SmolLM2-135M at micro-batch 4:
# benchmarks/SFT_THROUGHPUT.md). Megatron-Core's FullCudaGraphWrapper captures every micro-batch's forward and
# backward once and replays them each step: the one graph mode Bridge's loop offers without Transformer Engine. The
# noise under it: the provider builds replayable noise keys and the plugin's launchers publish each step's keys before
# the replay (training.noise_step_publisher), so every replayed step adds its own noise.

STEP_GRAPH_WARMUP_STEPS = 2
"""Eager steps before the capture (Megatron's warm-up: allocations and lazy initialisation happen outside it)."""


def use_step_graph(config: Any, warmup_steps: int = STEP_GRAPH_WARMUP_STEPS) -> Any:
    """Set ``config`` (a Bridge ``ConfigContainer``) to replay each training step from one CUDA graph; returns it.

    What Bridge's ``full_iteration`` graph needs, set together:

    - ``model.cuda_graph_impl="full_iteration"`` and ``model.cuda_graph_warmup_steps`` eager steps before the capture;
    - ``model.use_te_rng_tracker=True``: the graph-safe RNG tracker (Megatron's own tracker without TE);
    - ``model.cuda_graph_use_single_mempool=False``: the training and validation graphs each get their own memory
      pool. With Megatron's shared pool, a validation graph first captured after ``train()`` returns (Bridge's
      final evaluation of a resumed run, whose in-run evaluations were the eager warm-up ones) is captured into the
      pool of the training graph Bridge has just deleted, and PyTorch's allocator aborts the capture
      (``it->second->use_count > 0 INTERNAL ASSERT``; H100, torch 2.11, 2026-12-06);
    - ``rerun_state_machine.check_for_nan_in_loss=False``: Bridge refuses the NaN check's host read inside the graph
      (the noise keeps its own finiteness check, read outside the graph: ``noise/replayable.py``);
    - fixed-width batches: the graph copies each micro-batch into static buffers, so an SFT dataset pads every row to
      ``seq_length`` (``dataset.dataset_kwargs["pad_to_max_length"]``; the losses are unchanged: the padding is masked
      and the noise's NEFTune length comes from the loss mask).

    Every one is an ordinary config field, so an override (``model.cuda_graph_impl=none``) turns the graph off again
    (``check_for_nan_in_loss`` and the padding then stay as set here unless overridden too). Packed rows are refused.
    """
    check_int("warmup_steps", warmup_steps, minimum=1)
    if getattr(config.dataset, "enable_offline_packing", False):
        raise SettingError(
            "dataset.enable_offline_packing",
            True,
            "False with the step graph",
            why=": packed rows under a full-iteration graph also need padded cu_seqlens and Transformer Engine's "
            "attention, and were not measured here; train packed rows eagerly (a recipe's step_graph=False)",
        )
    model = config.model
    model.cuda_graph_impl = "full_iteration"
    model.cuda_graph_warmup_steps = warmup_steps
    model.use_te_rng_tracker = True
    model.cuda_graph_use_single_mempool = False
    config.rerun_state_machine.check_for_nan_in_loss = False
    if _is_finetuning_dataset(config.dataset):
        config.dataset.dataset_kwargs = {**(config.dataset.dataset_kwargs or {}), "pad_to_max_length": True}
    return config


def check_fixed_width_batches(config: Any) -> None:
    """Refuse a full-iteration graph over an SFT dataset whose batches are as wide as their longest row.

    ``SettingError`` naming the setting: the replay would copy a narrower batch into the captured static buffers and
    fail there, after the model is built. Packed SFT data is Bridge's own check (``pad_cu_seqlens``).
    """
    is_full_iteration = import_bridge("megatron.bridge.utils.cuda_graph").is_full_iteration_cuda_graph
    dataset = getattr(config, "dataset", None)
    if not is_full_iteration(config.model) or not _is_finetuning_dataset(dataset):
        return
    if getattr(dataset, "enable_offline_packing", False):
        return
    kwargs = getattr(dataset, "dataset_kwargs", None) or {}
    if kwargs.get("pad_to_max_length") is not True:
        raise SettingError(
            "dataset.dataset_kwargs.pad_to_max_length",
            kwargs.get("pad_to_max_length"),
            "true",
            context=" with model.cuda_graph_impl=full_iteration",
            why=": the graph replays fixed-shape batches and SFT rows are otherwise as wide as the longest in their "
            "batch (set dataset.dataset_kwargs={pad_to_max_length:true}, or use recipes.common.use_step_graph)",
        )


def check_graph_memory_pools(config: Any) -> None:
    """Refuse a full-iteration graph that shares one memory pool with an evaluation's graph.

    ``SettingError`` naming ``model.cuda_graph_use_single_mempool`` (Megatron's default is true): Bridge deletes the
    training graph when ``train()`` returns, and a validation graph first captured after that (a resumed run's final
    evaluation) is captured into the deleted graph's pool and aborts in PyTorch's caching allocator
    (``use_count > 0``), after the whole run trained (benchmarks/SFT_THROUGHPUT.md). Without evaluation no second graph
    is captured and one pool is fine.
    """
    is_full_iteration = import_bridge("megatron.bridge.utils.cuda_graph").is_full_iteration_cuda_graph
    model = config.model
    if not is_full_iteration(model) or getattr(model, "cuda_graph_use_single_mempool", False) is not True:
        return
    validation = getattr(config, "validation", None)
    eval_iters = getattr(validation, "eval_iters", None) or getattr(config.train, "eval_iters", None)
    if not eval_iters:
        return
    raise SettingError(
        "model.cuda_graph_use_single_mempool",
        True,
        "false",
        context=f" with model.cuda_graph_impl=full_iteration and {eval_iters} evaluation iterations",
        why=": the validation graph of a resumed run's final evaluation would be captured into the pool of the "
        "training graph Bridge deletes when train() returns (set model.cuda_graph_use_single_mempool=false, as "
        "recipes.common.use_step_graph does)",
    )


def _is_finetuning_dataset(dataset: Any) -> bool:
    """Bridge's SFT dataset config (``GPTSFTDatasetConfig``: rows padded per batch unless ``pad_to_max_length``)."""
    return dataset is not None and hasattr(dataset, "dataset_kwargs") and hasattr(dataset, "preprocessing")
