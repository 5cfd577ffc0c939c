"""Converting a provider Bridge already made (``AutoBridge.to_megatron_provider()``) into the plugin's, GPT or hybrid.

``noisy_provider_from`` turns Bridge's ``GPTModelProvider`` into ``NoisyGPTModelProvider`` /
``NoisyDistillationProvider`` and Bridge's ``HybridModelProvider`` (what AutoBridge returns for Nemotron-H) into
``NoisyHybridModelProvider`` / ``NoisyHybridDistillationProvider``, keeping every field and the registered pre-/post-
wrap hooks (HF weight loading is a pre-wrap hook). A subclass that builds another model than its Bridge base class
(its own ``provide``, ``finalize``, ``__post_init__`` or fields) is refused by name (``UnsupportedProviderError``);
Bridge's ``MambaModelProvider``, whose only additions are the deprecated name ``mamba_stack_spec`` of
``hybrid_stack_spec`` and its serialisation, converts with that field carried to ``hybrid_stack_spec``.
Both names are also importable from ``nemo_noise_plugin.providers``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.providers import (
    DistillationProviderMixin,
    GPTModelProvider,
    NoiseProviderMixin,
    NoisyDistillationProvider,
    NoisyGPTModelProvider,
)
from nemo_noise_plugin.providers.hybrid import (
    HybridModelProvider,
    NoisyHybridDistillationProvider,
    NoisyHybridModelProvider,
)
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import SettingError

__all__ = ["CONVERSIONS", "UnsupportedProviderError", "noisy_provider_from"]

MambaModelProvider = import_bridge("megatron.bridge.models.mamba.mamba_provider").MambaModelProvider

CONVERSIONS: tuple[tuple[type, type, type], ...] = (
    (GPTModelProvider, NoisyGPTModelProvider, NoisyDistillationProvider),
    (HybridModelProvider, NoisyHybridModelProvider, NoisyHybridDistillationProvider),
)
"""Bridge base class -> (the plugin's noisy provider, its distillation provider) on that base."""

_RENAMED_FIELDS: dict[type, tuple[str, str]] = {MambaModelProvider: ("mamba_stack_spec", "hybrid_stack_spec")}
"""Bridge classes whose only additions are a deprecated field name, normalised by their ``__post_init__``, and a
``to_cfg_dict`` that leaves it out: (old field, the field it names). Their own members change no model."""


class UnsupportedProviderError(TypeError):
    """Raised by ``noisy_provider_from`` for a provider class whose model or settings the conversion would lose."""


# Class attributes that every dataclass or ABC has (generated or bookkeeping); they change no behaviour.
_BOOKKEEPING_ATTRIBUTES = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__dict__",
        "__weakref__",
        "__annotations__",
        "__annotate_func__",
        "__annotations_cache__",
        "__firstlineno__",
        "__static_attributes__",
        "__orig_bases__",
        "__parameters__",
        "__abstractmethods__",
        "_abc_impl",
        "__dataclass_fields__",
        "__dataclass_params__",
        "__match_args__",
        "__init__",
        "__repr__",
        "__eq__",
        "__hash__",
    }
)


