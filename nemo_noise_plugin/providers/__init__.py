"""Megatron-Bridge model providers for noisy models and noisy-student distillation.

``NoisyGPTModelProvider`` is Bridge's ``GPTModelProvider`` with the noise settings as one more dataclass field, so
everything that configures a Bridge provider (recipes, Hydra-style ``model.noise.alpha=10`` overrides, YAML) reaches
them. ``provide`` builds the plain Megatron-Core model exactly as Bridge does, then makes it noisy on the chunk that
``should_attach_noise`` selects (the first pipeline stage, virtual stage 0).

``NoisyDistillationProvider`` adds the distillation settings (``kd``): a noisy student trained against a frozen
clean copy of itself. Unlike Bridge's ``DistillationProvider`` it has no second provider to keep in sync: the teacher
is the student's own weights, it never mirrors attributes onto a teacher, and it changes no class globally.
``provide`` builds the student only; ``provide_distributed_model`` also snapshots a teacher per model chunk (see
``distillation.teacher_weights`` for how its weights are settled after Bridge loads checkpoints). Checkpoints,
exports and the optimizer see the student only. Train with ``training.forward_step.distillation_forward_step``.

Both are the Bridge class plus two mixins, ``NoiseProviderMixin`` (the ``noise`` field, its gate, the noisy model)
and ``DistillationProviderMixin`` (``kd``, the teacher); ``providers.hybrid`` puts the same two on Bridge's
``HybridModelProvider`` (``NoisyHybridModelProvider``, ``NoisyHybridDistillationProvider``, also importable from
here).

``noisy_provider_from`` (``providers.conversion``, also importable from here) turns a provider Bridge already made
(``AutoBridge.to_megatron_provider()``, GPT or hybrid) into one of the plugin's providers, keeping every field and the
registered pre-/post-wrap hooks (HF weight loading is a pre-wrap hook). Importing this module also adds
``nemo_noise_plugin.`` to Bridge's ``_target_`` allowlist, so run configs (``ConfigContainer.to_yaml`` /
``from_yaml``, a checkpoint's ``run_config.yaml``) can name the plugin's classes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.utils import unwrap_model

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.distillation.pipeline_teacher import attach_teacher_pipe, build_teacher_pipes
from nemo_noise_plugin.distillation.teacher import build_clean_teacher
from nemo_noise_plugin.distillation.teacher_weights import attach_teacher, check_teacher_checkpoint
from nemo_noise_plugin.model.make_noisy import make_noisy
from nemo_noise_plugin.model.sdpa_attention import CORE_ATTENTION, use_sdpa_attention
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.schedule_plan.builder import use_plugin_schedule_plan
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.utils import should_attach_noise
from nemo_noise_plugin.validation import SettingError, check_choice

GPTModelProvider = import_bridge("megatron.bridge.models.gpt_provider").GPTModelProvider

TARGET_PREFIX = "nemo_noise_plugin."
"""Module prefix added to Bridge's ``_target_`` allowlist when this module is imported."""

import_bridge("megatron.bridge.utils.instantiate_utils").register_allowed_target_prefix(TARGET_PREFIX)

__all__ = [
    "DISTILLATION_PROVIDERS",
    "TARGET_PREFIX",
    "DistillationProviderMixin",
    "NoiseProviderMixin",
    "NoisyDistillationProvider",
    "NoisyGPTModelProvider",
    "NoisyHybridDistillationProvider",
    "NoisyHybridModelProvider",
    "UnsupportedProviderError",
    "noisy_provider_from",
]

_LAZY_NAMES = {
    "NoisyHybridDistillationProvider": "hybrid",
    "NoisyHybridModelProvider": "hybrid",
    "UnsupportedProviderError": "conversion",
    "noisy_provider_from": "conversion",
}
"""Names of ``providers.hybrid`` and ``providers.conversion`` that this package also answers to (loaded on first
access: both modules build on this one)."""


def __getattr__(name: str) -> Any:
    """The hybrid providers from ``providers.hybrid``; ``noisy_provider_from`` from ``providers.conversion``."""
    if name in _LAZY_NAMES:
        import importlib

        return getattr(importlib.import_module(f"nemo_noise_plugin.providers.{_LAZY_NAMES[name]}"), name)
    raise AttributeError(f"module 'nemo_noise_plugin.providers' has no attribute {name!r}")


