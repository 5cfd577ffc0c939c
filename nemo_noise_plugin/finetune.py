"""The ``finetune`` command: a plugin recipe plus Hydra overrides, then a dry run, a YAML export or Bridge's training.

One flow behind both command lines: ``nemo llm finetune`` (NeMo-Run, ``nemo_noise_plugin.cli_llm``) and this
module's ``python -m`` form, for users who launch with torchrun::

    python -m nemo_noise_plugin.finetune --factory tiny_noise_distillation model.noise.alpha=10 --dryrun
    python -m nemo_noise_plugin.finetune --factory tiny_noise_sft train.train_iters=7 --to-yaml run.yaml
    torchrun --nproc-per-node 8 -m nemo_noise_plugin.finetune --factory tiny_noise_sft train.train_iters=100

``--factory`` takes a name from ``RECIPES`` or the import path of any function returning a Bridge
``ConfigContainer`` (``my_pkg.recipes:my_config``). The trailing ``key=value`` / ``+key=value`` / ``~key``
arguments go through Megatron-Bridge's Hydra override path, with the plugin's NoiseConfig/KDConfig re-validated
(``nemo_noise_plugin.config_io.apply_overrides``).
``--to-yaml PATH`` writes the resolved config with Bridge's ``ConfigContainer.to_yaml`` (``-``: standard output)
and launches nothing, like ``--dryrun``; neither touches CUDA. Without them the run goes to
``nemo_noise_plugin.launch.launch`` (Bridge's loop, which needs a GPU) with a progress line per step; the tiny
recipes on the shipped corpus (``EMBEDDED_CORPUS_FACTORIES``) run as the main job does: Bridge's loop on a GPU,
the CPU loop without one, and a robustness report in the run directory either way.

Importing this module is cheap (no torch, no Bridge): ``nemo`` imports it when it builds its command groups.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RECIPES", "FinetuneError", "UnknownFactoryError", "describe", "load_recipe", "main", "run_finetune"]

RECIPES: dict[str, str] = {
    "tiny_noise_sft": "nemo_noise_plugin.recipes:tiny_noise_sft_config",
    "tiny_noise_distillation": "nemo_noise_plugin.recipes:tiny_noise_distillation_config",
    **{
        f"{model}_noise_{mode}": f"nemo_noise_plugin.recipes.hf_models:{model}_noise_{mode}_config"
        for model in ("llama32_1b", "llama31_8b", "qwen3_8b")
        for mode in ("sft", "distillation")
    },
}
"""``--factory`` name -> recipe (``module:function`` returning a ``ConfigContainer``); one line adds a factory to
both ``nemo llm finetune`` and ``python -m nemo_noise_plugin.finetune``. Imported only when used."""

EMBEDDED_CORPUS_FACTORIES: frozenset[str] = frozenset({"tiny_noise_sft", "tiny_noise_distillation"})
"""Factories of the tiny recipes on the shipped corpus: a real run of these also writes the robustness report, and
without a GPU it runs the main job's CPU loop instead of stopping."""


class FinetuneError(Exception):
    """A user error of the finetune command (unknown factory, bad override, bad option); the message says which."""


class UnknownFactoryError(FinetuneError, LookupError):
    """``--factory`` names neither a registered recipe nor an importable function."""


def import_path(path: str) -> Any:
    """The object at ``package.module:attribute`` (or ``package.module.attribute``)."""
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    module = importlib.import_module(module_name)
    for part in attribute.split("."):
        module = getattr(module, part)
    return module


def load_recipe(name: str, available: Sequence[str] | None = None) -> Callable[[], Any]:
    """The recipe function for ``--factory name``: a ``RECIPES`` name, else an import path to a function.

    Raises ``UnknownFactoryError`` listing ``available`` (default: the ``RECIPES`` names) when neither resolves.
    """
    if name in RECIPES:
        return import_path(RECIPES[name])
    if "." in name or ":" in name:
        try:
            recipe = import_path(name)
        except (ImportError, AttributeError, ValueError) as error:
            raise UnknownFactoryError(f"--factory {name!r} cannot be imported: {error}") from error
        if not callable(recipe):
            raise UnknownFactoryError(f"--factory {name!r} is not a function returning a ConfigContainer.")
        return recipe
    raise unknown_factory(name, RECIPES if available is None else available)


