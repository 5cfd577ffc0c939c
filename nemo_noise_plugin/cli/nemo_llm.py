"""Entry point of the ``llm`` command group of NeMo-Run's ``nemo`` command line: ``nemo llm finetune``.

Registered under the ``nemo_run.cli`` entry-point group (``pyproject.toml``). ``nemo`` imports every such module
when it builds its groups, so importing this one stays cheap (no torch, Megatron-Bridge or Transformer Engine)::

    nemo llm finetune --factory tiny_noise_distillation model.noise.alpha=10 model.kd.temperature=2 --dryrun
    nemo llm finetune --factory tiny_noise_sft --config-file recipes/tiny_neftune.yaml train.train_iters=7
    nemo llm finetune --factory tiny_noise_sft train.train_iters=7 --to-yaml run.yaml
    torchrun --nproc-per-node 8 $(which nemo) llm finetune --factory tiny_noise_sft -y

How it sits in NeMo-Run (0.11): ``finetune`` is a ``@run.cli.entrypoint`` with a ``RunContext`` subclass whose
command has exactly the options that work here (``--factory/-f``, ``--config-file/-c``, ``--dryrun``,
``--to-yaml PATH``, ``--yes/-y``, ``--verbose/-v``); the recipes in ``nemo_noise_plugin.recipes.RECIPES`` are
``@run.cli.factory``
factories of ``finetune`` (lazy: the recipe module is imported when the factory is called) and ``--factory`` resolves
through NeMo-Run's registry, so other packages can add factories with ``run.cli.factory(target=finetune)``. The
trailing ``key=value`` arguments do not go through NeMo-Run's parser (which edits ``run.Config`` objects, where
``+=`` means "add to"): ``FinetuneRunContext`` hands them to Megatron-Bridge's Hydra override path. Without
``executor=`` the function runs in-process; NeMo-Run's confirmation (``Continue?``) is skipped with ``-y`` or under
torchrun (``WORLD_SIZE`` > 1). With ``executor=local|slurm|slurm_ssh|docker|lepton|dgxcloud`` (factories
registered for this run context, ``executor.KEY=VALUE`` settings) ``jobs.executors.task.launch_finetune`` checks
everything it can, then runs a ``run.Partial`` of ``finetune`` in a NeMo-Run experiment on that executor
(``--dryrun``: the same checks, then the torchrun command, sbatch script, container or cluster job it would
launch; folders on the cluster or container side are not checked on this machine)::

    nemo llm finetune -f tiny_noise_sft executor=local executor.ntasks_per_node=8 -y
    nemo llm finetune -f llama31_8b_noise_distillation executor=slurm executor.nodes=2 executor.account=acct --dryrun

With NeMo 2 installed (``nemo.collections.llm`` importable) this module does not shadow its ``llm finetune``: the
plugin's command moves to ``nemo noise finetune``, and each recipe is also registered as a factory of NeMo 2's
``llm.finetune`` that runs the plugin's command (``nemo llm finetune --factory tiny_noise_sft -y
'overrides=["model.noise.alpha=10"]'``; there NeMo-Run's parser sets the arguments of that call).
"""

# No ``from __future__ import annotations`` and no ``X | None``: NeMo-Run's argument parser needs real types.
import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any, Optional

import nemo_run as run
import typer
from nemo_run.cli.api import Entrypoint, RunContext, RunContextError, _is_torchrun

from nemo_noise_plugin.cli.console import (
    VERBOSE_ENV,
    quiet_for_nemo_command,
    quiet_third_party,
    running_the_plugin_command,
)
from nemo_noise_plugin.cli.exits import end_sigterm_stop, rank_zero_says_it, run_command, stop_on_sigterm
from nemo_noise_plugin.cli.gpu_free import hide_gpus_for_dry_run
from nemo_noise_plugin.cli.nemo2 import nemo2_factory, nemo2_llm_finetune

quiet_for_nemo_command()  # before the imports below bring in Megatron (NeMo-Run imports this module at start-up)
if running_the_plugin_command():
    hide_gpus_for_dry_run()  # before Megatron-Bridge's own entry point makes ModelOpt open a CUDA context

from nemo_noise_plugin.cli.finetune import check_to_yaml  # noqa: E402
from nemo_noise_plugin.jobs.executors.kinds import EXECUTORS  # noqa: E402
from nemo_noise_plugin.jobs.executors.settings import build_executor  # noqa: E402
from nemo_noise_plugin.jobs.executors.task import launch_finetune  # noqa: E402
from nemo_noise_plugin.jobs.launch.finetune import (  # noqa: E402
    FinetuneError,
    check_recipe_arguments,
    check_takes_no_arguments,
    load_recipe,
    run_finetune,
    unknown_factory,
)
from nemo_noise_plugin.jobs.launch.launcher import GPUUnavailableError  # noqa: E402
from nemo_noise_plugin.recipes import RECIPES, recipe_function  # noqa: E402

