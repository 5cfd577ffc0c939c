"""The real pretrained SmolLM2-135M-Instruct as a session fixture (converted once into the model cache).

Use it from a test module with ``from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401``. Without the
package index and without a cached folder the tests that need it are skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_noise_plugin.pretrained import PretrainedModelUnavailable, ensure_smollm2_hf

SLOW_MARKER = "slow: needs the real SmolLM2-135M model (converted once, about 1.5 min; cached after)"
"""The ``markers`` line for pyproject.toml; ``register_slow_marker`` adds it when it is not registered yet."""


def register_slow_marker(config: pytest.Config) -> None:
    """Register the ``slow`` marker unless pyproject.toml (or another plugin) already does."""
    registered = {line.split(":", 1)[0].split("(", 1)[0].strip() for line in config.getini("markers")}
    if "slow" not in registered:
        config.addinivalue_line("markers", SLOW_MARKER)


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> Path:
    """The converted Hugging Face folder of SmolLM2-135M-Instruct; the test is skipped when it cannot be made."""
    try:
        return ensure_smollm2_hf()
    except PretrainedModelUnavailable as error:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {error}")
