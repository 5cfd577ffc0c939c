"""The finetune flow: a recipe plus a YAML file and Hydra overrides, then a dry run, a YAML export or training.

One function (``run_finetune``) behind both command lines: ``nemo llm finetune`` (NeMo-Run, ``cli.nemo_llm``) and
``python -m nemo_noise_plugin.cli.finetune``, for users who launch with torchrun.

``recipe`` is a name from ``recipes.RECIPES`` or the import path of any function returning a Bridge
``ConfigContainer`` (``my_pkg.recipes:my_config``). ``config_file`` (a YAML file, e.g. one of the repository's
``recipes/*.yaml`` or a ``--to-yaml`` export) is merged first, then the ``key=value`` / ``+key=value`` / ``~key``
overrides, both through Megatron-Bridge's override path with the plugin's NoiseConfig/KDConfig re-validated
(``training.overrides.apply_overrides``). ``to_yaml`` writes the resolved config with Bridge's
``ConfigContainer.to_yaml`` (``-``: standard output) and launches nothing, like ``dryrun``; neither touches CUDA.
Otherwise the run goes to the plain launcher (``jobs.launch.launcher.launch``) with a progress line per step and the
report callbacks its recipe names (``Recipe.reports``, built by ``jobs.reports.callbacks``: the robustness report,
and the task report for instruction data, in the run directory); a recipe on data shipped with the package
(``Recipe.embedded_corpus``) runs on the CPU loop without a GPU. Clean pre-training and the control run are the
main job's (``jobs.main_job``), not this flow's.

Importing this module is cheap (no torch, no Bridge): ``nemo`` imports it when it builds its command groups.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from nemo_noise_plugin.recipes import RECIPES, recipe_function

__all__ = [
    "check_distinct_overrides",
    "follow_checkpoint_save",
    "FinetuneError",
    "HubMissError",
    "UnknownFactoryError",
    "check_recipe_arguments",
    "check_takes_no_arguments",
    "describe",
    "load_recipe",
    "run_finetune",
    "unknown_factory",
]


class FinetuneError(Exception):
    """A user error of the finetune command (unknown factory, bad override, bad option); the message says which."""


class UnknownFactoryError(FinetuneError, LookupError):
    """``--factory`` names neither a registered recipe nor an importable function."""


class HubMissError(FinetuneError):
    """In a dry run, which reaches for no model hub, the recipe needed a model config that is not cached."""


def load_recipe(name: str, available: Sequence[str] | None = None) -> Callable[[], Any]:
    """The recipe function for ``--factory name``: a ``RECIPES`` name, else an import path to a function.

    Raises ``UnknownFactoryError`` listing ``available`` (default: the ``RECIPES`` names) when neither resolves.
    """
    if name in RECIPES and RECIPES[name].hf_model is None:
        return recipe_function(RECIPES[name].path)
    if name in RECIPES:  # a SmolLM2 recipe gets the offline folder of its model as hf_path (jobs.models.offline)
        from nemo_noise_plugin.jobs.models.offline import with_offline_model

        return with_offline_model(name, recipe_function(RECIPES[name].path))
    if "." in name or ":" in name:
        try:
            recipe = recipe_function(name)
        except (ImportError, AttributeError, ValueError) as error:
            raise UnknownFactoryError(f"--factory {name!r} cannot be imported: {error}") from error
        if not callable(recipe):
            raise UnknownFactoryError(f"--factory {name!r} is not a function returning a ConfigContainer.")
        check_takes_no_arguments(name, recipe)
        return recipe
    raise unknown_factory(name, RECIPES if available is None else available)


def check_takes_no_arguments(name: str, recipe: Callable[..., Any]) -> None:
    """``UnknownFactoryError`` when ``recipe`` (an imported ``--factory``) cannot be called without arguments
    (``-f json:dumps``): it is not a recipe, and calling it would be a ``TypeError`` from inside it."""
    try:
        parameters = inspect.signature(recipe).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): calling it says the rest
        return
    varargs = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind not in varargs]
    if required:
        raise UnknownFactoryError(
            f"--factory {name!r} is not a recipe: it needs the argument(s) {', '.join(required)}; expected a "
            "function that returns a Bridge ConfigContainer when called without arguments."
        )


def check_recipe_arguments(name: str, recipe: Callable[..., Any], arguments: dict[str, Any]) -> None:
    """``FinetuneError`` naming an argument ``recipe`` does not take (``-f "tiny_noise_sft(bogus=1)"``) and its
    arguments. Both front doors call it on a recipe ``load_recipe`` (or NeMo-Run's factory) loaded, before calling
    it with ``arguments``: a typo is one line, not a ``TypeError`` from inside the recipe."""
    parameters = inspect.signature(recipe).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for key, value in arguments.items():
        if key not in parameters:
            allowed = ", ".join(p for p in parameters if parameters[p].kind is not inspect.Parameter.VAR_POSITIONAL)
            raise FinetuneError(
                f"--factory {name}: {key}={value!r} is invalid: {name} takes no argument {key!r}; "
                f"its arguments: {allowed or '(none)'}."
            )


def unknown_factory(name: str, available: Sequence[str]) -> UnknownFactoryError:
    """The error for an unknown ``--factory``, listing the registered names."""
    return UnknownFactoryError(
        f"Unknown factory {name!r}. Available factories: {', '.join(sorted(available))} "
        "(or the import path of a function returning a ConfigContainer, e.g. my_pkg.recipes:my_config)."
    )


def build_config(recipe: Callable[[], Any], factory: str, *, dryrun: bool = False) -> Any:
    """Call the recipe and check that it returned a Megatron-Bridge ``ConfigContainer``. A ``dryrun`` reaches for no
    model hub (``offline_hub``): a model config that is not cached is a ``FinetuneError`` saying so."""
    from nemo_noise_plugin.jobs.launch.offline_hub import HUB_MISS, hub_miss, hub_offline
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    try:
        with hub_offline() if dryrun else contextlib.nullcontext():
            config = recipe()
    except Exception as error:
        if dryrun and not isinstance(error, FinetuneError) and hub_miss(error):
            raise HubMissError(f"--factory {factory!r} cannot be built here: {HUB_MISS}.") from None
        raise
    container = import_bridge("megatron.bridge.training.config").ConfigContainer
    if not isinstance(config, container):
        raise FinetuneError(f"--factory {factory!r} returned {type(config).__name__}, not a Bridge ConfigContainer.")
    return config


def apply_overrides(config: Any, overrides: Sequence[str], config_file: str | None = None) -> Any:
    """``training.overrides.apply_overrides`` (YAML file, then Bridge's Hydra path, the touched settings checked),
    then ``validate_plugin_settings``, raising ``FinetuneError``."""
    from nemo_noise_plugin.training.overrides import ConfigOverrideError, apply_overrides, validate_plugin_settings

    for override in overrides:
        if override.startswith("-"):
            raise FinetuneError(f"unknown option {override!r}; overrides look like key=value, +key=value or ~key.")
    try:
        config = apply_overrides(config, list(overrides), config_filepath=config_file)
    except ConfigOverrideError as error:
        raise FinetuneError(f"invalid {'--config-file or ' if config_file else ''}override: {error}") from error
    try:
        validate_plugin_settings(config)
    except ConfigOverrideError as error:
        raise FinetuneError(f"invalid config: {error}") from error
    return config


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def describe(config: Any, factory: str, overrides: Sequence[str], config_file: str | None = None) -> str:
    """A few lines saying what a run of ``config`` would do: model, forward step, entry, sizes, noise and KD."""
    from nemo_noise_plugin.jobs.launch.launcher import forward_step_for, training_entry_for

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
        f"  config file   {config_file or '(none)'}",
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


def check_distinct_overrides(overrides: Sequence[str]) -> None:
    """``SettingError`` naming a setting that ``overrides`` set twice (``model.noise.alpha=5 model.noise.alpha=10``):
    Hydra would take the last without a word. ``key=``, ``+key=`` and ``~key`` each count apart (adding a key and then
    deleting it is two edits)."""
    from nemo_noise_plugin.validation import SettingError

    seen: dict[str, list[str]] = {}
    for override in overrides:
        key, _, value = override.partition("=")
        seen.setdefault(key.strip(), []).append(value)
    for key, values in seen.items():
        if len(values) > 1:
            raise SettingError(key, values, "one value", why=" (the setting is given more than once; keep one)")


def follow_checkpoint_save(config: Any, overrides: Sequence[str]) -> None:
    """An override of ``checkpoint.save`` without one of ``checkpoint.load`` moves the load folder with it: a run told
    to save elsewhere resumes from there, not from the recipe's default folder (another run's checkpoints)."""
    keys = {override.lstrip("+~").partition("=")[0].strip() for override in overrides}
    if "checkpoint.save" in keys and "checkpoint.load" not in keys:
        config.checkpoint.load = config.checkpoint.save


def run_finetune(
    recipe: str | Callable[[], Any],
    overrides: Sequence[str] = (),
    *,
    factory: str | None = None,
    config_file: str | None = None,
    dryrun: bool = False,
    to_yaml: str | None = None,
    confirm: Callable[[], bool] | None = None,
    print_fn: Callable[[str], None] = print,
    run_dir: str | None = None,
) -> Any:
    """Resolve ``recipe`` + ``overrides``; then export YAML / describe (dry run) or launch Bridge's training.

    Args:
        recipe: a ``--factory`` name or import path (``load_recipe``), or a function returning a ConfigContainer.
        overrides: Hydra-style overrides for Bridge's override path.
        factory: the name to report (default: ``recipe`` when it is a string).
        config_file: a YAML file of config fields merged before ``overrides`` (e.g. ``recipes/*.yaml``).
        dryrun: check the run settings as a real run would (``check_run_settings``, creating nothing), print what
            would run and stop.
        to_yaml: write the resolved config to this path (``-``: standard output) and stop.
        confirm: asked after the description, before a real run; False stops (NeMo-Run's ``Continue?``).
        print_fn: where the description goes (rank 0 only under torchrun).
        run_dir: a NeMo-Run job directory (set by ``jobs.executors.task``): a real run writes the resolved
            ``config.yaml`` there (rank 0), the commands' Bridge log (``bridge.log``, ``bridge_console``) and
            the reports its recipe names (``Recipe.reports``). Default: the parent of ``checkpoint.save``.

    Returns the resolved ConfigContainer. A real run checks for a GPU before it builds anything.
    """
    factory = factory or (recipe if isinstance(recipe, str) else getattr(recipe, "__name__", "recipe"))
    check_distinct_overrides(overrides)
    if to_yaml is not None and "=" in to_yaml and not to_yaml.endswith((".yaml", ".yml")):
        raise FinetuneError(
            f"--to-yaml takes a file path ('-' for standard output), got {to_yaml!r}, which looks like an override."
        )
    registered = RECIPES.get(factory)
    cpu_loop = registered is not None and registered.embedded_corpus  # trains on shipped data: fits the CPU loop
    if not dryrun and to_yaml is None:
        from nemo_noise_plugin.jobs.launch import launcher as launching

        launching.check_torchrun_ranks(cpu_loop=cpu_loop)
        if not cpu_loop:
            launching.require_gpu()
    # With --to-yaml -, standard output carries only the YAML: Megatron's root log handler (INFO, bound to
    # sys.stdout when megatron.training is first imported) and the dry-run description go to stderr.
    with contextlib.redirect_stdout(sys.stderr) if to_yaml == "-" else contextlib.nullcontext():
        if isinstance(recipe, str):
            recipe = load_recipe(recipe)
        config = apply_overrides(build_config(recipe, factory, dryrun=dryrun), overrides, config_file)
        follow_checkpoint_save(config, overrides)
        if dryrun:  # the settings a real run's launch() rejects, creating nothing
            from nemo_noise_plugin.jobs.launch.launcher import check_run_settings

            check_run_settings(config, dry=True)
            print_fn(f"Dry run (nothing launched):\n{describe(config, factory, overrides, config_file)}")
    if to_yaml is not None:
        _export_yaml(config, to_yaml, print_fn)
    if dryrun or to_yaml is not None:
        return config
    if _is_rank_zero():
        print_fn(f"Launching:\n{describe(config, factory, overrides, config_file)}")
    if confirm is not None and not confirm():
        print_fn("Exiting without training.")
        return config
    if run_dir is not None and _is_rank_zero():
        os.makedirs(run_dir, exist_ok=True)
        config.to_yaml(os.path.join(run_dir, "config.yaml"))
        print_fn(f"Resolved config written to {os.path.join(run_dir, 'config.yaml')}")
    from nemo_noise_plugin.jobs.launch.bridge_console import run_folder
    from nemo_noise_plugin.jobs.launch.launcher import launch
    from nemo_noise_plugin.jobs.progress import ProgressLine

    folder = run_dir or _report_dir(config)
    with run_folder(folder):  # where the commands' Bridge log goes (jobs.launch.bridge_console)
        # The plain launcher with the report callbacks the recipe names: no side runs here (the control and the clean
        # pre-training are the main job's); Bridge's loop on a GPU, the CPU loop for a recipe on shipped data.
        reports = _report_callbacks(registered.reports if registered else (), config, folder, factory)
        launch(config, callbacks=[*reports, ProgressLine()], allow_cpu_loop=cpu_loop)
    if reports and _is_rank_zero():
        from nemo_noise_plugin.jobs.reports.callbacks import robustness_report

        report = robustness_report(reports)
        if report is not None and "after" not in report.curves:
            print_fn("no robustness report: training ended before its last iteration")
    return config


def _report_callbacks(names: Sequence[str], config: Any, folder: str, factory: str) -> list[Any]:
    """The report callbacks ``names`` (``Recipe.reports``) of a run writing into ``folder/reports/``."""
    if not names:
        return []
    from nemo_noise_plugin.jobs.reports.artifacts import RunReport
    from nemo_noise_plugin.jobs.reports.callbacks import report_callbacks

    return report_callbacks(names, config, RunReport(folder, recipe=factory))


def _report_dir(config: Any) -> str:
    """The run directory without a job directory: the parent of the checkpoints (a tiny recipe's report, the log)."""
    if config.checkpoint.save:
        return os.path.dirname(os.path.abspath(config.checkpoint.save))
    return os.path.abspath("outputs")
