"""``python -m nemo_noise_plugin``: the main job on the embedded default.

A recipe on the embedded corpus (``tiny_noise_sft`` by default) trained with the plugin's forward step: Bridge's
training loop on a GPU, the CPU loop without one (which says so), a progress line per step, then a robustness
report of the model before and after training (``jobs.main_job.launch_with_report``). On a GPU, Bridge's own
output (its configuration summary, its line per step) goes to ``<output dir>/<recipe>/bridge.log``; ``-v`` shows
it here too.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from nemo_noise_plugin.cli.console import quiet_third_party
from nemo_noise_plugin.cli.exits import (
    EXIT_USAGE,
    UsageParser,
    run_command,
    stop_on_sigterm,
)
from nemo_noise_plugin.jobs.launch.bridge_console import bridge_log, run_folder
from nemo_noise_plugin.jobs.reports.artifacts import check_output_dir
from nemo_noise_plugin.noise.config import (
    LENGTH_SCALED_MECHANISMS,
    MAGNITUDE_FIELDS,
    MECHANISMS,
    SCALINGS,
    NoiseConfig,
    load_noise_config,
)
from nemo_noise_plugin.noise.families import NOISE_FAMILIES
from nemo_noise_plugin.recipes import RECIPES
from nemo_noise_plugin.validation import SettingError
from nemo_noise_plugin.yaml_files import YAMLInputError

__all__ = ["build_noise_config", "main", "parse_args"]

MAIN_JOB_RECIPES = tuple(name for name, recipe in RECIPES.items() if recipe.embedded_corpus)


_MAGNITUDE_FLAGS = {family.cli_flag: family for family in NOISE_FAMILIES.values() if family.cli_flag}
"""A flag per family that names one (``NoiseFamily.cli_flag``): ``--alpha``, ``--sigma``, ..."""
MECHANISM_FLAGS: dict[str, tuple[str, ...]] = {
    **{flag: (family.name,) for flag, family in _MAGNITUDE_FLAGS.items()},
    "scaling": LENGTH_SCALED_MECHANISMS,
}
"""The main job's noise flags and the mechanisms that use them."""
DEFAULT_STEPS = 30
STEPS_BY_RECIPE = {"tiny_noise_sft": 60}
"""``--steps`` when not given. The default recipe trains 60 steps (with its control: 1 min 21 s on a 2-core CPU, load
not recorded; 18 min 30 s at load 20-28: docs/cli.md): at 30 its report measured no overall difference from the
control, at 60 a measured trade-off (lower KL, lower loss under heavy noise, higher clean loss); the runs are in
docs/cli.md ("Does noise training beat the control?")."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The main job's options, checked (an invalid value exits with status 2 and one line naming it)."""
    parser = UsageParser(prog="python -m nemo_noise_plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=MAIN_JOB_RECIPES, default="tiny_noise_sft", help="default tiny_noise_sft")
    parser.add_argument(
        "--steps",
        type=int,
        help=f"training iterations (default {STEPS_BY_RECIPE['tiny_noise_sft']} for tiny_noise_sft, {DEFAULT_STEPS} "
        "for the other recipes)",
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        help="save a checkpoint and stop at this iteration, as an interrupted run would; running the same command "
        "without it resumes there from the checkpoint in --output-dir",
    )
    parser.add_argument(
        "--clean-pretrain-steps",
        type=int,
        help="clean steps (noise and KD off) before the noisy run, which starts from them; default: the recipe's "
        "(100 for tiny_noise_distillation, whose teacher is then a trained model; else 0)",
    )
    parser.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="skip the control run (the same steps without noise) that the report compares against",
    )
    parser.add_argument("--output-dir", default="outputs/main_job", help="report, plot and data (default %(default)s)")
    parser.add_argument(
        "--keep-last",
        type=int,
        metavar="N",
        help="after the report, keep only the newest N report folders and checkpoints of the recipe in --output-dir "
        "(never the ones reports/latest and the checkpoint tracker name); default: keep all",
    )
    parser.add_argument(
        "--held-out",
        type=int,
        metavar="N",
        help="instruction recipes: score the task report on the first N examples of each held-out split (default all)",
    )
    parser.add_argument(
        "--chats",
        type=int,
        metavar="N",
        help="instruction recipes: held-out questions the exported model answers in transformers (default 4)",
    )
    parser.add_argument("--noise-config", help="a noise preset name (e.g. gaussian) or a YAML of NoiseConfig fields")
    parser.add_argument("--mechanism", choices=MECHANISMS, help="overrides the config (default uniform)")
    for flag, family in _MAGNITUDE_FLAGS.items():
        parser.add_argument(_option(flag), dest=flag, type=float, help=family.cli_help)
    parser.add_argument(
        "--scaling",
        choices=SCALINGS,
        help="overrides the config (default true_length); embedding_distance needs a --noise-config that sets "
        "embedding_distance",
    )
    parser.add_argument("--lr", type=float, help="peak learning rate (1e-3 for tiny recipes, else the recipe's)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also show third-party warnings, INFO logs and Bridge's output (always in <run dir>/bridge.log)",
    )
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = STEPS_BY_RECIPE.get(args.recipe, DEFAULT_STEPS)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} is invalid: expected an integer >= 1.")
    if args.stop_after is not None and not 1 <= args.stop_after < args.steps:
        parser.error(f"--stop-after={args.stop_after} is invalid: expected an integer in [1, --steps={args.steps}).")
    if args.clean_pretrain_steps is not None and args.clean_pretrain_steps < 0:
        parser.error(f"--clean-pretrain-steps={args.clean_pretrain_steps} is invalid: expected an integer >= 0.")
    if args.clean_pretrain_steps == 0 and RECIPES[args.recipe].clean_pretrain_steps > 0:
        parser.error(
            f"--clean-pretrain-steps=0 is invalid with --recipe {args.recipe}: expected an integer >= 1 (default "
            f"{RECIPES[args.recipe].clean_pretrain_steps}), since this recipe trains from scratch and its distillation "
            "teacher would be the randomly initialised model."
        )
    for name in ("held_out", "chats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: expected an integer >= 1.")
    if args.lr is not None and (not math.isfinite(args.lr) or args.lr <= 0):
        parser.error(f"--lr={args.lr} is invalid: expected a finite number > 0.")
    return args


