"""``python -m nemo_noise_plugin.privacy ledger CONFIG.yaml --sequence-length L [--epochs E] [key=value ...]``.

Prints the privacy ledger of a noise preset (``configs/noise/*.yaml``); ``key=value`` pairs override its fields,
the values read as YAML (``epsilon=4``, ``clip_norm=null``). ``nemo noise ledger`` prints the same table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

COMMANDS = ("ledger",)


def build_parser() -> argparse.ArgumentParser:
    """The ``ledger`` command's parser (options and ``key=value`` overrides may come in any order)."""
    parser = argparse.ArgumentParser(
        prog="python -m nemo_noise_plugin.privacy ledger", description="Print the privacy ledger of a noise config."
    )
    parser.add_argument("config", help="noise config YAML, e.g. configs/noise/dp_gaussian_mechanism.yaml")
    parser.add_argument("--sequence-length", type=int, required=True, help="tokens per sequence, L")
    parser.add_argument("--epochs", type=int, default=1, help="passes over each sequence, E (default 1)")
    parser.add_argument("--delta", type=float, default=None, help="per-sequence delta (default: the config's delta)")
    parser.add_argument("--hidden-size", type=int, default=None, help="hidden size d, for the expected noise norm")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="NoiseConfig field overrides")
    return parser


def parse_overrides(pairs: Sequence[str]) -> dict[str, object]:
    """``["epsilon=4", "clip_norm=null"]`` -> ``{"epsilon": 4, "clip_norm": None}``, fields checked by name."""
    import yaml

    from nemo_noise_plugin.noise.config import NoiseConfig

    allowed = [field.name for field in dataclasses.fields(NoiseConfig)]
    overrides: dict[str, object] = {}
    for pair in pairs:
        key, separator, value = pair.partition("=")
        if not separator or not key:
            raise ValueError(f"override {pair!r} is invalid: expected key=value, e.g. epsilon=4.")
        if key not in allowed:
            raise ValueError(f"override {pair!r}: unknown NoiseConfig field {key!r}; allowed: {', '.join(allowed)}.")
        overrides[key] = yaml.safe_load(value)
    return overrides


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m nemo_noise_plugin.privacy {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    parser = build_parser()
    args = parser.parse_intermixed_args(argv[1:])
    from nemo_noise_plugin.noise.config import load_noise_config
    from nemo_noise_plugin.privacy.ledger import format_ledger, privacy_ledger

    try:
        config = load_noise_config(args.config, **parse_overrides(args.overrides))
        ledger = privacy_ledger(
            config,
            sequence_length=args.sequence_length,
            epochs=args.epochs,
            delta=args.delta,
            hidden_size=args.hidden_size,
        )
    except (OSError, ValueError) as error:
        parser.error(str(error))
    print(format_ledger(ledger))
    return 0


if __name__ == "__main__":
    sys.exit(main())
