"""``python -m nemo_noise_plugin``: the main job on the embedded default.

A recipe on the embedded corpus (``tiny_noise_sft`` by default) trained with the plugin's forward step: Bridge's
training loop on a GPU, the CPU loop without one (which says so), a progress line per step, then a robustness
report of the model before and after training (``training.launch.launch_with_report``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nemo_noise_plugin.noise.config import MECHANISMS, SCALINGS, NoiseConfig, load_noise_config
from nemo_noise_plugin.recipes import RECIPES

__all__ = ["build_noise_config", "main", "parse_args"]

MAIN_JOB_RECIPES = tuple(name for name, recipe in RECIPES.items() if recipe.embedded_corpus)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The main job's options, checked (an invalid value exits with status 2 and one line naming it)."""
    parser = argparse.ArgumentParser(prog="python -m nemo_noise_plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=MAIN_JOB_RECIPES, default="tiny_noise_sft", help="default tiny_noise_sft")
    parser.add_argument("--steps", type=int, default=30, help="training iterations (default 30)")
    parser.add_argument(
        "--stop-after",
        type=int,
        help="GPU only: save a checkpoint and stop at this iteration, as an interrupted run would; running the same "
        "command without it resumes there from the checkpoint in --output-dir",
    )
    parser.add_argument("--output-dir", default="outputs/main_job", help="report, plot and data (default %(default)s)")
    parser.add_argument("--noise-config", help="a noise preset name (e.g. gaussian) or a YAML of NoiseConfig fields")
    parser.add_argument("--mechanism", choices=MECHANISMS, help="overrides the config (default uniform)")
    parser.add_argument("--alpha", type=float, help="NEFTune alpha of uniform noise (default 10)")
    parser.add_argument("--sigma", type=float, help="gaussian noise multiplier")
    parser.add_argument("--scaling", choices=SCALINGS, help="overrides the config (default true_length)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} is invalid: expected an integer >= 1.")
    if args.stop_after is not None and not 1 <= args.stop_after < args.steps:
        parser.error(f"--stop-after={args.stop_after} is invalid: expected an integer in [1, --steps={args.steps}).")
    if args.lr <= 0:
        parser.error(f"--lr={args.lr} is invalid: expected a number > 0.")
    return args


def build_noise_config(args: argparse.Namespace) -> NoiseConfig:
    """The noise settings: the embedded default (NEFTune alpha 10) or a preset, then the flags given."""
    flags = {name: getattr(args, name) for name in ("mechanism", "alpha", "sigma", "scaling")}
    overrides = {name: value for name, value in flags.items() if value is not None}
    overrides["seed"] = args.seed
    if args.noise_config:
        return load_noise_config(args.noise_config, **overrides)
    return NoiseConfig(**{"alpha": 10.0, **overrides})


def main(argv: Sequence[str] | None = None) -> int:
    """Run the main job; returns the exit status (2 for invalid options)."""
    args = parse_args(argv)
    try:
        noise = build_noise_config(args)
    except OSError as error:
        print(f"error: --noise-config {args.noise_config!r} cannot be read: {error.strerror or error}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    from nemo_noise_plugin.recipes import recipe_function
    from nemo_noise_plugin.training.launch import cuda_available, launch_with_report

    if args.stop_after is not None and not cuda_available():
        print(
            "error: --stop-after needs Bridge's training loop (a GPU); the CPU loop writes no checkpoint.",
            file=sys.stderr,
        )
        return 2
    recipe = recipe_function(RECIPES[args.recipe].path)
    config = recipe(dir=args.output_dir, train_iters=args.steps, lr=args.lr, noise=noise)
    config.train.exit_interval = args.stop_after
    config.rng.seed = args.seed
    launch_with_report(config, output_dir=args.output_dir, label=f"recipe {args.recipe}")
    return 0
