"""Run configs in and out: Bridge's Hydra-style overrides and YAML, with the plugin's settings validated.

Bridge applies ``key=value`` overrides (``process_config_with_overrides``) by ``setattr`` on the dataclasses it
already holds, so ``NoiseConfig``/``KDConfig.__post_init__`` never sees the new values: ``model.noise.alpha=-1``
or ``=abc`` would be accepted and fail (or silently misbehave) at training time, and a ``+``-added unknown key is
dropped with a log warning. ``apply_overrides`` runs the same Bridge machinery, but first rebuilds every
``NoiseConfig``/``KDConfig`` from its overridden fields and checks every key, raising ``ConfigOverrideError`` that
names the full key (``model.noise.alpha=-1 is invalid: ...``) before the config is changed or any GPU memory is
touched. ``load_config_yaml`` reloads a ``ConfigContainer.to_yaml`` file (e.g. a checkpoint's ``run_config.yaml``)
that names the plugin's classes; a ``_target_`` of a class that moved is read at its new path (``MOVED_TARGETS``).
The command line and users' launch scripts call both. YAML files are read by the
plugin's rules (``yaml_files``: ``lr: 1e-3`` is 0.001, a repeated key or an empty file is an error naming the file).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import Any

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.training.override_messages import (
    explain_hydra_error,
    join_key,
    name_key,
    touching,
    unknown_key,
)
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import SettingError, check_choice, is_finite_number
from nemo_noise_plugin.yaml_files import YAMLInputError, load_yaml_file

__all__ = [
    "VALIDATED_CONFIG_TYPES",
    "MOVED_TARGETS",
    "ConfigOverrideError",
    "apply_overrides",
    "current_targets",
    "load_config_yaml",
    "validate_plugin_settings",
]

VALIDATED_CONFIG_TYPES: tuple[type, ...] = (NoiseConfig, KDConfig)
"""Dataclasses that ``apply_overrides`` rebuilds from their overridden fields, so their ``__post_init__`` runs."""

MOVED_TARGETS: dict[str, str] = {
    "nemo_noise_plugin.distillation.kd_config.KDConfig": "nemo_noise_plugin.distillation.config.KDConfig",
}
"""Old ``_target_`` -> the class's path now, for run YAML written before a class moved (``--config-file``,
``load_config_yaml``); no module stays at an old path."""

_INSTANTIATION_KEYS = frozenset({"_target_", "_call_", "_args_", "_partial_", "_recursive_", "_convert_"})
_FLOAT_TYPES = frozenset({"float", "float | None", float, float | None})
_LARGEST_FLOAT_INT = int(1.7976931348623157e308)
"""Ints up to this convert to float without overflow; a larger one is left to the config's check, which names it."""


class ConfigOverrideError(ValueError):
    """An override or YAML value that the config cannot take; the message names the full key."""


def apply_overrides(config: Any, overrides: list[str], *, config_filepath: str | os.PathLike[str] | None = None):
    """Apply Hydra-style ``overrides`` (and an optional YAML file merged first) to ``config``; return ``config``.

    Uses Bridge's own override path (``megatron.bridge.training.utils.omegaconf_utils``: ``key=value``, ``+key=value``
    to add, ``~key`` to delete, YAML merge), then guarantees what that path does not:

    - every key names a field: ``+train.itres=3`` or ``+model.noise.alpah=3`` raise (Bridge only logs a warning);
    - a ``NoiseConfig``/``KDConfig`` that the file or the overrides touch is validated by constructing it anew (its
      ``__post_init__``, once, with ints turned into floats for float fields first), and the new object replaces
      the old one; an untouched one stays as it is (an assignment made to it in Python after its construction is
      caught at its gate, the provider's ``finalize``);
    - ``~key`` on a dataclass field restores the field's declared default (Bridge would keep the old value);
    - a ``NoisyDistillationProvider`` re-checks its distillation constraints (``validate_distillation``).

    Errors are ``ConfigOverrideError`` naming the full key path and the overrides that touched it, raised before
    ``config`` is changed. Nothing here touches a GPU.
    """
    from omegaconf import OmegaConf

    omegaconf_utils = import_bridge("megatron.bridge.training.utils.omegaconf_utils")
    overrides = [str(override) for override in overrides]
    omega, excluded = omegaconf_utils.create_omegaconf_dict_config(config)
    before = OmegaConf.to_container(omega, resolve=False)
    if config_filepath is not None:
        omega = OmegaConf.merge(omega, OmegaConf.create(_config_file_values(config, config_filepath)))
    if overrides:
        try:
            omega = omegaconf_utils.parse_hydra_overrides(omega, overrides)
        except omegaconf_utils.OverridesError as error:
            culprit = getattr(error.__cause__, "override", None)
            raise ConfigOverrideError(explain_hydra_error(config, str(error), overrides, culprit)) from error
    after = OmegaConf.to_container(omega, resolve=True)

    plan = _Plan(overrides)
    plan.walk(config, before, after, path="")
    _validate_distillation(config, after, plan)
    omegaconf_utils.apply_overrides(config, after, excluded)
    for owner, name, value in plan.resets + plan.replacements:
        setattr(owner, name, value)
    return config


