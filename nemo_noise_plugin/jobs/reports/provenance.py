"""What a run was: the facts a report needs so that its numbers can be traced back to, and rerun from, their run.

``run_provenance`` reads a Megatron-Bridge ``ConfigContainer`` and returns one JSON-able dict: the recipe, the
plugin's version, the whole resolved config (Bridge's own ``ConfigContainer.to_dict``) and its sha256, the noise
mechanism and its level (or ``off``), the steps, the seeds and the sha256 of each data file the run reads.
The commit of a source checkout (``source_commit``) and the command line name the code and the call behind it.
The report writers (``artifacts.RunReport``, the robustness and task reports, the privacy-audit callback) put it
under ``provenance`` in every report JSON, and figure titles come from it (``run_title``), so a title never names a
noise level the run did not train with.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import json
import math
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "command_line",
    "config_dict",
    "config_sha256",
    "data_files",
    "file_sha256",
    "level_field",
    "noise_setting",
    "plugin_version",
    "source_commit",
]
__all__ += ["compact_provenance", "run_provenance", "run_title"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
"""Memory addresses in a ``repr``: removed, so the config hash is the same in every process."""


_CHECKOUT = Path(__file__).resolve().parents[3]
"""The folder above the package: a source checkout's root (``.git``, ``pyproject.toml``) when it is one."""


def plugin_version() -> str:
    """The installed distribution's version, else ``pyproject.toml``'s (a source checkout without an install)."""
    try:
        return importlib.metadata.version("nemo-noise-plugin")
    except importlib.metadata.PackageNotFoundError:
        pyproject = _CHECKOUT / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return found.group(1) if found else "unknown"


@functools.cache
def source_commit() -> dict[str, Any] | None:
    """The git commit of the plugin's source checkout and whether its tracked files differ from it
    (``{"commit": "c1007c1...", "modified": False}``); None outside a git checkout (an installed wheel) or without
    git. The version alone does not name the code: it stays 0.1.0 across every commit of a checkout."""
    if not (_CHECKOUT / ".git").exists():
        return None
    try:
        commit, status = (
            subprocess.run(
                ["git", "-C", str(_CHECKOUT), *arguments], capture_output=True, text=True, timeout=30, check=True
            ).stdout
            for arguments in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.strip(), "modified": bool(status.strip())}


def command_line() -> str:
    """This process's command line as the shell would take it again (``sys.orig_argv``, quoted)."""
    return shlex.join(sys.orig_argv)


def _json_value(value: Any) -> Any:
    """A JSON-able stand-in for what ``json`` cannot write: functions by name, paths and dtypes as text."""
    if isinstance(value, enum.Enum):
        return value.value if isinstance(value.value, (str, int, float, bool)) else value.name
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def _as_dict(value: Any) -> Any:
    """A dataclass tree as plain dicts (public fields only): the fallback when ``to_dict`` is missing or fails."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = (field.name for field in dataclasses.fields(value) if not field.name.startswith("_"))
        return {name: _as_dict(getattr(value, name)) for name in fields}
    if isinstance(value, (list, tuple)):
        return [_as_dict(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _as_dict(item) for key, item in value.items()}
    return value


def _finite(value: Any) -> Any:
    """``inf``, ``-inf`` and ``nan`` as the strings ``"inf"``, ``"-inf"``, ``"nan"``: strict JSON holds no others."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_finite(item) for item in value]
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    return value


def config_dict(config: Any) -> dict[str, Any]:
    """The resolved ``ConfigContainer`` as strict JSON data: Bridge's ``to_dict`` (``_target_`` keys included, as
    its ``to_yaml`` writes it), or the dataclass fields where that fails; values JSON cannot hold as
    ``_json_value``, non-finite floats as strings."""
    try:
        data = config.to_dict()
    except Exception:  # not a ConfigContainer, or a value its serialiser rejects: the plain fields then
        data = _as_dict(config)
    return _finite(json.loads(json.dumps(data, default=_json_value)))