def noisy_provider_from(provider: Any, noise: NoiseConfig | None = None, kd: KDConfig | None = None) -> Any:
    """Convert a Bridge GPT or hybrid provider into the plugin's noisy provider on the same Bridge class (its
    distillation provider with ``kd``).

    ``GPTModelProvider`` gives ``NoisyGPTModelProvider`` (``NoisyDistillationProvider`` with ``kd``);
    ``HybridModelProvider`` gives ``NoisyHybridModelProvider`` (``NoisyHybridDistillationProvider``). The new
    provider carries every dataclass field value of ``provider`` (by reference, as ``dataclasses.replace`` does) and
    its instance state outside the fields: the registered pre-/post-wrap hooks (copied into new lists, so hooks
    registered later on either provider stay their own; AutoBridge's HF weight loading is one of them) and any other
    attribute Bridge set on it. ``provider`` itself is left unchanged.

    ``noise``/``kd`` default to the source's own settings when it is already a plugin provider (deep-copied), else to
    ``NoiseConfig()``; a source distillation provider stays one. Finalize the result as any provider
    (``ConfigContainer.validate`` does it).

    Only the two Bridge classes themselves (and subclasses that merely change field defaults, e.g. Bridge's Mistral
    and OLMoE providers; and ``MambaModelProvider``, see the module) convert: a subclass that adds fields or methods
    (``provide``: Gemma, the VL/omni/audio models, Nemotron-VL; ``finalize``/``__post_init__``: MLA/DeepSeek, Sarvam,
    MiniMax-M3; extra fields: Gemma 2/3/4, Step-3.5, ...) builds a different model than its base's ``provide``, so
    it raises ``UnsupportedProviderError`` naming the class and what would be lost, instead of silently training
    another architecture.

    Args:
        provider: a Bridge ``GPTModelProvider`` or ``HybridModelProvider``, e.g.
            ``AutoBridge.from_hf_pretrained(path).to_megatron_provider()``.
        noise: the noise settings; None keeps a plugin provider's own, else ``NoiseConfig()``.
        kd: distillation settings; given, the result is a distillation provider (noisy student, clean teacher).

    Returns:
        A new, unfinalized plugin provider; use it as ``config.model``.

    Example::

        provider = AutoBridge.from_hf_pretrained("/models/smollm2").to_megatron_provider(load_weights=True)
        config.model = noisy_provider_from(provider, noise=load_noise_config("neftune_alpha5"), kd=KDConfig())
    """
    family = next((row for row in CONVERSIONS if isinstance(provider, row[0])), None)
    if family is None:
        raise UnsupportedProviderError(
            "noisy_provider_from expects a megatron.bridge GPTModelProvider or HybridModelProvider, got "
            f"{_class_path(type(provider))}."
        )
    base, noisy, distillation = family
    distils = kd is not None or isinstance(provider, DistillationProviderMixin)
    target: type[NoiseProviderMixin] = distillation if distils else noisy
    renamed = _check_convertible(type(provider), base, target)

    source_fields = {f.name: f for f in dataclasses.fields(provider)}
    values = {name: getattr(provider, name) for name, f in source_fields.items() if f.init}
    for old, new in renamed:
        _carry_renamed_field(provider, values, old, new)
    values["noise"] = noise if noise is not None else copy.deepcopy(getattr(provider, "noise", None) or NoiseConfig())
    if distils:
        values["kd"] = kd if kd is not None else copy.deepcopy(getattr(provider, "kd", None) or KDConfig())
    converted = target(**values)
    for name, f in source_fields.items():
        if not f.init:
            object.__setattr__(converted, name, getattr(provider, name))
    for name, value in vars(provider).items():
        if name not in source_fields:
            setattr(converted, name, list(value) if isinstance(value, list) else value)
    return converted


def _carry_renamed_field(provider: Any, values: dict[str, Any], old: str, new: str) -> None:
    """Move the deprecated field ``old`` into ``new`` in ``values``, as the source class's ``__post_init__`` does
    (``old`` set after construction is carried too); both set is a ``SettingError``."""
    value = values.pop(old)
    if value is None:
        return
    if values.get(new) is not None:
        raise SettingError(
            f"{type(provider).__name__}.{old}",
            value,
            "None",
            context=f" with {new} set",
            why=f": {old} is Bridge's deprecated name of {new}; set only {new}",
        )
    values[new] = value


def _check_convertible(source: type, base: type, target: type) -> list[tuple[str, str]]:
    """Raise ``UnsupportedProviderError`` when ``source`` adds fields or behaviour that ``target`` would lose;
    return the renamed fields (``_RENAMED_FIELDS``) of its classes, whose members are then no loss."""
    renamed = [_RENAMED_FIELDS[klass] for klass in source.__mro__ if klass in _RENAMED_FIELDS]
    source_fields = {f.name for f in dataclasses.fields(source)}
    extra_fields = sorted(source_fields - {f.name for f in dataclasses.fields(target)} - {old for old, _ in renamed})
    members: list[str] = []
    for klass in source.__mro__:
        if klass in target.__mro__ or klass in _RENAMED_FIELDS:
            continue
        for name in vars(klass):
            if name not in source_fields and name not in _BOOKKEEPING_ATTRIBUTES and name not in members:
                members.append(name)
    if not extra_fields and not members:
        return renamed
    lost = []
    if members:
        lost.append(f"its own {', '.join(sorted(members))}")
    if extra_fields:
        lost.append(f"fields {', '.join(extra_fields)}")
    raise UnsupportedProviderError(
        f"noisy_provider_from cannot convert {_class_path(source)}: {target.__name__} builds the model with "
        f"{base.__name__}.provide/finalize and would drop {' and '.join(lost)}, silently changing the model. "
        "Only GPTModelProvider (what AutoBridge returns for Llama, Qwen, Mistral and other plain GPT "
        "architectures), HybridModelProvider (what it returns for Nemotron-H) and subclasses that only change "
        "field defaults can be converted."
    )


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