__all__ = [
    "FinetuneEntrypoint",
    "FinetuneRunContext",
    "finetune",
    "register_nemo_factory",
    "registered_executors",
    "registered_factories",
    "split_executor_arguments",
]


def finetune(
    factory: str,
    overrides: Optional[list[str]] = None,  # noqa: UP045
    config_file: Optional[str] = None,  # noqa: UP045
    dryrun: bool = False,
    to_yaml: Optional[str] = None,  # noqa: UP045
    confirm: Optional[Callable[[], bool]] = None,  # noqa: UP045
    run_dir: Optional[str] = None,  # noqa: UP045
) -> None:
    """Noise fine-tuning / noisy-student distillation with a plugin recipe on Megatron-Bridge's training loop.

    --factory picks the recipe; --config-file merges a YAML file of config fields into it (e.g. recipes/*.yaml);
    trailing key=value, +key=value and ~key arguments are then Hydra overrides of its ConfigContainer
    (Megatron-Bridge's override path). --dryrun checks the run settings a real run checks and prints what would
    run, --to-yaml PATH writes the resolved config ('-': standard output); neither touches CUDA. Otherwise Bridge
    trains (pretrain, or finetune when checkpoint.pretrained_checkpoint is set) with the plugin's forward step.
    Add -y to skip the confirmation.
    executor=local|slurm|slurm_ssh|docker|lepton|dgxcloud executor.KEY=VALUE launches it through a NeMo-Run
    executor instead of in-process (--dryrun then prints the torchrun command, sbatch script, container or cluster
    job); run_dir is set for such a task.
    """
    run_finetune(
        lambda: _resolve_factory(factory),
        overrides or [],
        factory=factory,
        config_file=config_file,
        dryrun=dryrun,
        to_yaml=to_yaml,
        confirm=confirm,
        run_dir=run_dir,
    )


def _factory_namespace() -> str:
    from nemo_run.config import get_type_namespace

    return get_type_namespace(finetune)


def registered_factories() -> list[str]:
    """The ``--factory`` names NeMo-Run knows for ``finetune`` (the plugin's recipes and any registered elsewhere)."""
    import catalogue

    return sorted(key[-1] for key in catalogue._get_all((_factory_namespace(),)))


def _resolve_factory(name: str) -> Any:
    """``--factory name`` resolved as NeMo-Run resolves it (registry, import path, ``name(arg=value)``), then called."""
    from nemo_run.cli.cli_parser import parse_factory

    if ":" in name:  # the plugin's import-path form (module:function), which NeMo-Run's parser does not take
        return load_recipe(name)()
    if "." in name and "(" not in name:  # NeMo-Run's dotted form calls the function: it must be a recipe
        module, _, function = name.rpartition(".")
        with contextlib.suppress(ImportError, AttributeError):
            check_takes_no_arguments(name, getattr(importlib.import_module(module), function))
    try:
        return parse_factory(finetune, "", finetune, name)
    except ValueError as error:
        if "No matching factory" in str(error):
            raise unknown_factory(name, registered_factories()) from None
        raise


def _recipe_factory(name: str, path: str) -> Callable[..., Any]:
    """A NeMo-Run factory calling the recipe at ``path`` (imported on call, so ``nemo`` starts without Bridge)."""

    module, _, function = path.partition(":")

    def factory(**kwargs: Any) -> Any:
        recipe = recipe_function(path)
        if RECIPES[name].hf_model is not None:  # only a recipe of a named HF model has an offline folder to get
            from nemo_noise_plugin.jobs.models.offline import with_offline_model

            recipe = with_offline_model(name, recipe)
        if kwargs:  # -f "name(key=value)": a typo is one line, not a TypeError (nothing to check without arguments)
            check_recipe_arguments(function.removesuffix("_config"), recipe, kwargs)
        return recipe(**kwargs)

    factory.__module__, factory.__name__, factory.__qualname__ = module, function, function
    factory.__doc__ = f"Recipe {path} (a Megatron-Bridge ConfigContainer)."
    return factory


def register_nemo_factory(name: str, path: str, target: Callable = finetune) -> None:
    """Register the recipe at ``path`` (``module:function``) as ``--factory name`` of ``target``."""
    run.cli.factory(_recipe_factory(name, path), target=target, name=name)


