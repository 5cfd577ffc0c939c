"""``python -m nemo_noise_plugin``: the main job on the embedded default (``cli.main_job``)."""

import sys

from nemo_noise_plugin.cli.main_job import main

if __name__ == "__main__":  # spawned worker processes re-import the main module
    sys.exit(main())
