"""``python -m nemo_noise_plugin``: the main job on the embedded default."""

import sys

from nemo_noise_plugin.demo import main

sys.exit(main())