class FinetuneRunContext(RunContext):
    """NeMo-Run's run context for ``finetune``: in-process, or through an executor; overrides through Bridge.

    ``cli_command`` builds the command with only the options that work here (NeMo-Run's generic command also offers
    ``--load``, ``--yaml``, ``--repl``, ... and gives ``-y`` to both ``--yaml`` and ``--yes``). ``cli_execute``
    receives the remaining arguments: ``executor=NAME`` and ``executor.KEY=VALUE`` pick and configure a NeMo-Run
    executor (factories registered for this context: each ``jobs.executors.kinds.EXECUTORS`` entry's, or any
    registered under NeMo-Run's ``Executor`` types); the rest are Bridge overrides. Without an executor it calls the
    entrypoint function itself; with one, ``jobs.executors.task.launch_finetune`` runs a ``run.Partial`` of it.
    """

    config_file: Optional[str] = None  # noqa: UP045
    verbose: bool = False

    @classmethod
    def cli_command(
        cls,
        parent: typer.Typer,
        name: str,
        fn: Callable,
        default_factory: Optional[Callable] = None,  # noqa: UP045
        command_kwargs: Optional[dict[str, Any]] = None,  # noqa: UP045
        **_: Any,
    ) -> Callable:
        """Register ``name`` on ``parent`` with the options of ``finetune``; the rest of the line are overrides."""

        @parent.command(
            name,
            context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
            **(command_kwargs or {}),
        )
        def command(
            factory: Optional[list[str]] = typer.Option(  # noqa: UP045, B008  (a list: a repeated -f is refused)
                None, "--factory", "-f", help="Recipe name or module:function"
            ),
            config_file: Optional[list[str]] = typer.Option(  # noqa: UP045, B008
                None, "--config-file", "-c", help="YAML file of config fields, merged before the overrides"
            ),
            dryrun: bool = typer.Option(False, "--dryrun", help="Print what would run; touch no GPU"),
            to_yaml: Optional[str] = typer.Option(  # noqa: UP045
                None, "--to-yaml", help="Write the resolved config as YAML ('-': standard output) and stop"
            ),
            skip_confirmation: bool = typer.Option(False, "--yes", "-y", help="Skip the confirmation"),
            detach: bool = typer.Option(False, "--detach", help="With executor=slurm: submit and return"),
            verbose: bool = typer.Option(False, "--verbose", "-v", help="Show third-party warnings, full tracebacks"),
            ctx: typer.Context = typer.Context,
        ) -> None:
            quiet_third_party(verbose)
            for option, given in (("--factory/-f", factory), ("--config-file/-c", config_file)):
                if given and len(given) > 1:
                    print(f"Error: {option} is given more than once ({given!r}): expected it once.", file=sys.stderr)
                    raise typer.Exit(code=2)
            self = cls(
                name=name,
                factory=factory[0] if factory else default_factory,
                dryrun=dryrun,
                skip_confirmation=skip_confirmation,
                to_yaml=to_yaml,
                detach=detach,
            )
            self.config_file = config_file[0] if config_file else None
            self.verbose = verbose
            stop_on_sigterm()
            if verbose:  # full tracebacks
                try:
                    self.cli_execute(fn, ctx.args)
                finally:
                    end_sigterm_stop()
                return
            execute = rank_zero_says_it()(lambda: self.cli_execute(fn, ctx.args))  # under torchrun: said once
            status = run_command(execute, prefix="Error")  # cli.exits: 2, 1, 130, 143
            if status:
                raise typer.Exit(code=status)

        return command

    def cli_execute(self, fn: Callable, args: list[str], entrypoint_type: str = "task") -> None:
        if not self.factory:
            raise RunContextError(f"--factory is required; available: {', '.join(registered_factories())}.")
        executor_name, executor_settings, overrides = split_executor_arguments(args)
        try:
            check_to_yaml(self.to_yaml)
            if executor_name is not None and self.to_yaml is None:
                executor = self._executor(executor_name, executor_settings)
                launch_finetune(
                    fn,
                    lambda: _resolve_factory(self.factory),
                    self.factory,
                    overrides,
                    executor,
                    config_file=self.config_file,
                    dryrun=self.dryrun,
                    detach=self.detach,
                    confirm=self._confirm,
                )
                return
            fn(
                factory=self.factory,
                overrides=overrides,
                config_file=self.config_file,
                dryrun=self.dryrun,
                to_yaml=self.to_yaml,
                confirm=self._confirm,
            )
        except (FinetuneError, GPUUnavailableError, ValueError) as error:
            raise RunContextError(str(error)) from error

    def _executor(self, name: str, settings: list[str]) -> Any:
        """``executor=name`` resolved through NeMo-Run's factory registry, then ``executor.KEY=VALUE`` applied."""
        from nemo_run.cli.cli_parser import parse_factory
        from nemo_run.core.execution.base import Executor

        try:
            config = parse_factory(type(self), "executor", Executor, name)
        except ValueError:
            raise FinetuneError(
                f"executor={name!r} is not a known executor; available: {', '.join(registered_executors())} "
                "(or an executor factory registered with NeMo-Run)."
            ) from None
        if isinstance(config, Executor):
            config = config.to_config()
        if self.verbose:  # the task's processes show third-party warnings too
            settings = [f"env_vars.{VERBOSE_ENV}=1", *settings]
        return build_executor(config, name, settings)

    def _confirm(self) -> bool:
        """NeMo-Run's ``Continue?`` (skipped with ``-y`` or under torchrun); without a terminal, ask for ``-y``."""
        if not (self.skip_confirmation or _is_torchrun() or sys.stdin.isatty()):
            raise RunContextError(f"`{self.name}` asks for confirmation; pass -y (--yes) to run without a terminal.")
        return self._should_continue(self.skip_confirmation)


