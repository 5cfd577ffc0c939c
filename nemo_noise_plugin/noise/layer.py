"""The noise layer: adds the configured noise to a decoder input in Megatron's ``[s, b, h]`` layout.

The noise on each element is a function of ``(seed, iteration, global sample index, global token position, hidden
index)`` only (Philox, ``noise/philox.py``), so a global batch gets bit-identical noise under any TP/SP/CP/DP layout,
microbatch split, recompute or resume; tensor-parallel ranks holding replicated activations get identical noise,
and data- or context-parallel ranks holding different tokens get independent noise.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_noise_plugin.noise.bounds import DeferredFiniteCheck, check_noised_finite
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.families import noise_family
from nemo_noise_plugin.noise.geometry import (
    LocalLayout,
    NoiseBatchInputs,
    TokenGeometry,
    global_sample_indices,
    token_geometry,
)
from nemo_noise_plugin.noise.mechanisms import apply_noise, lookup_with_configured_noise, selected_tokens
from nemo_noise_plugin.noise.replayable import ReplayableStep
from nemo_noise_plugin.noise.schedule import NoiseClock, schedule_factor
from nemo_noise_plugin.utils import group_rank, group_size

__all__ = ["EmbeddingNoise", "NoiseBatchInputs"]

_MPU_GROUP_GETTERS = {"tp": "get_tensor_model_parallel_group", "cp": "get_context_parallel_group"}


class EmbeddingNoise:
    """Adds noise to the first pipeline stage's decoder input; a stateless function of (config, clock, layout).

    Holds no parameters or buffers, so a model carrying it keeps the state-dict keys of a plain model.
    """

    def __init__(
        self,
        config: NoiseConfig,
        *,
        sequence_parallel: bool,
        pg_collection: Any | None,
        megatron_groups: bool = True,
        defer_finite_check: bool = False,
        replayable: bool = False,
    ) -> None:
        """``pg_collection`` gives the tp/cp/dp groups; a group it lacks comes from Megatron's ``parallel_state``
        when ``megatron_groups`` (a model's layer), else none: one process holding the whole global batch (the
        privacy audit, which must not pick up the groups of a parallel job it runs in). ``defer_finite_check``
        (a training model's layer) reads the once-per-iteration finiteness check without a GPU sync, one
        iteration late (``noise.bounds.DeferredFiniteCheck``); otherwise it is read at once. ``replayable`` reads the
        iteration key and the schedule factor from device memory and records the finiteness check there
        (``noise.replayable.ReplayableStep``), so a CUDA graph captured over the forward replays each step's own
        noise: ``publish_step`` before every replay; same noise values as the eager keys."""
        self.config = config
        self.sequence_parallel = sequence_parallel
        self.pg_collection = pg_collection
        self.megatron_groups = megatron_groups
        self.finite_check = DeferredFiniteCheck() if defer_finite_check else None
        self.replayable_step = ReplayableStep() if replayable else None

    def _group(self, name: str) -> Any:
        group = getattr(self.pg_collection, name, None) if self.pg_collection is not None else None
        if group is not None or not self.megatron_groups:
            return group
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return None
        if name == "dp":
            return parallel_state.get_data_parallel_group()
        return getattr(parallel_state, _MPU_GROUP_GETTERS[name])()

    def layout(self) -> LocalLayout:
        """This rank's tensor/sequence-, context- and data-parallel position."""
        tp_group, cp_group, dp_group = self._group("tp"), self._group("cp"), self._group("dp")
        return LocalLayout(
            sp_size=group_size(tp_group) if self.sequence_parallel else 1,
            sp_rank=group_rank(tp_group) if self.sequence_parallel else 0,
            cp_size=group_size(cp_group),
            cp_rank=group_rank(cp_group),
            dp_size=group_size(dp_group),
            dp_rank=group_rank(dp_group),
        )

    def geometry(self, decoder_input: torch.Tensor, batch: NoiseBatchInputs, layout: LocalLayout) -> TokenGeometry:
        """Global positions, real-token mask, lengths and response (or private-span) mask of the local tokens."""
        return self._geometry(decoder_input.size(0), decoder_input.size(1), decoder_input.device, batch, layout)

    def _geometry(
        self, rows: int, batch_size: int, device: torch.device, batch: NoiseBatchInputs, layout: LocalLayout
    ) -> TokenGeometry:
        config = self.config
        return token_geometry(
            rows,
            batch_size,
            batch,
            layout,
            self._group("cp"),
            need_lengths=noise_family(config.mechanism).length_scaled and config.scaling == "true_length",
            need_response=config.tokens in ("prompt", "response"),
            need_private=config.tokens == "spans",
            device=device,
        )

    def __call__(self, decoder_input: torch.Tensor, batch: NoiseBatchInputs, clock: NoiseClock) -> torch.Tensor:
        """Return ``decoder_input`` plus this (iteration, microbatch)'s noise; gradients flow to the input."""
        return self.noise_and_selection(decoder_input, batch, clock)[0]

    def noise_and_selection(
        self, decoder_input: torch.Tensor, batch: NoiseBatchInputs, clock: NoiseClock
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The noised ``decoder_input`` (as ``__call__``) and the ``[s, b]`` mask of the tokens that got noise."""
        layout = self.layout()
        geometry = self.geometry(decoder_input, batch, layout)
        selected = selected_tokens(self.config, geometry, batch.input_ids)
        micro_batch_size = decoder_input.size(1)
        sample_index = global_sample_indices(micro_batch_size, clock.microbatch, layout, decoder_input.device)
        factor, iteration = self._step_keys(clock, decoder_input.device)
        noised = apply_noise(
            decoder_input,
            self.config,
            factor=factor,
            selected=selected,
            geometry=geometry,
            sample_index=sample_index,
            iteration=iteration,
        )
        self._check_finite(noised, decoder_input, clock)
        return noised, selected

    def noised_lookup(
        self, weight: torch.Tensor, input_ids: torch.Tensor, batch: NoiseBatchInputs, clock: NoiseClock
    ) -> torch.Tensor:
        """``self(F.embedding(input_ids, weight).transpose(0, 1), batch, clock)`` with the lookup and the noise in one
        pass (``noise.mechanisms.lookup_with_configured_noise``): ``[b, s]`` ids of the local tokens (no sequence
        parallelism: the rows of the ``[s, b, h]`` output are the ids' columns), a mechanism whose noise is
        independent of the input. Gradients flow to ``weight`` as the lookup's."""
        layout = self.layout()
        if layout.sp_size != 1:
            raise ValueError("noised_lookup needs the whole local sequence: sequence parallelism scatters it.")
        micro_batch_size, rows = input_ids.shape
        geometry = self._geometry(rows, micro_batch_size, weight.device, batch, layout)
        factor, iteration = self._step_keys(clock, weight.device)
        noised = lookup_with_configured_noise(
            weight,
            input_ids,
            self.config,
            factor=factor,
            selected=selected_tokens(self.config, geometry, input_ids),
            geometry=geometry,
            sample_index=global_sample_indices(micro_batch_size, clock.microbatch, layout, weight.device),
            iteration=iteration,
        )
        self._check_finite(noised, weight, clock)  # a finite table: finite looked-up rows
        return noised

    def publish_step(self, clock: NoiseClock, device: torch.device) -> None:
        """Replayable layer: write ``clock``'s iteration and schedule factor into the device keys on ``device`` and
        raise for an overflow the device flag has recorded (known one step late on the GPU). Call it outside any
        CUDA graph before each step the graph replays; the eager forward calls it itself when the clock moved."""
        if self.replayable_step is None:
            raise RuntimeError("publish_step needs a replayable noise layer: EmbeddingNoise(..., replayable=True).")
        self.replayable_step.publish(self.config, clock.iteration, device)
        self.replayable_step.raise_overflow(self.config)

    def _step_keys(self, clock: NoiseClock, device: torch.device) -> tuple[float | torch.Tensor, int | torch.Tensor]:
        """The schedule factor and the iteration key of ``clock``'s step: host numbers, or the replayable layer's
        device tensors (published here unless a graph is being captured, which needs them published before)."""
        if self.replayable_step is None:
            return schedule_factor(self.config, clock.iteration), clock.iteration
        step = self.replayable_step
        if not step.holds(clock.iteration, device):
            self.publish_step(clock, device)  # inside a graph capture this raises: publish before capturing
        return step.factor, step.iteration

    def _check_finite(self, noised: torch.Tensor, clean: torch.Tensor, clock: NoiseClock) -> None:
        """Once per iteration (microbatch 0): one reduction, read without a GPU sync where deferred."""
        if self.replayable_step is not None:
            if clock.microbatch == 0:
                self.replayable_step.record_overflow(noised, clean)
                if not noised.is_cuda:  # read at once; on the GPU the next publish_step copies it, the one after reads
                    self.replayable_step.raise_overflow(self.config)
            return
        if clock.microbatch == 0:
            check = check_noised_finite if self.finite_check is None else self.finite_check.check
            check(self.config, noised, clean, clock.iteration)
