"""``python -m nemo_noise_plugin.cli.finetune``: ``nemo llm finetune`` for users who launch with torchrun.

    python -m nemo_noise_plugin.cli.finetune --factory tiny_noise_distillation model.noise.alpha=10 --dryrun
    python -m nemo_noise_plugin.cli.finetune -f tiny_noise_sft --config-file recipes/tiny_neftune.yaml --to-yaml -
    torchrun --nproc-per-node 8 -m nemo_noise_plugin.cli.finetune --factory llama31_8b_noise_sft train.train_iters=100

A thin parser over ``training.finetune.run_finetune``. Bridge's own output (its configuration summary, its line per
step) goes to ``bridge.log`` in the run folder (``bridge.rank<N>.log`` for rank N), and with ``-v`` here too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nemo_noise_plugin.cli.console import quiet_third_party
from nemo_noise_plugin.cli.gpu_free import hide_gpus
from nemo_noise_plugin.recipes import RECIPES
from nemo_noise_plugin.training.bridge_console import bridge_log
from nemo_noise_plugin.training.finetune import FinetuneError, run_finetune
from nemo_noise_plugin.training.launch import GPUUnavailableError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_noise_plugin.cli.finetune",
        description="Noise fine-tuning / noisy-student distillation on Megatron-Bridge's training loop.",
        epilog="Factories: " + ", ".join(sorted(RECIPES)) + ". Under torchrun every rank runs this command.",
    )
    parser.add_argument(
        "--factory", "-f", required=True, help="recipe name, or module:function returning a ConfigContainer"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, +key=value, ~key")
    parser.add_argument("--config-file", "-c", help="YAML file of config fields, merged before the overrides")
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
    """Returns the exit status (2 for usage errors, 1 for a missing GPU)."""
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.dryrun or args.to_yaml is not None:
        hide_gpus()
    quiet_third_party(args.verbose)
    try:
        with bridge_log(args.verbose):  # Bridge's own output in the run folder's bridge.log (and here with -v)
            run_finetune(
                args.factory, args.overrides, config_file=args.config_file, dryrun=args.dryrun, to_yaml=args.to_yaml
            )
    except FinetuneError as error:
        parser.error(str(error))
    except GPUUnavailableError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # Bridge's checkpoint-save workers re-import the launching module
    sys.exit(main())
