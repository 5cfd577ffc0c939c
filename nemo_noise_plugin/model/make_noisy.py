"""Turn an already built Megatron-Core model noisy in place (``make_noisy``), or back to plain (``make_plain``).

Only the instance's class changes, to a subclass adding ``NoiseInjectionMixin``; parameters, buffers and state-dict
keys are untouched, so checkpoints of noisy and plain models load into each other.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.utils import unwrap_model

from nemo_noise_plugin.model.gpt import NoisyGPTModel
from nemo_noise_plugin.model.hybrid import noisy_hybrid_class_for
from nemo_noise_plugin.model.mixin import NoiseInjectionMixin
from nemo_noise_plugin.noise.config import NoiseConfig

__all__ = ["make_noisy", "make_plain", "plain_class_of"]


def plain_class_of(noisy_class: type) -> type:
    """The model class that ``make_noisy`` (or ``NoisyGPTModel``) added the noise mixin to."""
    if noisy_class.__bases__[:1] == (NoiseInjectionMixin,) and len(noisy_class.__bases__) == 2:
        return noisy_class.__bases__[1]
    raise TypeError(
        f"{noisy_class.__name__} is not a plain noise-mixin class (bases {noisy_class.__bases__}); "
        "cannot tell which model class it adds noise to."
    )


@functools.cache
def _noisy_class_for(model_class: type) -> type:
    if model_class is GPTModel:
        return NoisyGPTModel
    hybrid = noisy_hybrid_class_for(model_class)
    if hybrid is not None:
        return hybrid
    return type(f"Noisy{model_class.__name__}", (NoiseInjectionMixin, model_class), {"__module__": __name__})


def make_noisy(
    model: torch.nn.Module, noise_config: NoiseConfig, *, checked: bool = False, replayable: bool = False
) -> torch.nn.Module:
    """Make an already built Megatron-Core GPT or hybrid model noisy, in place, and return the (unwrapped) model.

    Accepts a ``GPTModel`` or ``HybridModel`` (or subclass) or one wrapped in DDP/FSDP/``Float16Module``. Only this
    instance's class changes (to a subclass adding ``NoiseInjectionMixin``); parameters, buffers and state-dict keys
    are untouched. A model that is already noisy just takes the new config. ``noise_config`` is checked first
    (``NoiseConfig.validate``: a value assigned after construction is refused with a ``SettingError`` naming it), so
    a bad config leaves the model as it was: for a model built without Bridge this is the config's one gate after
    construction, as a provider's ``finalize`` is with Bridge.

    Args:
        model: a built ``GPTModel`` / ``HybridModel`` (or subclass), bare or wrapped in DDP, FSDP or
            ``Float16Module``; on a pipeline-parallel run, each stage's chunk (noise is drawn on the first stage only).
        noise_config: the noise settings (``NoiseConfig``, or ``load_noise_config("neftune_alpha5")`` for a preset).
        checked: the caller has checked ``noise_config`` as it is now (a provider past its ``finalize``, a config just
            constructed by ``dataclasses.replace``), so it is not checked again.
        replayable: keep each step's noise keys in device memory (``init_noise(..., replayable=True)``), for a
            training step that a CUDA graph replays; the same noise values.

    Returns:
        The unwrapped model, now an instance of the noisy subclass (the same object as the wrapper's module).

    Example::

        model = make_noisy(gpt_model, NoiseConfig(alpha=5.0))  # NEFTune noise on the decoder input
        model = make_noisy(model, load_noise_config("metric_dp"))  # already noisy: takes the new config
    """
    if not isinstance(noise_config, NoiseConfig):
        raise TypeError(f"make_noisy: noise_config must be a NoiseConfig, got {type(noise_config).__name__}.")
    if not checked:
        noise_config.validate()
    inner = unwrap_model(model)
    if isinstance(inner, NoiseInjectionMixin):
        inner.init_noise(noise_config, replayable=replayable)
        return inner
    if not isinstance(inner, (GPTModel, HybridModel)):
        raise TypeError(
            f"make_noisy expects a megatron.core GPTModel or HybridModel (or one wrapped in DDP/Float16Module), "
            f"got {type(inner).__name__}."
        )
    inner.__class__ = _noisy_class_for(type(inner))
    inner.init_noise(noise_config, replayable=replayable)
    return inner


def make_plain(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``make_noisy`` on an (unwrapped) model in place: its plain class, no noise attributes; returns it."""
    if isinstance(model, NoiseInjectionMixin):
        model.__class__ = plain_class_of(type(model))
        for name in NoiseInjectionMixin.NOISE_ATTRIBUTES:
            model.__dict__.pop(name, None)
    return model