def validate_plugin_settings(config: Any) -> None:
    """Check the run settings of a ``ConfigContainer`` that Bridge leaves to training time; raise
    ``ConfigOverrideError`` naming the key.

    Refuses a run that would train nothing (``train.train_iters`` < 1), a learning rate that is not a finite
    number > 0, and a plugin provider's ``core_attention`` outside ``CORE_ATTENTION`` (also refused at ``finalize``;
    here so that a dry run says it). Call it before any model is built (``jobs.launch.launcher.launch`` does). The
    noise and KD settings are not checked here: their gates are construction and the provider's ``finalize``
    (docs/bridge_config.md).
    """
    train_iters = getattr(getattr(config, "train", None), "train_iters", None)
    counts = isinstance(train_iters, int) and not isinstance(train_iters, bool)
    if train_iters is not None and not (counts and train_iters >= 1):
        raise ConfigOverrideError(
            f"train.train_iters={train_iters!r} is invalid: expected an integer >= 1 (the run would train nothing)."
        )
    lr = getattr(getattr(config, "optimizer", None), "lr", None)
    if lr is not None and not (is_finite_number(lr) and lr > 0):
        raise ConfigOverrideError(f"optimizer.lr={lr!r} is invalid: expected a finite number > 0.")
    attention = getattr(getattr(config, "model", None), "core_attention", None)
    if attention is not None:
        from nemo_noise_plugin.model.sdpa_attention import CORE_ATTENTION

        try:
            check_choice("model.core_attention", attention, CORE_ATTENTION)  # the provider's finalize check
        except SettingError as refused:
            raise ConfigOverrideError(str(refused)) from None


def _config_file_values(config: Any, path: str | os.PathLike[str]) -> dict:
    """The fields a YAML config file sets, in the form Bridge's override path takes.

    The file may be partial (``model: {noise: {alpha: 10}}``) or a whole ``ConfigContainer.to_yaml`` export, whose
    ``_target_`` entries are checked against the config's own classes and dropped: a config file changes fields,
    never the objects the recipe built (a provider keeps its registered hooks, e.g. AutoBridge's weight loading).
    """
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise ConfigOverrideError(f"config file {name!r} is not a file: expected a YAML file of config fields.")
    try:
        loaded = load_yaml_file(name, what="a mapping of config fields (e.g. model: {noise: {alpha: 10}})")
    except (YAMLInputError, OSError) as error:
        raise ConfigOverrideError(f"config file {error}") from error
    return _file_fields(config, current_targets(loaded), "")


def current_targets(values: Any) -> Any:
    """``values`` with every ``_target_`` of ``MOVED_TARGETS`` renamed to the class's path now (a new mapping)."""
    if isinstance(values, dict):
        return {
            key: MOVED_TARGETS.get(item, item) if key == "_target_" else current_targets(item)
            for key, item in values.items()
        }
    if isinstance(values, list):
        return [current_targets(item) for item in values]
    return values


