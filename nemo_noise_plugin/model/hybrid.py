"""The noisy hybrid model: Megatron-Core ``HybridModel`` with embedding noise on the first stage's decoder input.

Megatron-Core 0.19.2 marks ``GPTModel`` deprecated in favour of ``HybridModel``, but ``HybridModel`` has no
``_preprocess``: its ``forward`` embeds the tokens inline (``hybrid_model.py:452-477``), so ``NoiseInjectionMixin``'s
``_preprocess`` override has nothing to wrap. ``NoisyHybridModel`` therefore adds that step itself: ``_preprocess``
reproduces ``HybridModel.forward``'s embedding and rotary code, adds the noise exactly as the GPT mixin does, and
returns the six-tuple that Megatron-Core's schedule-plan ``PreProcessNode`` unpacks; ``forward`` passes the noised
embedding to ``HybridModel.forward`` as its ``decoder_input``. While no noise is due (disabled, zero, eval with
``training_only``, a caller-supplied ``decoder_input``, or a stage without ``pre_process``) ``forward`` is
``HybridModel.forward`` untouched. Multi-token-prediction embeddings are never noised: the MTP block calls the
embedding module directly. ``_postprocess`` (``schedule_plan.hybrid.hybrid_postprocess``) and the plugin's
``build_schedule_plan`` give the model the fine-grained schedule plan. See ``docs/hybrid_model.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel

from nemo_noise_plugin.model.mixin import NoiseInjectionMixin
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.schedule_plan.hybrid import PreprocessOutput, hybrid_postprocess, hybrid_preprocess

__all__ = ["NoisyHybridModel", "noisy_hybrid_class_for"]


class NoisyHybridModel(NoiseInjectionMixin, HybridModel):
    """A Megatron-Core ``HybridModel`` whose first pipeline stage adds embedding noise to its decoder input.

    Takes ``HybridModel``'s arguments plus ``noise_config``; its state dict and checkpoints are a ``HybridModel``'s
    (the bases are exactly ``(NoiseInjectionMixin, HybridModel)``, so ``plain_class_of`` and the clean teacher
    work unchanged). ``forward`` and ``_preprocess`` use no zero-argument ``super()``: ``make_noisy`` reuses them
    for subclasses of ``HybridModel``.
    """

    def __init__(self, *args: Any, noise_config: NoiseConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_noise(noise_config if noise_config is not None else NoiseConfig())

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: Any = None,
        runtime_gather_output: bool | None = None,
        *,
        inference_params: Any = None,
        loss_mask: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``HybridModel.forward``, fed the noised embedding as ``decoder_input`` when noise is due."""
        with self.noise_batch_inputs(loss_mask):
            if decoder_input is None and self.pre_process and self.noise_active:
                decoder_input = self._preprocess(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    inference_context=inference_context if inference_context is not None else inference_params,
                    packed_seq_params=packed_seq_params,
                    padding_mask=padding_mask,
                )[0]
            # NoiseInjectionMixin.forward (not super()) so this function also serves make_noisy's subclasses.
            return NoiseInjectionMixin.forward(
                self,
                input_ids,
                position_ids,
                attention_mask,
                decoder_input,
                labels,
                inference_context,
                runtime_gather_output,
                inference_params=inference_params,
                loss_mask=loss_mask,
                packed_seq_params=packed_seq_params,
                padding_mask=padding_mask,
            )

    def _preprocess(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        decoder_input: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> PreprocessOutput:
        """Decoder input (noised on the first stage) and rotary embedding, as ``HybridModel.forward`` computes them.

        Same signature and return value as ``GPTModel._preprocess``, so Megatron-Core's ``PreProcessNode``
        (``models/common/utils.py:150``) can call it; ``padding_mask`` is returned unchanged, as
        ``HybridModel.forward`` hands it to its decoder unchanged. The embedding and rotary code is
        ``schedule_plan.hybrid.hybrid_preprocess``; the noise goes on the embedding output there.
        """
        add_noise = None
        if self.noise_active:

            def add_noise(embedded: torch.Tensor) -> torch.Tensor:
                return self.noise_decoder_input(embedded, input_ids, padding_mask, packed_seq_params)

        return hybrid_preprocess(
            self,
            input_ids,
            position_ids,
            decoder_input,
            inference_context,
            packed_seq_params,
            padding_mask,
            add_noise=add_noise,
        )

    _postprocess = hybrid_postprocess
    """Output layer and loss (or ``output_processor``) for the schedule plan's post-process node."""


_HYBRID_NOISE_METHODS = ("forward", "_preprocess", "_postprocess")


def noisy_hybrid_class_for(model_class: type) -> type | None:
    """The noisy class for a ``HybridModel`` (sub)class, or None when ``model_class`` is not a hybrid model.

    A subclass gets bases ``(NoiseInjectionMixin, model_class)`` and ``NoisyHybridModel``'s methods.
    """
    if not issubclass(model_class, HybridModel):
        return None
    if model_class is HybridModel:
        return NoisyHybridModel
    namespace: dict[str, Any] = {name: NoisyHybridModel.__dict__[name] for name in _HYBRID_NOISE_METHODS}
    namespace["__module__"] = __name__
    return type(f"Noisy{model_class.__name__}", (NoiseInjectionMixin, model_class), namespace)