def build_noise_config(args: argparse.Namespace) -> NoiseConfig:
    """The noise settings: the embedded default (NEFTune alpha 10) or a preset, then the flags given.

    A flag the resulting mechanism does not use (``--sigma`` with NEFTune noise) is an error, not ignored.
    """
    flags = {name: getattr(args, name) for name in ("mechanism", *MECHANISM_FLAGS)}
    overrides = {name: value for name, value in flags.items() if value is not None}
    overrides["seed"] = args.seed
    levels = {name: overrides.pop(name) for name in list(overrides) if name in _MAGNITUDE_FLAGS}  # once checked
    if args.noise_config:
        noise = load_noise_config(args.noise_config, **overrides)
    else:
        family = NOISE_FAMILIES[overrides.get("mechanism", NoiseConfig.mechanism)]
        default = {} if family.cli_default is None else {family.magnitude_field: family.cli_default}  # NEFTune alpha 10
        noise = NoiseConfig(**{**default, **overrides})
    for flag, mechanisms in MECHANISM_FLAGS.items():
        if flags[flag] is not None and noise.mechanism not in mechanisms:
            own = MAGNITUDE_FIELDS[noise.mechanism]
            raise ValueError(
                f"{_option(flag)}={flags[flag]} is not used by mechanism {noise.mechanism!r} (only by "
                f"{', '.join(mechanisms)}); {noise.mechanism} noise is set by its field {own!r}: use --noise-config "
                f"with {own}: <value>, or --mechanism {mechanisms[0]}."
            )
    noise = dataclasses.replace(noise, **levels) if levels else noise
    if noise.scaling == "embedding_distance" and noise.embedding_distance is None:  # no flag sets the distance
        raise SettingError(
            "--scaling" if args.scaling else f"--noise-config {args.noise_config} scaling",
            "embedding_distance",
            "a noise config that also sets embedding_distance, the table's median nearest-neighbour distance "
            "(--noise-config FILE.yaml with scaling: embedding_distance and embedding_distance: D; "
            "privacy.embedding_distance.calibrate_noise_to_embeddings measures D), or another --scaling",
        )
    return noise


def _option(field: str) -> str:
    """The command-line spelling of a ``NoiseConfig`` field: ``laplace_scale`` -> ``--laplace-scale``."""
    return "--" + field.replace("_", "-")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the main job; returns the exit status (``cli.exits``: 2 invalid options, 1 failed run, 130 interrupted,
    143 terminated)."""
    args = parse_args(argv)
    quiet_third_party(args.verbose)
    stop_on_sigterm()
    run_dir = Path(args.output_dir) / args.recipe
    try:
        noise = build_noise_config(args)
        check_output_dir(args.output_dir)
    except OSError as error:
        print(f"error: --noise-config {args.noise_config!r} cannot be read: {error.strerror or error}", file=sys.stderr)
        return EXIT_USAGE
    except YAMLInputError as error:  # names the file: empty, a repeated key, not a mapping, not YAML
        print(f"error: --noise-config {error}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE

    def run() -> int:
        with bridge_log(args.verbose), run_folder(run_dir):  # Bridge's own output: <run dir>/bridge.log
            return _run(args, noise)

    return run_command(run, interrupted=f"this run's report was not written (earlier reports in {run_dir} are kept); ")


def _run(args: argparse.Namespace, noise: NoiseConfig) -> int:
    from nemo_noise_plugin.jobs.main_job import launch_with_report
    from nemo_noise_plugin.jobs.models.offline import with_offline_model
    from nemo_noise_plugin.recipes import recipe_function

    recipe = with_offline_model(args.recipe, recipe_function(RECIPES[args.recipe].path))
    lr = args.lr if args.lr is not None else (1e-3 if args.recipe.startswith("tiny") else None)
    config = recipe(dir=args.output_dir, train_iters=args.steps, noise=noise, **({"lr": lr} if lr else {}))
    config.train.exit_interval = args.stop_after
    config.rng.seed = args.seed
    try:
        pretrain = args.clean_pretrain_steps
        launch_with_report(
            config,
            output_dir=str(Path(args.output_dir) / args.recipe),
            label=f"recipe {args.recipe}",
            control=args.control,
            clean_pretrain_steps=RECIPES[args.recipe].clean_pretrain_steps if pretrain is None else pretrain,
            recipe=args.recipe,
            keep_last=args.keep_last,
            reports=RECIPES[args.recipe].reports,
            task_options={
                key: value for key, value in (("held_out", args.held_out), ("samples", args.chats)) if value is not None
            },
        )
    except ValueError as error:  # the plugin's settings, re-validated before the model is built
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    return 0
