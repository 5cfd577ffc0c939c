"""Named presets of the plugin's configs: the repository's ``configs/noise/*.yaml`` and ``configs/kd/*.yaml``.

``load_noise_config("neftune_alpha5")`` and ``load_kd_config("forward_kl_t2")`` read them by name; both also take a
path to a YAML file of the config's fields. ``available_presets("noise")`` lists the names.

``configs/`` at the top level is the one source. An installed wheel carries a copy inside the package,
``nemo_noise_plugin/configs/`` (setup.py's build step puts it there); a checkout or an editable install has no such
folder and reads ``configs/`` next to the package.
"""

from __future__ import annotations

import dataclasses
import os
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from nemo_noise_plugin.yaml_files import load_yaml_file

__all__ = ["PRESET_KINDS", "available_presets", "load_config_yaml_fields", "preset_path"]

PRESET_KINDS: tuple[str, ...] = ("noise", "kd")


def _configs_folder() -> Traversable:
    """The wheel's ``nemo_noise_plugin/configs/`` when installed, else the checkout's top-level ``configs/``."""
    installed = resources.files("nemo_noise_plugin").joinpath("configs")
    if installed.is_dir():
        return installed
    checkout = Path(__file__).resolve().parents[2] / "configs"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"the presets are missing: neither {installed} nor {checkout} is a folder.")


def _preset_folder(kind: str) -> Traversable:
    if kind not in PRESET_KINDS:
        raise ValueError(f"preset kind {kind!r} is invalid: expected one of {', '.join(PRESET_KINDS)}.")
    return _configs_folder().joinpath(kind)


def available_presets(kind: str) -> list[str]:
    """The preset names of ``kind`` (``noise`` or ``kd``), sorted."""
    return sorted(
        entry.name[: -len(".yaml")] for entry in _preset_folder(kind).iterdir() if entry.name.endswith(".yaml")
    )


def preset_path(kind: str, name_or_path: str | os.PathLike[str]) -> Path:
    """The YAML file for a preset name of ``kind``, or ``name_or_path`` itself when it names a file.

    A bare name (no ``/``, no ``.yaml``) is a preset; anything else is a path. Raises ``FileNotFoundError`` naming
    the available presets when neither exists.
    """
    text = os.fspath(name_or_path)
    is_name = "/" not in text and os.sep not in text and not text.endswith((".yaml", ".yml"))
    if is_name:
        candidate = _preset_folder(kind).joinpath(f"{text}.yaml")
        if candidate.is_file():
            return Path(str(candidate))
        raise FileNotFoundError(
            f"no {kind} preset named {text!r}; available: {', '.join(available_presets(kind))} "
            "(or give the path of a YAML file)."
        )
    return Path(text)


def load_config_yaml_fields[ConfigType](config_type: type[ConfigType], path: Path, **overrides: Any) -> ConfigType:
    """``config_type(**fields)`` from a YAML mapping of its fields at ``path``, then ``overrides``, validated.

    The file is read by ``yaml_files.load_yaml_file`` (``1e-3`` is a number; an empty file, a repeated key or a top
    level that is not a mapping raise ``YAMLInputError`` naming the file).
    """
    name = config_type.__name__
    values = load_yaml_file(path, what=f"a mapping of {name} fields (field: value)")
    allowed = [field.name for field in dataclasses.fields(config_type)]
    unknown = sorted(map(str, set(values) - set(allowed)))
    if unknown:
        raise ValueError(f"{path}: unknown {name} field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}.")
    values.update(overrides)
    return config_type(**values)