def split_executor_arguments(args: list[str]) -> tuple[Optional[str], list[str], list[str]]:  # noqa: UP045
    """``(executor name, its KEY=VALUE settings, the Bridge overrides)`` from the trailing arguments.

    ``executor.KEY=VALUE`` without ``executor=NAME``, and NeMo-Run's ``plugins=``, are errors naming the argument.
    """
    name, settings, overrides = None, [], []
    for arg in args:
        if arg.startswith("executor="):
            name = arg.split("=", 1)[1]
        elif arg.startswith("executor."):
            settings.append(arg[len("executor.") :])
        elif arg.startswith(("plugins=", "plugins.")):
            raise RunContextError(f"{arg!r}: NeMo-Run plugins are not supported by `finetune`; use executor.KEY=VALUE.")
        else:
            overrides.append(arg)
    if settings and name is None:
        raise RunContextError(
            f"'executor.{settings[0]}' needs an executor: add executor=NAME ({', '.join(registered_executors())})."
        )
    if name is not None and not name:
        raise RunContextError(f"executor= needs a name: {', '.join(registered_executors())}.")
    return name, settings, overrides


def registered_executors() -> list[str]:
    """The ``executor=`` names registered for ``finetune``'s run context (the plugin's and any added elsewhere)."""
    import catalogue
    from nemo_run.config import get_type_namespace

    namespace = f"{get_type_namespace(FinetuneRunContext)}.executor"
    return sorted(key[-1] for key in catalogue._get_all((namespace,)))


class FinetuneEntrypoint(Entrypoint):
    """``finetune``'s help: its factories and the override syntax (no executors: the command runs in-process)."""

    def help(self, console: Any = None, with_docs: bool = True) -> None:
        from nemo_run.help import help_for_type
        from rich.console import Console

        console = console or Console()
        help_for_type(self.fn, console, with_docs=with_docs, title="Factories, run with --factory")
        console.print(
            "Overrides (Megatron-Bridge's Hydra syntax): key=value sets a field (model.noise.alpha=10), "
            "+key=value adds a key (+env_vars.NCCL_DEBUG=INFO), ~key deletes one."
        )
        console.print(
            f"Executors (NeMo-Run): executor=NAME executor.KEY=VALUE, NAME one of {', '.join(registered_executors())}"
            " (e.g. executor=local executor.ntasks_per_node=8); without one the run is in-process."
        )


_NEMO2_FINETUNE = nemo2_llm_finetune()
run.cli.entrypoint(
    namespace="noise" if _NEMO2_FINETUNE is not None else "llm",
    run_ctx_cls=FinetuneRunContext,
    entrypoint_cls=FinetuneEntrypoint,
)(finetune)
for _name, _kind in EXECUTORS.items():  # one NeMo-Run factory per table entry
    run.cli.factory(_kind.factory, target=FinetuneRunContext, target_arg="executor", name=_name)
for _name, _recipe in RECIPES.items():
    register_nemo_factory(_name, _recipe.path)
    if _NEMO2_FINETUNE is not None:
        run.cli.factory(nemo2_factory(finetune, _name), target=_NEMO2_FINETUNE, name=_name)