@dataclass
class NoiseProviderMixin:
    """The noise half of the plugin's providers, on any Bridge provider class: the ``noise`` field, its gate at
    ``finalize``, and the noisy model on the chunk that ``should_attach_noise`` selects.

    Put it first in the bases (``class P(NoiseProviderMixin, GPTModelProvider)``): its ``finalize`` and ``provide``
    run the Bridge class's own through ``super()``. ``NoisyGPTModelProvider`` and ``providers.hybrid``'s
    ``NoisyHybridModelProvider`` are it on Bridge's GPT and hybrid providers.
    """

    noise: NoiseConfig = field(default_factory=NoiseConfig)
    """Embedding-noise settings; validated when set."""

    core_attention: str = "unfused"
    """Megatron-Core's local ``DotProductAttention`` as built (``unfused``) or on PyTorch's fused SDPA kernels
    (``sdpa``, ``model.sdpa_attention``: the same parameters and checkpoints); Transformer Engine attention is kept."""

    @property
    def provider_name(self) -> str:
        """The class name the error messages start with (``NoisyGPTModelProvider``)."""
        return type(self).__name__

    @staticmethod
    def decoder_layer_count(provider: Any) -> int | None:
        """How many decoder layers ``provider`` builds (``num_layers``); a static method, so that the override
        check can ask it of the provider as the overrides will leave it."""
        return provider.num_layers

    def finalize(self) -> None:
        """The noise settings checked as they are now (``NoiseConfig.validate``), then Bridge's own checks.

        The noise settings' one gate after construction: Bridge's ``ConfigContainer.validate``
        (``pretrain``/``finetune``) and the CPU loop call this before any model is built, so a value assigned after
        construction (``cfg.model.noise.alpha = -1``) is refused here with a ``SettingError`` naming it; ``provide``
        trusts what passed it. An enabled noise of magnitude 0 (``alpha=0``) is allowed, with a one-line warning.
        """
        self.validate_noise()
        check_choice(f"{self.provider_name}.core_attention", self.core_attention, CORE_ATTENTION)
        silent = self.noise.silent_field
        if silent is not None:
            warnings.warn(
                f"NoiseConfig.{silent}={getattr(self.noise, silent)!r} with enabled=True adds no noise: this run "
                f"trains a plain model (set {silent} > 0 for noise, or enabled=false to say so).",
                UserWarning,
                stacklevel=2,
            )
        super().finalize()

    @property
    def replays_training_steps(self) -> bool:
        """Whether Bridge will replay each training step from one CUDA graph (``cuda_graph_impl="full_iteration"``):
        then the noisy model keeps its noise keys in device memory (``noise/replayable.py``), published before each
        step by ``training.noise_step_publisher.PublishNoiseStep``, so every replay adds its own step's noise."""
        return import_bridge("megatron.bridge.utils.cuda_graph").is_full_iteration_cuda_graph(self)

    def validate_noise(self) -> None:
        """Check ``noise``: a ``NoiseConfig`` (``TypeError`` otherwise) whose fields are valid now (``ValueError``)."""
        _noise_config_of(self).validate()

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        """Build one model chunk as the Bridge provider's ``provide`` does; noisy where ``should_attach_noise`` says.

        Bridge builds only from a finalized provider, so ``noise`` is the one ``finalize`` checked: not checked again.
        """
        noise = _noise_config_of(self)  # a NoiseConfig still (a type check, not the fields again)
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if self.core_attention == "sdpa":  # after Bridge's provide, which puts DotProductAttention back in local specs
            use_sdpa_attention(model)
        if should_attach_noise(vp_stage):
            make_noisy(model, noise, checked=True, replayable=self.replays_training_steps)
        else:  # no noise here, but the plugin's schedule-plan nodes all the same (see PluginSchedulePlanMixin)
            use_plugin_schedule_plan(model)
        return model


def _noise_config_of(provider: NoiseProviderMixin) -> NoiseConfig:
    """``provider.noise``; ``TypeError`` naming the provider unless it is a ``NoiseConfig``."""
    if not isinstance(provider.noise, NoiseConfig):
        raise TypeError(
            f"{provider.provider_name}.noise must be a NoiseConfig, got {type(provider.noise).__name__}: "
            f"{provider.noise!r}."
        )
    return provider.noise