def _file_fields(owner: Any, values: dict, path: str) -> dict:
    fields: dict = {}
    for key, value in values.items():
        if key in _INSTANTIATION_KEYS:
            continue
        if not isinstance(key, str):
            raise ConfigOverrideError(f"{join_key(path, str(key))}: config keys must be field names, got {key!r}.")
        key_path = join_key(path, key)
        current = getattr(owner, key, None) if dataclasses.is_dataclass(owner) else None
        if isinstance(value, dict) and "_target_" in value:
            if dataclasses.is_dataclass(current):
                expected = f"{type(current).__module__}.{type(current).__qualname__}"
                if value["_target_"] != expected:
                    raise ConfigOverrideError(
                        f"{key_path}._target_={value['_target_']} is invalid: the recipe builds {expected}; a config "
                        "file sets fields and cannot change a class."
                    )
                fields[key] = _file_fields(current, value, key_path)
            elif not _names_current_value(value, current):
                raise ConfigOverrideError(
                    f"{key_path}={value['_target_']} is invalid: the recipe's value is {current!r}; a config file "
                    "cannot replace a function or object field; set it in Python."
                )
        elif isinstance(value, dict) and dataclasses.is_dataclass(current):
            fields[key] = _file_fields(current, value, key_path)
        elif dataclasses.is_dataclass(current) and value is not None:  # `model: 5`, `train: [1, 2]`
            expected = f"a mapping of {type(current).__name__} fields (e.g. {key}: {{...}})"
            raise ConfigOverrideError(str(SettingError(key_path, value, expected)))
        else:
            fields[key] = value
    return fields


def _names_current_value(value: dict, current: Any) -> bool:
    """Whether a YAML ``_target_`` entry (a dtype, an enum member, a function) denotes ``current``."""
    instantiate = import_bridge("megatron.bridge.utils.instantiate_utils").instantiate
    try:
        return instantiate(value) == current
    except Exception:  # an entry that does not instantiate here cannot denote the current value
        return False


def load_config_yaml(path: str | os.PathLike[str]):
    """``ConfigContainer.from_yaml(path)`` with the plugin's classes allowed as ``_target_`` (importing providers).

    The file is read by the plugin's YAML rules (``yaml_files.load_yaml_file``: ``lr: 1e-3`` is 0.001, a repeated
    key or an empty file raise ``YAMLInputError``), then built as ``from_yaml`` builds it (OmegaConf, ``from_dict``).
    """
    from omegaconf import OmegaConf

    import nemo_noise_plugin.providers  # noqa: F401  (adds "nemo_noise_plugin." to Bridge's allowlist)

    values = load_yaml_file(path, what="a ConfigContainer mapping, as ConfigContainer.to_yaml writes it")
    values = current_targets(values)
    container = import_bridge("megatron.bridge.training.config").ConfigContainer
    return container.from_dict(OmegaConf.to_container(OmegaConf.create(values), resolve=True))


def _identical(first: Any, second: Any) -> bool:
    """Equal and of the same types throughout (``1`` is neither ``True`` nor ``1.0`` here)."""
    if type(first) is not type(second):
        return False
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(_identical(first[key], second[key]) for key in first)
    if isinstance(first, list):
        return len(first) == len(second) and all(map(_identical, first, second))
    return first == second


