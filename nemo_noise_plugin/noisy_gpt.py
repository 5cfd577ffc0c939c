"""The noisy model: Megatron-Core GPT models that add embedding noise to the first stage's decoder input.

Noise goes in ``_preprocess``, the one method that both ``GPTModel.forward`` and the fine-grained schedule plan's
``PreProcessNode`` call to produce the decoder input, already in its final ``[s/(cp*tp if SP), b, h]`` layout. It is
therefore applied exactly once per forward, never to multi-token-prediction embeddings (which call the embedding
directly), never to a caller-supplied ``decoder_input`` and never on stages without ``pre_process``.
The noise layer holds no parameters or buffers: a noisy model's state dict has exactly a plain model's keys.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.utils import WrappedTensor, unwrap_model

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.schedule import NoiseClock

__all__ = [
    "NoiseInjectionMixin",
    "NoisyGPTModel",
    "PluginSchedulePlanMixin",
    "make_noisy",
    "plain_class_of",
    "use_plugin_schedule_plan",
]


class PluginSchedulePlanMixin:
    """``build_schedule_plan`` returning the plugin's fine-grained schedule plan (``nemo_noise_plugin.schedule_plan``).

    Every model chunk a plugin provider builds has it, noisy or not: under pipelining the chunks without noise
    (later stages, holding the last layer and the loss) need the plugin's nodes as much as the first one.
    """

    def build_schedule_plan(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        extra_block_kwargs: dict | None = None,
        runtime_gather_output: bool | None = None,
        inference_params: Any = None,
        loss_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        *,
        output_processor: Any = None,
        output_processor_context: Any = None,
    ):
        """``GPTModel.build_schedule_plan`` with the plugin's nodes (``nemo_noise_plugin.schedule_plan``).

        The plan's pre-process node runs later, when Megatron schedules it; the loss mask that a noise layer needs
        (``loss_mask``, else the one an enclosing ``noise_batch_inputs`` or the forward step handed over) is stored
        in the plan's chunk state now and given to ``_preprocess`` then.
        """
        from nemo_noise_plugin.schedule_plan import NoisyModelChunkSchedulePlan

        if not isinstance(self, GPTModel):
            raise NotImplementedError(
                f"{type(self).__name__} has no fine-grained schedule plan in megatron-core 0.19.2 (only GPTModel); "
                "turn overlap_moe_expert_parallel_comm off. See docs/hybrid_model.md."
            )
        if self.config.fine_grained_activation_offloading:
            self.preprocess_for_fine_grained_offloading()
        if self.config.moe_paged_stash:
            self.preprocess_for_paged_stash()
        plan = NoisyModelChunkSchedulePlan(
            self,
            input_ids,
            position_ids,
            attention_mask,
            decoder_input,
            labels,
            packed_seq_params,
            extra_block_kwargs,
            runtime_gather_output,
            loss_mask,
            padding_mask,
            output_processor=output_processor,
            output_processor_context=output_processor_context,
        )
        plan.state.noise_loss_mask = loss_mask if loss_mask is not None else getattr(self, "_noise_loss_mask", None)
        return plan


class NoiseInjectionMixin(PluginSchedulePlanMixin):
    """Adds ``EmbeddingNoise`` to a Megatron-Core language model through its ``_preprocess`` method.

    Mix in before the model class (``class Noisy(NoiseInjectionMixin, GPTModel)``) and call ``_init_noise`` after
    the model is built. ``noise_clock`` says which (iteration, microbatch) the next noised forward belongs to; a
    training loop that knows its iteration calls ``noise_clock.start_iteration(iteration)`` at each step.
    """

    noise_config: NoiseConfig
    noise_layer: EmbeddingNoise
    noise_clock: NoiseClock

    def _init_noise(self, noise_config: NoiseConfig) -> None:
        if not isinstance(noise_config, NoiseConfig):
            raise TypeError(f"noise_config must be a NoiseConfig, got {type(noise_config).__name__}.")
        self.noise_config = noise_config
        self.noise_layer = EmbeddingNoise(
            noise_config,
            sequence_parallel=bool(self.config.sequence_parallel),
            pg_collection=getattr(self, "pg_collection", None),
        )
        self.noise_clock = NoiseClock()
        self._noise_loss_mask: torch.Tensor | None = None

    @property
    def noise_step(self) -> int:
        """The training iteration the next noised forward belongs to (the noise clock's iteration)."""
        return self.noise_clock.iteration

    def noise_state_dict(self) -> dict[str, Any]:
        """The noise clock, for a checkpoint's common state (the schedule is a function of its iteration)."""
        return self.noise_clock.state_dict()

    def load_noise_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the noise clock saved by ``noise_state_dict``."""
        self.noise_clock.load_state_dict(state)

    @property
    def noise_active(self) -> bool:
        """Whether the next forward adds noise (enabled, non-zero, and training unless ``training_only=False``)."""
        config = self.noise_config
        return config.is_active_configuration and (self.training or not config.training_only)

    @contextlib.contextmanager
    def noise_batch_inputs(self, loss_mask: torch.Tensor | None) -> Iterator[None]:
        """Make ``loss_mask`` visible to ``_preprocess`` (which Megatron calls without it) for one forward."""
        previous = self._noise_loss_mask
        self._noise_loss_mask = loss_mask
        try:
            yield
        finally:
            self._noise_loss_mask = previous

    def forward(self, *args: Any, loss_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """The base model's forward; the noise layer sees ``loss_mask``, or an enclosing ``noise_batch_inputs``'s."""
        with self.noise_batch_inputs(loss_mask if loss_mask is not None else self._noise_loss_mask):
            return super().forward(*args, loss_mask=loss_mask, **kwargs)

    def _preprocess(self, input_ids: torch.Tensor, position_ids: torch.Tensor, decoder_input=None, **kwargs):
        """The base ``_preprocess``, with noise added to the embedding output it returns."""
        caller_supplied_input = decoder_input is not None
        output = super()._preprocess(
            input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input, **kwargs
        )
        if caller_supplied_input or not self.pre_process or not self.noise_active:
            return output
        embedded = output[0]
        wrapped = isinstance(embedded, WrappedTensor)
        if wrapped:
            embedded = embedded.unwrap()
        noised = self._add_embedding_noise(
            embedded, input_ids, kwargs.get("padding_mask"), kwargs.get("packed_seq_params")
        )
        return (WrappedTensor(noised) if wrapped else noised, *output[1:])

    def _add_embedding_noise(
        self,
        embedded: torch.Tensor,
        input_ids: torch.Tensor,
        padding_mask: torch.Tensor | None,
        packed_seq_params: Any,
    ) -> torch.Tensor:
        """The noise layer on the first stage's embedding output; advances the clock in training."""
        batch = NoiseBatchInputs(
            loss_mask=self._noise_loss_mask,
            padding_mask=padding_mask,
            input_ids=input_ids,
            packed_seq_params=packed_seq_params,
        )
        noised = self.noise_layer(embedded, batch, self.noise_clock)
        if self.training:
            self.noise_clock.advance()
        return noised


class NoisyGPTModel(NoiseInjectionMixin, GPTModel):
    """A Megatron-Core ``GPTModel`` whose first pipeline stage adds embedding noise to its decoder input.

    Takes ``GPTModel``'s arguments plus ``noise_config``; its state dict and checkpoints are a ``GPTModel``'s.
    """

    def __init__(self, *args: Any, noise_config: NoiseConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_noise(noise_config if noise_config is not None else NoiseConfig())


def plain_class_of(noisy_class: type) -> type:
    """The model class that ``make_noisy`` (or ``NoisyGPTModel``) added the noise mixin to."""
    if noisy_class.__bases__[:1] == (NoiseInjectionMixin,) and len(noisy_class.__bases__) == 2:
        return noisy_class.__bases__[1]
    raise TypeError(
        f"{noisy_class.__name__} is not a plain noise-mixin class (bases {noisy_class.__bases__}); "
        "cannot tell which model class it adds noise to."
    )


@functools.cache
def _plugin_plan_class_for(model_class: type) -> type:
    name = f"{model_class.__name__}WithPluginPlan"
    return type(name, (PluginSchedulePlanMixin, model_class), {"__module__": __name__})


def use_plugin_schedule_plan(model: torch.nn.Module) -> torch.nn.Module:
    """Give an already built ``GPTModel`` chunk (not noisy) the plugin's schedule plan, in place; return it unwrapped.

    Only the class changes (a subclass adding ``PluginSchedulePlanMixin``); parameters and state-dict keys do not.
    """
    inner = unwrap_model(model)
    if isinstance(inner, PluginSchedulePlanMixin):
        return inner
    if not isinstance(inner, GPTModel):
        raise TypeError(f"use_plugin_schedule_plan expects a megatron.core GPTModel, got {type(inner).__name__}.")
    inner.__class__ = _plugin_plan_class_for(type(inner))
    return inner


@functools.cache
def _noisy_class_for(model_class: type) -> type:
    if model_class is GPTModel:
        return NoisyGPTModel
    from nemo_noise_plugin.noisy_hybrid import noisy_hybrid_class_for

    hybrid = noisy_hybrid_class_for(model_class)
    if hybrid is not None:
        return hybrid
    return type(f"Noisy{model_class.__name__}", (NoiseInjectionMixin, model_class), {"__module__": __name__})


def make_noisy(model: torch.nn.Module, noise_config: NoiseConfig) -> torch.nn.Module:
    """Make an already built Megatron-Core GPT or hybrid model noisy, in place, and return the (unwrapped) model.

    Accepts a ``GPTModel`` or ``HybridModel`` (or subclass) or one wrapped in DDP/FSDP/``Float16Module``. Only this
    instance's class changes (to a subclass adding ``NoiseInjectionMixin``); parameters, buffers and state-dict keys
    are untouched.
    A model that is already noisy just takes the new config.
    """
    inner = unwrap_model(model)
    if isinstance(inner, NoiseInjectionMixin):
        inner._init_noise(noise_config)
        return inner
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    if not isinstance(inner, (GPTModel, HybridModel)):
        raise TypeError(
            f"make_noisy expects a megatron.core GPTModel or HybridModel (or one wrapped in DDP/Float16Module), "
            f"got {type(inner).__name__}."
        )
    inner.__class__ = _noisy_class_for(type(inner))
    inner._init_noise(noise_config)
    return inner
