"""``python -m nemo_noise_plugin.cli.finetune``: ``nemo llm finetune`` for users who launch with torchrun.

    python -m nemo_noise_plugin.cli.finetune --factory tiny_noise_distillation model.noise.alpha=10 --dryrun
    python -m nemo_noise_plugin.cli.finetune -f tiny_noise_sft --config-file recipes/tiny_neftune.yaml --to-yaml -
    torchrun --nproc-per-node 8 -m nemo_noise_plugin.cli.finetune --factory llama31_8b_noise_sft train.train_iters=100

A thin parser over ``jobs.launch.finetune.run_finetune``. Bridge's own output (its configuration summary, its line per
step) goes to ``bridge.log`` in the run folder (``bridge.rank<N>.log`` for rank N), and with ``-v`` here too. Errors
end as every front door's do (``cli.exits``): one line, status 2 for a usage error, 1 for a failed run, 130/143 for
an interrupt. ``--factory`` takes recipe arguments too, as ``nemo`` does: ``-f "tiny_noise_sft(seq_length=64)"``.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from nemo_noise_plugin.cli.console import quiet_third_party
from nemo_noise_plugin.cli.exits import UsageParser, rank_zero_says_it, run_command, stop_on_sigterm
from nemo_noise_plugin.cli.gpu_free import hide_gpus
from nemo_noise_plugin.jobs.launch.bridge_console import bridge_log
from nemo_noise_plugin.jobs.launch.finetune import (
    FinetuneError,
    check_recipe_arguments,
    load_recipe,
    run_finetune,
)
from nemo_noise_plugin.jobs.reports.artifacts import check_output_dir
from nemo_noise_plugin.recipes import RECIPES

__all__ = ["check_to_yaml", "main", "recipe_with_arguments"]

_CALL = re.compile(r"^\s*([\w.:]+)\s*\((.*)\)\s*$", re.DOTALL)


def check_to_yaml(to_yaml: str | None) -> None:
    """``--to-yaml PATH``: its folder created if missing and checked writable, before the config is built;
    ``ValueError`` naming the option otherwise (``-``, standard output, needs nothing)."""
    if to_yaml is None or to_yaml == "-":
        return
    if os.path.isdir(to_yaml):
        raise ValueError(f"--to-yaml={to_yaml!r} is invalid: it is a folder; expected a file path, e.g. run.yaml.")
    check_output_dir(os.path.dirname(to_yaml) or ".", f"--to-yaml={to_yaml!r}: its folder")


def recipe_with_arguments(factory: str) -> tuple[str, Callable[[], Any]] | None:
    """``name(key=value, ...)`` as a recipe call: ``(name, function)``, the arguments checked; None for a plain name."""
    match = _CALL.match(factory)
    if match is None:
        return None
    name, text = match.groups()
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        if call.args:
            raise ValueError("positional")
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    except (SyntaxError, ValueError):
        raise FinetuneError(
            f"--factory {factory!r} is invalid: expected name or name(key=value, ...) with Python literals, "
            "e.g. tiny_noise_sft(seq_length=64)."
        ) from None
    recipe = load_recipe(name)
    check_recipe_arguments(name, recipe, arguments)
    return name, lambda: recipe(**arguments)


class _Once(argparse.Action):
    """An option given at most once: a repeated ``-f``/``--config-file`` is an error, not the last one silently."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{'/'.join(self.option_strings)} is given more than once ({values!r}): expected it once.")
        setattr(namespace, self.dest, values)


def _parser() -> UsageParser:
    parser = UsageParser(
        prog="python -m nemo_noise_plugin.cli.finetune",
        description="Noise fine-tuning / noisy-student distillation on Megatron-Bridge's training loop.",
        epilog="Factories: " + ", ".join(sorted(RECIPES)) + ". Under torchrun every rank runs this command.",
    )
    parser.add_argument(
        "--factory",
        "-f",
        required=True,
        action=_Once,
        help="recipe name, or module:function returning a ConfigContainer",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, +key=value, ~key")
    parser.add_argument(
        "--config-file", "-c", action=_Once, help="YAML file of config fields, merged before the overrides"
    )
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
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also show third-party warnings, INFO logs and Bridge's output (always in <run dir>/bridge.log)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Returns the exit status (``cli.exits``: 2 usage error, 1 failed run or no GPU, 130/143 interrupted)."""
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.dryrun or args.to_yaml is not None:
        hide_gpus()
    quiet_third_party(args.verbose)
    stop_on_sigterm()

    @rank_zero_says_it()
    def run() -> None:
        check_to_yaml(args.to_yaml)
        called = recipe_with_arguments(args.factory)
        name, recipe = called if called is not None else (args.factory, args.factory)
        with bridge_log(args.verbose):  # Bridge's own output in the run folder's bridge.log (and here with -v)
            run_finetune(
                recipe,
                args.overrides,
                factory=name,
                config_file=args.config_file,
                dryrun=args.dryrun,
                to_yaml=args.to_yaml,
            )

    return run_command(run, prefix=f"{parser.prog}: error")


if __name__ == "__main__":  # Bridge's checkpoint-save workers re-import the launching module
    sys.exit(main())