def config_sha256(data: dict[str, Any]) -> str:
    """sha256 of ``config_dict``'s data, keys sorted: equal for equal settings, in any process."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, (str, Path)):
        yield str(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def data_files(dataset: Any) -> dict[str, str]:
    """sha256 of each data file ``dataset`` (a Bridge dataset config) reads, by path: a finetuning dataset's
    ``dataset_root/*.jsonl``; a GPT dataset's ``<prefix>.bin`` for each prefix of ``data_path``, ``blend`` and
    ``blend_per_split``. Index files (``.idx``, Bridge's ``*.npy`` caches) and files that do not exist are skipped;
    a mock dataset reads none."""
    paths: list[Path] = []
    root = getattr(dataset, "dataset_root", None)
    if root:
        paths += sorted(Path(str(root)).glob("*.jsonl"))
    for name in ("data_path", "blend", "blend_per_split"):
        for text in _strings(getattr(dataset, name, None)):
            candidate = Path(text + ".bin")
            if candidate.is_file():
                paths.append(candidate)
            elif Path(text).is_file() and Path(text).suffix in (".bin", ".jsonl"):
                paths.append(Path(text))
    return {str(path): file_sha256(path) for path in dict.fromkeys(paths) if path.is_file()}


def noise_setting(noise: Any) -> dict[str, Any]:
    """``{"mechanism": "uniform", "level": {"field": "alpha", "value": 5.0}}``: the mechanism and the value of the
    field that sets its level (its family's ``magnitude_field``; ``distance_multiple`` under ``embedding_distance``
    scaling); ``{"mechanism": "off", "level": "off"}`` when ``noise`` is None, disabled or of zero magnitude."""
    if noise is None or not noise.is_active_configuration:
        return {"mechanism": "off", "level": "off"}
    field = level_field(noise)
    return {"mechanism": noise.mechanism, "level": {"field": field, "value": getattr(noise, field)}}


def level_field(noise: Any) -> str:
    """The field that sets the level of ``noise`` (a ``NoiseConfig``): its family's ``magnitude_field``, or
    ``distance_multiple`` under ``embedding_distance`` scaling, where alpha and sigma are not used."""
    from nemo_noise_plugin.noise.bounds import noise_setting as level_setting

    return level_setting(noise)[0]


def run_provenance(config: Any, recipe_name: str | None = None) -> dict[str, Any]:
    """What the run of ``config`` (a resolved Bridge ``ConfigContainer``) was, as JSON-able data.

    Keys: ``recipe``, ``plugin_version``, ``source`` (``source_commit``), ``command_line``, ``mechanism`` and
    ``level`` (``noise_setting``), ``train_iters``,
    ``global_batch_size``, ``seeds`` (``rng``: ``rng.seed``, ``noise``: the noise's seed, ``dataset``: the dataset's
    seed), ``data_files`` (``data_files``), ``config_sha256`` and ``config`` (``config_dict``). Example::

        from nemo_noise_plugin.jobs.reports.provenance import run_provenance, run_title
        from nemo_noise_plugin.recipes import tiny_noise_sft_config

        provenance = run_provenance(tiny_noise_sft_config(dir="runs"), "tiny_noise_sft")
        run_title(provenance)  # 'tiny_noise_sft: uniform alpha=10, 30 steps, seed 1234'
    """
    noise = getattr(config.model, "noise", None)
    dataset = getattr(config, "dataset", None)
    settings = config_dict(config)
    dataset_seed = getattr(dataset, "random_seed", getattr(dataset, "seed", None))
    return {
        "recipe": recipe_name,
        "plugin_version": plugin_version(),
        "source": source_commit(),
        "command_line": command_line(),
        **noise_setting(noise),
        "train_iters": int(config.train.train_iters),
        "global_batch_size": int(config.train.global_batch_size),
        "seeds": {
            "rng": int(config.rng.seed),
            "noise": None if noise is None else int(noise.seed),
            "dataset": None if dataset_seed is None else int(dataset_seed),
        },
        "data_files": {} if dataset is None else data_files(dataset),
        "config_sha256": config_sha256(settings),
        "config": settings,
    }


def compact_provenance(provenance: dict[str, Any]) -> dict[str, Any]:
    """``provenance`` without the config itself (its ``config_sha256`` names it): for a line of a JSONL log."""
    return {key: value for key, value in provenance.items() if key != "config"}


def run_title(provenance: dict[str, Any], after_clean_steps: int = 0) -> str:
    """A figure title from ``run_provenance``: ``tiny_noise_sft: uniform alpha=5, 60 steps, seed 1234``, with
    ``noise off`` in place of the mechanism when the run trained without noise (and ``60 steps after 25 clean``
    when it started from ``after_clean_steps`` steps of clean pre-training)."""
    level = provenance["level"]
    noise = "noise off" if level == "off" else f"{provenance['mechanism']} {level['field']}={level['value']:g}"
    where = f"{provenance['recipe']}: " if provenance.get("recipe") else ""
    steps = f"{provenance['train_iters']} steps" + (f" after {after_clean_steps} clean" if after_clean_steps else "")
    return f"{where}{noise}, {steps}, seed {provenance['seeds']['rng']}"


def describe_report(report: Any, config: Any) -> dict[str, Any]:
    """Give a ``RunReport`` the provenance of the run's resolved ``ConfigContainer`` (once: the first call's stays,
    later calls return it), so every JSON file it writes carries it; returns it."""
    if report.provenance is None:
        report.describe(run_provenance(config, report.recipe))
    return report.provenance
