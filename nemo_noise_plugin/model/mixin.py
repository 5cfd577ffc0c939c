"""The noise hook: a mixin that adds embedding noise to a Megatron-Core language model's decoder input.

Noise goes in ``_preprocess``, the one method that both ``GPTModel.forward`` and the fine-grained schedule plan's
``PreProcessNode`` call to produce the decoder input, already in its final ``[s/(cp*tp if SP), b, h]`` layout. It is
therefore applied exactly once per forward, never to multi-token-prediction embeddings (which call the embedding
directly), never to a caller-supplied ``decoder_input`` and never on stages without ``pre_process``.
The noise layer holds no parameters or buffers: a noisy model's state dict has exactly a plain model's keys.

Megatron calls ``_preprocess`` with the token ids, positions, padding mask and packed-sequence parameters, but not
with the loss mask that ``true_length`` scaling and prompt/response selection need. ``noise_batch_inputs`` is the
one way to hand batch inputs to the noise layer: the model's ``forward(loss_mask=...)``, the Bridge forward steps,
the schedule plan and direct callers all use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.utils import WrappedTensor

from nemo_noise_plugin.model.noised_lookup import lookup_fusion_blocker
from nemo_noise_plugin.noise.bounds import check_noise_fits
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.denoise import denoise_noised
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.schedule import NoiseClock
from nemo_noise_plugin.schedule_plan.builder import PluginSchedulePlanMixin

__all__ = ["NoiseInjectionMixin"]


def _first_given(value: Any, fallback: Any) -> Any:
    return value if value is not None else fallback


class NoiseInjectionMixin(PluginSchedulePlanMixin):
    """Adds ``EmbeddingNoise`` to a Megatron-Core language model through its ``_preprocess`` method.

    Mix in before the model class (``class Noisy(NoiseInjectionMixin, GPTModel)``) and call ``init_noise`` after
    the model is built. ``noise_clock`` says which (iteration, microbatch) the next noised forward belongs to; a
    training loop that knows its iteration calls ``noise_clock.start_iteration(iteration)`` at each step.
    """

    fuse_noise_into_lookup: bool = True
    """Add the noise where the embedding rows are looked up, in one pass, when the embedding allows it
    (``model/noised_lookup.py``: the same values and gradients); False always noises the embedding's output."""

    NOISE_ATTRIBUTES: tuple[str, ...] = ("noise_config", "noise_layer", "noise_clock", "_noise_inputs", "projected_ids")
    """Instance attributes ``init_noise`` sets (``make_plain`` removes them)."""

    noise_config: NoiseConfig
    noise_layer: EmbeddingNoise
    noise_clock: NoiseClock
    projected_ids: torch.Tensor | None
    """``NoiseConfig.projection='nearest_row'``: the last noised forward's ``Projection.ids`` (``noise.projection``;
    ``projection_recovery(ids, input_ids)`` is its nearest-neighbour recovery); None before one."""

    def init_noise(self, noise_config: NoiseConfig, *, replayable: bool = False) -> None:
        """Attach the noise layer and a fresh clock configured by ``noise_config`` (replacing any earlier one).

        ``noise_config`` is trusted as its construction (and ``make_noisy`` or a provider's ``finalize``) left it.
        ``replayable`` keeps each step's noise keys in device memory (``noise/replayable.py``) so that a CUDA graph
        captured over the forward replays each step's own noise; then call ``publish_noise_step`` outside the graph
        before every step it replays. The noise values are the same either way."""
        if not isinstance(noise_config, NoiseConfig):
            raise TypeError(f"noise_config must be a NoiseConfig, got {type(noise_config).__name__}.")
        check_noise_fits(noise_config, self.config.hidden_size, getattr(self.config, "params_dtype", None))
        self.noise_config = noise_config
        self.noise_layer = EmbeddingNoise(
            noise_config,
            sequence_parallel=bool(self.config.sequence_parallel),
            pg_collection=getattr(self, "pg_collection", None),
            defer_finite_check=True,
            replayable=replayable,
        )
        self.noise_clock = NoiseClock()
        self._noise_inputs = NoiseBatchInputs()
        self.projected_ids = None

    def publish_noise_step(self) -> None:
        """Replayable noise: write the noise clock's step (iteration, schedule factor) into the device keys and raise
        for an overflow recorded at an earlier step; outside any CUDA graph, before each step a graph replays."""
        device = next(self.parameters()).device
        self.noise_layer.publish_step(self.noise_clock, device)

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
    def noise_batch_inputs(
        self,
        loss_mask: torch.Tensor | None = None,
        *,
        padding_mask: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        private_mask: torch.Tensor | None = None,
    ) -> Iterator[NoiseBatchInputs]:
        """Hand batch inputs to the noise layer for the forwards inside the block; yields them.

        Inputs given here replace an enclosing block's; the others are inherited. Megatron's own ``padding_mask`` and
        ``packed_seq_params`` arguments of ``_preprocess`` take precedence over handed-over ones. The yielded
        ``NoiseBatchInputs`` may be filled in inside the block, before the forward (the Bridge forward steps set the
        loss mask once Bridge has fetched the batch). The enclosing inputs are restored on exit. ``private_mask``
        (``[b, s]``, True inside a private span, CP shard like the loss mask) is what ``tokens='spans'`` noises.
        """
        enclosing = self._noise_inputs
        inputs = NoiseBatchInputs(
            loss_mask=_first_given(loss_mask, enclosing.loss_mask),
            padding_mask=_first_given(padding_mask, enclosing.padding_mask),
            packed_seq_params=_first_given(packed_seq_params, enclosing.packed_seq_params),
            private_mask=_first_given(private_mask, enclosing.private_mask),
        )
        self._noise_inputs = inputs
        try:
            yield inputs
        finally:
            self._noise_inputs = enclosing

    def schedule_plan_noise_inputs(
        self, loss_mask: torch.Tensor | None, padding_mask: torch.Tensor | None
    ) -> NoiseBatchInputs:
        """The handed-over batch inputs (with the plan's own masks first), for the plan's pre-process node."""
        handed = self._noise_inputs
        return dataclasses.replace(
            handed,
            loss_mask=_first_given(loss_mask, handed.loss_mask),
            padding_mask=_first_given(padding_mask, handed.padding_mask),
        )

    def forward(self, *args: Any, loss_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """The base model's forward; the noise layer sees ``loss_mask``, or an enclosing ``noise_batch_inputs``'s."""
        with self.noise_batch_inputs(loss_mask):
            return super().forward(*args, loss_mask=loss_mask, **kwargs)

    def _preprocess(self, input_ids: torch.Tensor, position_ids: torch.Tensor, decoder_input=None, **kwargs):
        """The base ``_preprocess``, with noise added to the embedding output it returns (or, where the embedding is
        the lookup alone, the base ``_preprocess`` of the lookup made with the noise in one pass)."""
        caller_supplied_input = decoder_input is not None
        if (
            not caller_supplied_input
            and self.pre_process
            and self.noise_active
            and lookup_fusion_blocker(self, kwargs.get("inference_context")) is None
        ):
            noised = self._noised_lookup(input_ids, kwargs.get("padding_mask"), kwargs.get("packed_seq_params"))
            return super()._preprocess(input_ids=input_ids, position_ids=position_ids, decoder_input=noised, **kwargs)
        output = super()._preprocess(
            input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input, **kwargs
        )
        if caller_supplied_input or not self.pre_process or not self.noise_active:
            return output
        embedded = output[0]
        wrapped = isinstance(embedded, WrappedTensor)
        if wrapped:
            embedded = embedded.unwrap()
        noised = self.noise_decoder_input(
            embedded, input_ids, kwargs.get("padding_mask"), kwargs.get("packed_seq_params")
        )
        return (WrappedTensor(noised) if wrapped else noised, *output[1:])

    def noise_decoder_input(
        self,
        embedded: torch.Tensor,
        input_ids: torch.Tensor,
        padding_mask: torch.Tensor | None,
        packed_seq_params: Any,
    ) -> torch.Tensor:
        """The noise layer on the first stage's embedding output ``[s, b, h]``; advances the clock in training.

        For model classes whose decoder input is not produced by a base ``_preprocess`` (``NoisyHybridModel``).
        """
        batch = self._noise_batch(input_ids, padding_mask, packed_seq_params)
        if self.noise_config.projection == "none":
            noised = self.noise_layer(embedded, batch, self.noise_clock)
        else:  # nearest-row projection or posterior mean of the noised tokens (noise/projection.py, denoise.py)
            noised, selected = self.noise_layer.noise_and_selection(embedded, batch, self.noise_clock)
            word_embeddings, sequence_parallel = self.embedding.word_embeddings, self.noise_layer.sequence_parallel
            projection = denoise_noised(noised, selected, word_embeddings, self.noise_config, sequence_parallel)
            noised, self.projected_ids = projection.decoder_input, projection.ids
        if self.training:
            self.noise_clock.advance()
        return noised

    def _noised_lookup(self, input_ids: torch.Tensor, padding_mask: Any, packed_seq_params: Any) -> torch.Tensor:
        """The decoder input made by the lookup with the noise in one pass; advances the clock in training."""
        batch = self._noise_batch(input_ids, padding_mask, packed_seq_params)
        weight = self.embedding.word_embeddings.weight
        noised = self.noise_layer.noised_lookup(weight, input_ids, batch, self.noise_clock)
        if self.training:
            self.noise_clock.advance()
        return noised

    def _noise_batch(self, input_ids: torch.Tensor, padding_mask: Any, packed_seq_params: Any) -> NoiseBatchInputs:
        """The noise layer's batch inputs: the forward's own first, then the handed-over ones."""
        handed = self._noise_inputs
        return NoiseBatchInputs(
            loss_mask=handed.loss_mask,
            padding_mask=_first_given(padding_mask, handed.padding_mask),
            input_ids=input_ids,
            packed_seq_params=_first_given(packed_seq_params, handed.packed_seq_params),
            private_mask=handed.private_mask,
        )