def unknown_factory(name: str, available: Sequence[str]) -> UnknownFactoryError:
    """The error for an unknown ``--factory``, listing the registered names."""
    return UnknownFactoryError(
        f"Unknown factory {name!r}. Available factories: {', '.join(sorted(available))} "
        "(or the import path of a function returning a ConfigContainer, e.g. my_pkg.recipes:my_config)."
    )


def build_config(recipe: Callable[[], Any], factory: str) -> Any:
    """Call the recipe and check that it returned a Megatron-Bridge ``ConfigContainer``."""
    from nemo_noise_plugin.bridge_imports import import_bridge

    config = recipe()
    container = import_bridge("megatron.bridge.training.config").ConfigContainer
    if not isinstance(config, container):
        raise FinetuneError(f"--factory {factory!r} returned {type(config).__name__}, not a Bridge ConfigContainer.")
    return config


def apply_overrides(config: Any, overrides: Sequence[str]) -> Any:
    """``config_io.apply_overrides`` (Bridge's Hydra path, plugin settings re-validated), raising ``FinetuneError``."""
    from nemo_noise_plugin.config_io import ConfigOverrideError, apply_overrides

    for override in overrides:
        if override.startswith("-"):
            raise FinetuneError(f"unknown option {override!r}; overrides look like key=value, +key=value or ~key.")
    try:
        return apply_overrides(config, list(overrides))
    except ConfigOverrideError as error:
        raise FinetuneError(f"invalid override: {error}") from error


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def describe(config: Any, factory: str, overrides: Sequence[str]) -> str:
    """A few lines saying what a run of ``config`` would do: model, forward step, entry, sizes, noise and KD."""
    from nemo_noise_plugin.launch import forward_step_for, training_entry_for

    model, train = config.model, config.train
    parallel = ", ".join(
        f"{label}={getattr(model, field, 1)}"
        for label, field in (
            ("TP", "tensor_model_parallel_size"),
            ("PP", "pipeline_model_parallel_size"),
            ("CP", "context_parallel_size"),
            ("EP", "expert_model_parallel_size"),
        )
    )
    lines = [
        f"  factory       {factory}",
        f"  overrides     {' '.join(overrides) if overrides else '(none)'}",
        f"  model         {_qualname(type(model))}: {model.num_layers} layers, hidden {model.hidden_size}, {parallel}",
        f"  forward step  {_qualname(forward_step_for(config))}",
        f"  entry         {_qualname(training_entry_for(config))}",
        f"  train         {train.train_iters} iterations, global batch {train.global_batch_size}, "
        f"micro batch {train.micro_batch_size}, seq length {model.seq_length}",
        f"  checkpoints   save={config.checkpoint.save} load={config.checkpoint.load} "
        f"pretrained={config.checkpoint.pretrained_checkpoint}",
    ]
    for name in ("noise", "kd"):
        if getattr(model, name, None) is not None:
            lines.append(f"  {name:<13} {getattr(model, name)!r}")
    return "\n".join(lines)