@dataclass
class NoisyGPTModelProvider(NoiseProviderMixin, GPTModelProvider):
    """A ``GPTModelProvider`` whose first-stage model chunk adds embedding noise (see ``NoiseConfig``)."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> GPTModel:
        """Build one model chunk as ``GPTModelProvider.provide`` does; noisy where ``should_attach_noise`` says."""
        return super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


@dataclass
class DistillationProviderMixin:
    """The distillation half: the ``kd`` settings, their checks, and a frozen clean teacher for each model chunk.

    Put it before a ``NoiseProviderMixin`` provider in the bases (``class P(DistillationProviderMixin,
    NoisyGPTModelProvider)``). The teacher is ``distillation.teacher.build_clean_teacher`` of each built chunk, for
    every model class alike.
    """

    kd: KDConfig = field(default_factory=KDConfig)
    """Distillation settings (loss, temperature, weights, tokens, hidden-state matching)."""
    teacher_shares_frozen_modules: bool = False
    """Share the student's fully frozen submodules with the teacher instead of copying them (saves their memory)."""
    teacher_checkpoint: str | None = None
    """Distil from these weights instead of the student's start weights: a Megatron checkpoint (a run's
    ``checkpoints`` folder or one ``iter_*`` folder of it, e.g. a clean fine-tuned model) or a Hugging Face folder of
    the same architecture. Loaded into the teacher at the first distillation step, also after a resume."""

    def finalize(self) -> None:
        """The noise settings and Bridge's checks, plus the distillation constraints (before any GPU memory is
        touched); a KD that is enabled but weighs nothing (``kd_weight=0``, no hidden loss) gets a one-line warning.

        The distillation settings' one gate after construction (``validate_kd``, then ``validate_distillation``);
        ``provide_distributed_model`` trusts what passed it."""
        super().finalize()
        self.validate_kd()
        self.validate_distillation()
        kd = self.kd
        if kd.enabled and kd.kd_weight == 0 and kd.hidden_weight == 0:
            warnings.warn(
                "KDConfig.kd_weight=0 with enabled=True and hidden_weight=0 distils nothing: this run trains on "
                "cross-entropy alone while the teacher still runs (set kd_weight > 0, or kd.enabled=false).",
                UserWarning,
                stacklevel=2,
            )

    def validate_kd(self) -> None:
        """Check ``kd``: a ``KDConfig`` (``TypeError`` otherwise) whose fields are valid now (``KDConfig.validate``)."""
        if not isinstance(self.kd, KDConfig):
            raise TypeError(f"{self.provider_name}.kd must be a KDConfig, got {type(self.kd).__name__}.")
        self.kd.validate()

    def validate_distillation(self) -> None:
        """Reject settings the distillation path does not support, naming the setting and the value: the teacher
        checkpoint and the provider's settings against ``kd``'s (whose own fields ``KDConfig`` checks).

        Runs at ``finalize`` and, on the values an override would leave, in ``training.overrides.apply_overrides``.
        """
        name = self.provider_name
        if not isinstance(self.kd, KDConfig):
            raise TypeError(f"{name}.kd must be a KDConfig, got {type(self.kd).__name__}.")
        check_teacher_checkpoint(self.teacher_checkpoint)
        if not self.kd.enabled:
            return
        if (self.pipeline_model_parallel_size or 1) > 1 and self.kd.hidden_loss != "none":
            raise ValueError(
                f"{name}: kd.hidden_loss={self.kd.hidden_loss!r} is not supported with "
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size}: the chosen layers' outputs live "
                "on other stages than the loss; use kd.hidden_loss=none, or pipeline_model_parallel_size=1."
            )
        if (self.pipeline_model_parallel_size or 1) > 1 and getattr(self, "mtp_num_layers", None):
            raise ValueError(
                f"{name}: mtp_num_layers={self.mtp_num_layers} is not supported with distillation "
                f"at pipeline_model_parallel_size={self.pipeline_model_parallel_size} (the pipeline teacher runs "
                "the decoder and output layer only); use mtp_num_layers=None, or pipeline_model_parallel_size=1."
            )
        if getattr(self, "overlap_moe_expert_parallel_comm", False) and self.kd.hidden_loss != "none":
            raise ValueError(
                f"{name}: kd.hidden_loss={self.kd.hidden_loss!r} is not supported with "
                "overlap_moe_expert_parallel_comm=True: in the fine-grained schedule plan only the post-process "
                "node's output carries gradients, and intermediate layers' outputs are not part of it; use "
                "kd.hidden_loss=none or turn overlap_moe_expert_parallel_comm off."
            )
        if self.kd.hidden_loss != "none":
            layers = self.decoder_layer_count(self)
            for index in self.kd.hidden_layers:
                if layers is not None and not 0 <= index < layers:
                    raise SettingError(
                        "KDConfig.hidden_layers",
                        self.kd.hidden_layers,
                        f"layer indices in 0..{layers - 1}",
                        context=f" with num_layers={layers}",
                    )

    def provide_distributed_model(self, *args: Any, **kwargs: Any) -> list:
        """Bridge's model building and wrapping, then a clean teacher snapshot for each model chunk.

        Under pipeline parallelism the chunks also get the teacher's point-to-point channel
        (``distillation.pipeline_teacher``); creating it is collective over all ranks, as model building is. The
        settings are the ones ``finalize`` checked (Bridge builds only from a finalized provider).
        """
        model = super().provide_distributed_model(*args, **kwargs)
        if self.kd.enabled:
            for chunk in model:
                attach_teacher(
                    chunk, build_clean_teacher(chunk, share_frozen_modules=self.teacher_shares_frozen_modules)
                )
            if (self.pipeline_model_parallel_size or 1) > 1:
                pipe = build_teacher_pipes(unwrap_model(model[0]).pg_collection.pp)
                for chunk in model:
                    attach_teacher_pipe(chunk, pipe)
        return model


@dataclass
class NoisyDistillationProvider(DistillationProviderMixin, NoisyGPTModelProvider):
    """A ``NoisyGPTModelProvider`` whose model chunks carry a frozen clean teacher for distillation."""


DISTILLATION_PROVIDERS: tuple[type, ...] = (DistillationProviderMixin,)
"""What a distillation provider is an instance of (GPT and hybrid alike): the launcher and the override checks
pick the distillation forward step and re-check the KD constraints for these."""
