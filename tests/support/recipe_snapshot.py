"""Every registered recipe's ``ConfigContainer`` as plain data, to prove a refactor of the recipes changes nothing.

``snapshot(value)`` walks a config the way a reader would compare it: every attribute of every dataclass (private
ones too, e.g. AutoBridge's ``_pre_wrap_hooks``), functions and classes by their import path, torch dtypes and enums
by name, object addresses and the run's folders replaced by placeholders. ``build_snapshots(workdir)`` builds
each call in ``CALLS`` (every registered recipe with its defaults, and a few with non-default arguments) offline:
the Llama/Qwen recipes read ``tests/support/hub_configs.py`` through an offline hub cache, the SmolLM2 recipes a
config-only HF folder (``SMOLLM2_CONFIG``; the recipes read no weights when they build their config). The folders
a run would write to (``dir``, the Bridge recipes' ``./nemo_experiments``) appear as ``<DIR>`` and ``<CWD>``.

``tests/recipes/recipe_configs.json`` is what this wrote for the recipes as they were before issue 24 moved their
registration into decorators (commit 42e330f); regenerate it only for a deliberate change of a recipe::

    PYTHONPATH=. python tests/support/recipe_snapshot.py tests/recipes/recipe_configs.json
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

SMOLLM2_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
)
"""The architecture fields of SmolLM2-135M-Instruct's ``config.json``."""

HF_MODELS = ("llama32_1b", "llama31_8b", "qwen3_8b")

CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    **{
        name: (name, {})
        for name in (
            "tiny_noise_sft",
            "tiny_noise_distillation",
            "smollm2_135m_noise_sft",
            "smollm2_135m_noise_distillation",
            *(f"{model}_noise_{mode}" for model in HF_MODELS for mode in ("sft", "distillation")),
        )
    },
    "tiny_noise_sft(mock)": ("tiny_noise_sft", dict(data="mock", train_iters=7, seq_length=64, lr=1e-3)),
    "tiny_noise_distillation(noise, kd)": ("tiny_noise_distillation", dict(noise="alpha=9", kd="jsd")),
    "smollm2_135m_noise_sft(packed)": ("smollm2_135m_noise_sft", dict(packed_sequence_size=256, train_iters=1)),
    "smollm2_135m_noise_distillation(kd)": (
        "smollm2_135m_noise_distillation",
        dict(kd="jsd", global_batch_size=4, micro_batch_size=1),
    ),
    "llama32_1b_noise_distillation(ckpt)": (
        "llama32_1b_noise_distillation",
        dict(pretrained_checkpoint="/ckpt/llama32_1b", noise="alpha=9", kd="jsd"),
    ),
}
"""Snapshot name -> (``--factory`` name, arguments); ``noise="alpha=9"`` and ``kd="jsd"`` stand for
``NoiseConfig(alpha=9.0)`` and ``KDConfig(loss="jsd", temperature=2.0)``."""

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def snapshot(value: Any, replacements: dict[str, str] | None = None, _stack: tuple[int, ...] = ()) -> Any:
    """``value`` as JSON-able data (see the module docstring); each ``replacements`` key in a string is replaced."""
    replacements = replacements or {}

    def text(string: str) -> str:
        for old, new in sorted(replacements.items(), key=lambda item: -len(item[0])):
            string = string.replace(old, new)
        return _ADDRESS.sub("", string)

    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return text(value)
    if isinstance(value, Path):
        return text(str(value))
    if id(value) in _stack:
        return "<cycle>"
    stack = (*_stack, id(value))
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, type):
        return f"<class {value.__module__}.{value.__qualname__}>"
    if isinstance(value, functools.partial):
        return {
            "<partial>": snapshot(value.func, replacements, stack),
            "args": snapshot(list(value.args), replacements, stack),
            "keywords": snapshot(value.keywords, replacements, stack),
        }
    if callable(value) and hasattr(value, "__qualname__") and not dataclasses.is_dataclass(value):
        return f"<function {getattr(value, '__module__', '?')}.{value.__qualname__}>"
    if isinstance(value, (list, tuple)):
        return [snapshot(item, replacements, stack) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted(json.dumps(snapshot(item, replacements, stack), sort_keys=True) for item in value)
    if isinstance(value, dict):
        return {text(str(key)): snapshot(item, replacements, stack) for key, item in sorted(value.items(), key=str)}
    if dataclasses.is_dataclass(value):
        attributes = dict(vars(value))
        for field in dataclasses.fields(value):
            attributes.setdefault(field.name, getattr(value, field.name, "<unset>"))
        return {"<type>": f"{type(value).__module__}.{type(value).__qualname__}"} | {
            name: snapshot(item, replacements, stack) for name, item in sorted(attributes.items())
        }
    if type(value).__module__ == "torch":  # torch.dtype, torch.device
        return f"<torch {value}>"
    return text(f"<{type(value).__module__}.{type(value).__qualname__} {value!r}>")


def _arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig

    resolved = dict(arguments)
    if resolved.get("noise") == "alpha=9":
        resolved["noise"] = NoiseConfig(alpha=9.0)
    if resolved.get("kd") == "jsd":
        resolved["kd"] = KDConfig(loss="jsd", temperature=2.0)
    return resolved


def build_snapshots(workdir: Path) -> dict[str, Any]:
    """Each of ``CALLS`` built under ``workdir`` (run folders, the SmolLM2 folder, the offline hub) and snapshotted.

    Sets ``HF_HOME`` and the hub's offline switches for this process: call it in a subprocess of its own.
    """
    import inspect
    import warnings

    from tests.support.hub_configs import write_offline_hub

    warnings.filterwarnings("ignore")
    hf_home = write_offline_hub(workdir / "hf_home")
    os.environ.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    smollm2 = workdir / "smollm2"
    smollm2.mkdir(parents=True, exist_ok=True)
    (smollm2 / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))

    from nemo_noise_plugin.recipes import RECIPES, recipe_function

    results: dict[str, Any] = {"<recipes>": {}}
    for name, recipe in sorted(RECIPES.items()):
        function = recipe_function(recipe.path)
        results["<recipes>"][name] = {
            "path": recipe.path,
            "embedded_corpus": recipe.embedded_corpus,
            "reports": list(recipe.reports),
            "clean_pretrain_steps": recipe.clean_pretrain_steps,
            "signature": str(inspect.signature(function)),
        }
    for label, (name, arguments) in CALLS.items():
        function = recipe_function(RECIPES[name].path)
        parameters = inspect.signature(function).parameters
        run_dir = workdir / "runs" / re.sub(r"\W", "_", label)
        resolved = _arguments(arguments)
        if "dir" in parameters:
            resolved["dir"] = str(run_dir)
        if "hf_path" in parameters:
            resolved["hf_path"] = str(smollm2)
        config = function(**resolved)
        folders = {str(run_dir): "<DIR>", str(smollm2): "<HF>", str(hf_home): "<HF_HOME>", os.getcwd(): "<CWD>"}
        results[label] = snapshot(config, folders)
    return results


def main(argv: list[str]) -> int:
    """``recipe_snapshot.py OUT.json [WORKDIR]``: write ``build_snapshots`` to OUT.json (``-``: standard output)."""
    import tempfile

    out = argv[0]
    with tempfile.TemporaryDirectory() as folder:
        results = build_snapshots(Path(argv[1]) if len(argv) > 1 else Path(folder))
    text = json.dumps(results, indent=1, sort_keys=True) + "\n"
    if out == "-":
        sys.stdout.write(text)
    else:
        Path(out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