def _export_yaml(config: Any, to_yaml: str, print_fn: Callable[[str], None]) -> None:
    if to_yaml == "-":
        config.print_yaml()
    else:
        config.to_yaml(to_yaml)
        print_fn(f"Resolved config written to {to_yaml}")


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def run_finetune(
    recipe: str | Callable[[], Any],
    overrides: Sequence[str] = (),
    *,
    factory: str | None = None,
    dryrun: bool = False,
    to_yaml: str | None = None,
    confirm: Callable[[], bool] | None = None,
    print_fn: Callable[[str], None] = print,
) -> Any:
    """Resolve ``recipe`` + ``overrides``; then export YAML / describe (dry run) or launch Bridge's training.

    Args:
        recipe: a ``--factory`` name or import path (``load_recipe``), or a function returning a ConfigContainer.
        overrides: Hydra-style overrides for Bridge's override path.
        factory: the name to report (default: ``recipe`` when it is a string).
        dryrun: print what would run and stop.
        to_yaml: write the resolved config to this path (``-``: standard output) and stop.
        confirm: asked after the description, before a real run; False stops (NeMo-Run's ``Continue?``).
        print_fn: where the description goes (rank 0 only under torchrun).

    Returns the resolved ConfigContainer. A real run checks for a GPU before it builds anything.
    """
    factory = factory or (recipe if isinstance(recipe, str) else getattr(recipe, "__name__", "recipe"))
    if to_yaml is not None and "=" in to_yaml and not to_yaml.endswith((".yaml", ".yml")):
        raise FinetuneError(
            f"--to-yaml takes a file path ('-' for standard output), got {to_yaml!r}, which looks like an override."
        )
    if not dryrun and to_yaml is None:
        from nemo_noise_plugin import launch as launching

        try:
            launching.require_gpu()
        except launching.GPUUnavailableError:
            if factory not in EMBEDDED_CORPUS_FACTORIES:
                raise
    # With --to-yaml -, standard output carries only the YAML: Megatron's root log handler (INFO, bound to
    # sys.stdout when megatron.training is first imported) and the dry-run description go to stderr.
    with contextlib.redirect_stdout(sys.stderr) if to_yaml == "-" else contextlib.nullcontext():
        if isinstance(recipe, str):
            recipe = load_recipe(recipe)
        config = apply_overrides(build_config(recipe, factory), overrides)
        if dryrun:
            print_fn(f"Dry run (nothing launched):\n{describe(config, factory, overrides)}")
    if to_yaml is not None:
        _export_yaml(config, to_yaml, print_fn)
    if dryrun or to_yaml is not None:
        return config
    if _is_rank_zero():
        print_fn(f"Launching:\n{describe(config, factory, overrides)}")
    if confirm is not None and not confirm():
        print_fn("Exiting without training.")
        return config
    if factory in EMBEDDED_CORPUS_FACTORIES:  # the main job's loop: Bridge's on a GPU, else the CPU loop
        from nemo_noise_plugin.demo import train_with_report

        code = train_with_report(config, output_dir=_report_dir(config), label=f"factory {factory}")
        if code:
            raise FinetuneError(f"the run of factory {factory} failed (exit status {code}).")
        return config
    from nemo_noise_plugin.bridge_imports import import_bridge
    from nemo_noise_plugin.demo import progress_line_callback
    from nemo_noise_plugin.launch import launch

    launch(config, callbacks=[progress_line_callback(import_bridge("megatron.bridge.training.callbacks").Callback)()])
    return config


def _report_dir(config: Any) -> str:
    """Where a tiny recipe's robustness report goes: its run directory (the parent of its checkpoints)."""
    if config.checkpoint.save:
        return os.path.dirname(os.path.abspath(config.checkpoint.save))
    return os.path.abspath("outputs")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_noise_plugin.finetune",
        description="Noise fine-tuning / noisy-student distillation on Megatron-Bridge's training loop.",
        epilog="Factories: " + ", ".join(sorted(RECIPES)) + ". Under torchrun every rank runs this command.",
    )
    parser.add_argument(
        "--factory", "-f", required=True, help="recipe name, or module:function returning a ConfigContainer"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, +key=value, ~key")
    parser.add_argument("--dryrun", action="store_true", help="print what would run; touch no GPU")
    parser.add_argument(
        "--to-yaml",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the resolved config as YAML (default '-': standard output) and stop",
    )
    parser.add_argument(
        "--yes", "-y", action="store_true", help="accepted for symmetry with `nemo`; this command never asks"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nemo_noise_plugin.finetune``; returns the exit status (2 for usage errors, 1 for a missing GPU)."""
    from nemo_noise_plugin.launch import GPUUnavailableError

    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    try:
        run_finetune(args.factory, args.overrides, dryrun=args.dryrun, to_yaml=args.to_yaml)
    except FinetuneError as error:
        parser.error(str(error))
    except GPUUnavailableError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # Bridge's checkpoint-save workers re-import the launching module
    sys.exit(main())
