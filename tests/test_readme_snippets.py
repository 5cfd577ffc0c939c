"""The README's Python snippets run as written, on the CPU: every ```python block of README.md is executed here.

A snippet leaves some objects to the reader (``transformer_config``, ``spec``, ``built_gpt_model``, ``tokens``, ...):
the test runs it in a namespace holding real tiny ones, built with Megatron-Core's local layer spec as the other
tests build models. Two things a CPU cannot do are stood in for, and only those (see ``bridge_on_the_cpu``):
Bridge's ``pretrain`` needs CUDA, and ``meta-llama/Llama-3.2-1B`` is a gated download.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.support.models import build_tiny_gpt, causal_attention_mask, tiny_gpt_config

README = Path(__file__).resolve().parents[1] / "README.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
MODEL_SNIPPET, BRIDGE_SNIPPET = "NoisyGPTModel(", "pretrain("
"""What tells the two snippets apart: the model in Python, and the model through Megatron-Bridge."""
HF_ID = "meta-llama/Llama-3.2-1B"
CPU_TRAIN_ITERS = 2


def _snippets() -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in PYTHON_BLOCK.finditer(text)]


def _run(marker: str, namespace: dict) -> dict:
    """Execute the one README snippet containing ``marker`` in ``namespace`` (tracebacks name its README lines)."""
    matching = [(line, source) for line, source in _snippets() if marker in source]
    assert len(matching) == 1, f"{len(matching)} README snippets contain {marker!r}"
    line, source = matching[0]
    exec(compile("\n" * (line - 1) + source, str(README), "exec"), namespace)
    return namespace


def test_every_python_snippet_of_the_readme_is_run_by_a_test_here():
    snippets = [source for _, source in _snippets()]
    assert len(snippets) == 2
    assert [sum(marker in source for marker in (MODEL_SNIPPET, BRIDGE_SNIPPET)) for source in snippets] == [1, 1]


def test_the_model_snippet_builds_noises_and_computes_the_loss(megatron_cpu):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_noise_plugin import NoisyGPTModel

    torch.manual_seed(0)
    batch, seq = 2, 16
    tokens = torch.randint(0, 256, (batch, seq))
    loss_mask = torch.ones(batch, seq)
    loss_mask[1, 12:] = 0
    built_gpt_model = build_tiny_gpt()  # vocabulary 256
    namespace = _run(
        MODEL_SNIPPET,
        dict(
            transformer_config=tiny_gpt_config(),
            spec=get_gpt_layer_local_spec(),
            built_gpt_model=built_gpt_model,
            tokens=tokens,
            position_ids=torch.arange(seq).unsqueeze(0).expand(batch, -1),
            attention_mask=causal_attention_mask(seq),
            labels=torch.roll(tokens, -1, dims=1),
            loss_mask=loss_mask,
            padding_mask=loss_mask == 0,
        ),
    )
    model = namespace["model"]
    assert model is built_gpt_model and isinstance(model, NoisyGPTModel)  # make_noisy: in place
    assert (model.noise_config.mechanism, model.noise_config.sigma) == ("gaussian", 5.0)
    assert namespace["loss"].shape == (batch, seq) and torch.isfinite(namespace["loss"]).all()
    assert namespace["inputs"].padding_mask is namespace["padding_mask"]


@pytest.fixture
def bridge_on_the_cpu(megatron_cpu, monkeypatch, tmp_path):
    """Bridge's ``pretrain`` and ``AutoBridge.from_hf_pretrained``, as far as a CPU without a download runs them.

    ``pretrain`` (CUDA only) becomes: Bridge's own ``ConfigContainer.validate()`` (what ``pretrain`` runs first),
    then the plugin's CPU loop (``jobs.cpu.loop``: the recipe's provider, model, data pipeline, forward step and
    loss), shortened to ``CPU_TRAIN_ITERS`` iterations so that the snippet's runs take seconds. The hub id loads a
    tiny random Llama checkpoint saved here instead (same architecture, real AutoBridge conversion). Yields the
    what each ``pretrain`` call received (``config``, ``forward_step``) and how many steps it trained.
    """
    import transformers

    from nemo_noise_plugin.jobs.cpu.loop import run_cpu_loop
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    llama = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(llama).save_pretrained(tmp_path / "llama")
    auto_bridge = import_bridge("megatron.bridge.models.conversion.auto_bridge").AutoBridge
    from_hf_pretrained = auto_bridge.from_hf_pretrained

    def tiny_llama(path, *args, **kwargs):
        assert path == HF_ID
        return from_hf_pretrained(str(tmp_path / "llama"), *args, **kwargs)

    runs = []

    class StepCounter(import_bridge("megatron.bridge.training.callbacks").Callback):
        def on_train_step_end(self, context):
            runs[-1]["steps"] += 1

    def pretrain_on_the_cpu(config, forward_step_func, callbacks=None):
        assert callbacks is None
        runs.append(dict(config=config, forward_step=forward_step_func, steps=0))
        config.validate()
        config.train.train_iters = CPU_TRAIN_ITERS
        run_cpu_loop(config, forward_step_func, [StepCounter()])

    monkeypatch.setattr(auto_bridge, "from_hf_pretrained", tiny_llama)
    monkeypatch.setattr(import_bridge("megatron.bridge.training.pretrain"), "pretrain", pretrain_on_the_cpu)
    monkeypatch.chdir(tmp_path)  # the recipes' run folders: ./nemo_experiments
    yield runs


def test_the_bridge_snippet_trains_both_providers_and_converts_an_autobridge_provider(bridge_on_the_cpu):
    from nemo_noise_plugin.providers import NoisyDistillationProvider, NoisyGPTModelProvider
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step

    namespace = _run(BRIDGE_SNIPPET, {})
    sft, kd = bridge_on_the_cpu
    assert type(sft["config"].model) is NoisyGPTModelProvider and sft["config"].model.noise.alpha == 10.0
    assert sft["forward_step"] is noise_forward_step
    assert type(kd["config"].model) is NoisyDistillationProvider and kd["config"].model.kd.temperature == 2.0
    assert kd["forward_step"] is distillation_forward_step
    assert (sft["steps"], kd["steps"]) == (CPU_TRAIN_ITERS, CPU_TRAIN_ITERS)
    provider = namespace["provider"]
    assert type(provider) is NoisyDistillationProvider and provider.noise.alpha == 5.0
    assert len(provider._pre_wrap_hooks) == 1  # AutoBridge's HF weight loading, kept


def test_the_files_the_documented_commands_write_lie_in_git_ignored_folders():
    """Issue 36, finding 10: the README's ``--to-yaml run.yaml`` wrote into the clone (an untracked file in a fresh
    checkout). Every ``--to-yaml FILE`` in a README or docs command writes where git ignores it."""
    import subprocess

    root = README.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    pages = [README, *sorted((root / "docs").glob("*.md"))]
    written = sorted(
        {path for page in pages for path in re.findall(r"--to-yaml ([\w./-]+\.ya?ml)\b", page.read_text())}
    )
    assert "outputs/run.yaml" in written  # the README's own example
    ignored = subprocess.run(
        ["git", "-C", str(root), "check-ignore", "--no-index", *written], capture_output=True, text=True
    ).stdout.split()
    assert sorted(ignored) == written