class _Plan:
    """Walks the config next to its overridden mapping, checking keys and preparing what to set after Bridge."""

    def __init__(self, overrides: list[str]) -> None:
        self.overrides = overrides
        self.resets: list[tuple[Any, str, Any]] = []
        self.replacements: list[tuple[Any, str, Any]] = []

    def walk(self, obj: Any, before: Any, after: Any, path: str) -> None:
        if not dataclasses.is_dataclass(obj) or not isinstance(after, dict):
            return
        fields = {f.name: f for f in dataclasses.fields(obj)}
        for key in after:
            if key not in _INSTANTIATION_KEYS and key not in fields and not hasattr(obj, key):
                raise ConfigOverrideError(unknown_key(obj, join_key(path, key), self.overrides))
        before = before if isinstance(before, dict) else {}
        for name in before:
            if name in fields and name not in after:
                self.resets.append((obj, name, self._default(obj, fields[name], join_key(path, name))))
        for name, value in after.items():
            if name not in fields:
                continue
            current = getattr(obj, name)
            key = join_key(path, name)
            if isinstance(current, VALIDATED_CONFIG_TYPES):
                # Untouched by the file and the overrides: the config stays as it is (an assignment made to it in
                # Python is caught at its gate, finalize); otherwise rebuilt from its new fields, which checks them.
                # Untouched means identical, types included: enabled=1 equals True but is not a bool.
                unchanged = isinstance(value, dict) and _identical(value, before.get(name))
                self.replacements.append(
                    (obj, name, current if unchanged else self._rebuild(type(current), value, key))
                )
            elif isinstance(value, dict) and "_target_" not in value:
                self.walk(current, before.get(name), value, key)
            elif name in before and value != before[name]:
                _check_scalar_type(type(obj), name, value, key, self.overrides)

    def _rebuild(self, config_type: type, value: Any, key: str) -> Any:
        touched = touching(key, self.overrides)
        if not isinstance(value, dict):
            raise ConfigOverrideError(
                f"{key}={value!r} is invalid: expected a mapping of {config_type.__name__} fields; override single "
                f"fields instead ({key}.<field>=<value>).{touched}"
            )
        values = {name: item for name, item in value.items() if name not in _INSTANTIATION_KEYS}
        fields = {f.name: f for f in dataclasses.fields(config_type)}
        for name in values:
            if name not in fields:
                raise ConfigOverrideError(unknown_key(config_type, join_key(key, name), self.overrides))
        floats = {  # ints given for float fields become floats before the check, so it runs once on final values
            name: float(item)
            for name, item in values.items()
            if fields[name].type in _FLOAT_TYPES
            and isinstance(item, int)
            and not isinstance(item, bool)
            and abs(item) <= _LARGEST_FLOAT_INT
        }
        try:
            return config_type(**{**values, **floats})
        except (TypeError, ValueError) as error:
            written = _error_as_written(config_type, values) or error  # alpha=-1, not alpha=-1.0
            message, _ = name_key(str(written), {config_type.__name__: key})
            raise ConfigOverrideError(message + touched) from written

    def _default(self, obj: Any, field: dataclasses.Field, key: str) -> Any:
        if field.default is not dataclasses.MISSING:
            return field.default
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        raise ConfigOverrideError(
            f"~{key} is invalid: {type(obj).__name__}.{field.name} has no default to restore; set a value instead."
        )


def _error_as_written(config_type: type, values: dict) -> Exception | None:
    """The error of building ``config_type`` from ``values`` as given (None if they build)."""
    try:
        config_type(**values)
    except (TypeError, ValueError) as error:
        return error
    return None


_SCALAR_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_scalar_type(owner: type, name: str, value: Any, key: str, overrides: list[str]) -> None:
    """Reject a new value whose type does not fit a scalar field (``int``, ``float``, ``bool``, ``str``, optional)."""
    try:
        annotation = typing.get_type_hints(owner).get(name)
    except Exception:  # a field annotation that does not resolve here: nothing to check against
        return
    allowed = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    allowed = allowed or (annotation,)
    if value is None and type(None) in allowed:
        return
    scalars = [kind for kind in allowed if kind in _SCALAR_NAMES]
    if not scalars or len(scalars) != len([kind for kind in allowed if kind is not type(None)]):
        return  # not a plain scalar field (lists, enums, literals, classes): Bridge and the config check it
    fits = any(
        isinstance(value, kind)
        and not (kind is int and isinstance(value, bool))
        or (kind is float and isinstance(value, int) and not isinstance(value, bool))
        for kind in scalars
    )
    if not fits:
        expected = " or ".join(_SCALAR_NAMES[kind] for kind in scalars)
        raise ConfigOverrideError(f"{key}={value!r} is invalid: expected {expected}.{touching(key, overrides)}")


def _validate_distillation(config: Any, after: dict, plan: _Plan) -> None:
    """Run a distillation provider's ``validate_distillation`` on the overridden values, before they are applied
    (the override's boundary: its ``KDConfig`` was just rebuilt, so its own fields are checked already)."""
    from nemo_noise_plugin.providers import DISTILLATION_PROVIDERS

    model = getattr(config, "model", None)
    if not isinstance(model, DISTILLATION_PROVIDERS):
        return
    values = dict(after.get("model") or {})
    values.update({name: value for owner, name, value in plan.resets + plan.replacements if owner is model})
    try:
        type(model).validate_distillation(_Overlay(model, values))
    except (TypeError, ValueError) as error:
        names = {"KDConfig": "model.kd", "NoiseConfig": "model.noise", type(model).__name__: "model"}
        message, key = name_key(str(error), names)
        raise ConfigOverrideError(message + touching(key, plan.overrides)) from error


class _Overlay:
    """The provider as it will be after the overrides: their values first, the provider's attributes otherwise."""

    def __init__(self, base: Any, values: dict) -> None:
        self._base, self._values = base, values

    def __getattr__(self, name: str) -> Any:
        return self._values[name] if name in self._values else getattr(self._base, name)
