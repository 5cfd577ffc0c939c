"""The published ``config.json`` of the models behind the Llama/Qwen recipes, as an offline Hugging Face hub cache.

Bridge's SFT recipes for Llama 3.2 1B, Llama 3.1 8B and Qwen3 8B read the model's HF config from the hub when they
are called (``AutoBridge.from_hf_pretrained(<repo id>)``). Written into a hub cache under ``HF_HOME`` and read with
``HF_HUB_OFFLINE=1``, these configs let the recipes run on this offline machine up to the point where they need
their weights: config build, provider conversion, overrides, YAML round trip. The values are those of the models'
published ``config.json`` files (architecture fields only; no weights or tokenizer are involved).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["HUB_CONFIGS", "write_offline_hub"]

_LLAMA3_ROPE = dict(
    high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192, rope_type="llama3"
)
_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=128000,
    eos_token_id=128001,
    torch_dtype="bfloat16",
)
HUB_CONFIGS: dict[str, dict] = {
    "meta-llama/Llama-3.2-1B": dict(
        _LLAMA,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        head_dim=64,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        tie_word_embeddings=True,
    ),
    "meta-llama/Meta-Llama-3.1-8B": dict(
        _LLAMA,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        head_dim=128,
        rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-8B": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    ),
}
"""Hub repo id -> the architecture fields of its published ``config.json``."""

PINNED_REVISIONS = {"Qwen/Qwen3-8B": "b968826d9c46dd6066d109eabc6255188de91218"}
"""Revisions Bridge's recipes ask for (``megatron/bridge/recipes/qwen/h100/qwen3.py``); the others read ``main``."""


def write_offline_hub(hf_home: Path) -> Path:
    """Write ``HUB_CONFIGS`` as a hub cache under ``hf_home`` (use it with ``HF_HOME=hf_home HF_HUB_OFFLINE=1``)."""
    for repo, config in HUB_CONFIGS.items():
        revision = PINNED_REVISIONS.get(repo, "0" * 40)
        folder = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
        snapshot = folder / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=2))
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(revision)
    return hf_home
