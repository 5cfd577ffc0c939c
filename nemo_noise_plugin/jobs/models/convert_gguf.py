"""Converting SmolLM2's GGUF into an ordinary Hugging Face folder: dequantised to float32, with its tokenizer.

``convert_gguf`` saves a folder (safetensors, config, tokenizer with its ChatML chat template) that
``AutoModelForCausalLM``, ``AutoTokenizer`` and Megatron-Bridge's ``AutoBridge`` read. It does not depend on one
transformers release: the weights are read and dequantised with ``gguf``, named by this module's Llama table, and
loaded strictly into ``AutoModelForCausalLM.from_config`` of a ``LlamaConfig`` read from the GGUF metadata; only the
tokenizer comes from transformers' GGUF support (``AutoTokenizer.from_pretrained(..., gguf_file=...)``, special
tokens then set from the metadata). It avoids ``from_pretrained(..., gguf_file=...)`` for the model, whose result
transformers 5.17 refuses to ``save_pretrained`` ("The model is quantized with QuantizationMethod.GGUF and is not
serializable"). What the conversion uses of transformers is the same in the releases in ``TRANSFORMERS_TESTED``
(5.12.1 and 5.17.0 write the same bytes but for the ``transformers_version`` they record), so there is one code
path; a release that breaks it is named by ``conversion_failure``. The conversion needs the pure-Python package
``gguf`` (the GPU image lacks it: bring its wheel file). The weights are Q4_1 dequantised: right for pipelines,
conversions and robustness or privacy measurements, not for quoting the published model's quality.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path

from nemo_noise_plugin.jobs.models.fetch_wheel import fix_hint, require_module

__all__ = [
    "GGUF_PIN",
    "TRANSFORMERS_PIN",
    "TRANSFORMERS_TESTED",
    "conversion_failure",
    "convert_gguf",
    "installed_version",
]

TRANSFORMERS_TESTED = ("5.12.1", "5.17.0")
"""transformers releases the conversion is tested with: requirements/ci.txt and requirements/transformers-next.txt."""
GGUF_PIN = "gguf==0.19.0"
TRANSFORMERS_PIN = f"transformers=={TRANSFORMERS_TESTED[0]}"


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

    dequantize = require_module("gguf", GGUF_PIN, "it reads the GGUF file").dequantize
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


def convert_gguf(gguf_file: Path, destination: Path) -> None:
    """Dequantise the GGUF to float32 and save it, with its tokenizer, as a Hugging Face folder in ``destination``.

    The model is ``from_config`` of the metadata's ``LlamaConfig`` with the dequantised tensors loaded strictly (not
    ``from_pretrained(gguf_file=...)``, whose model transformers 5.17 will not save); the tokenizer is transformers'
    GGUF tokenizer with the special tokens the metadata declares.
    """
    import torch

    transformers = require_module("transformers", TRANSFORMERS_PIN, "it builds and saves the Hugging Face model")
    reader = require_module("gguf", GGUF_PIN, "it reads the GGUF file").GGUFReader(gguf_file)
    config = _llama_config(transformers, reader, torch.float32)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(_llama_state_dict(reader, config), strict=True)
    if config.tie_word_embeddings and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise ValueError("the model's lm_head is not tied to its embedding although the config says so")
    model.save_pretrained(destination, max_shard_size="4GB")  # one model.safetensors, as readers of the folder expect
    del model
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    _set_special_tokens(tokenizer, _gguf_special_token_ids(reader))
    tokenizer.init_kwargs.pop("local_files_only", None)  # HF_HUB_OFFLINE's value at conversion, not the folder's
    tokenizer.save_pretrained(destination)


def _set_special_tokens(tokenizer, token_ids: dict[str, int]) -> None:
    """Give the tokenizer the GGUF's special tokens (transformers 5.12 makes EOS ``<|im_start|>`` and no PAD)."""
    for attribute, token_id in token_ids.items():
        setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))
        if getattr(tokenizer, f"{attribute}_id") != token_id:
            raise ValueError(f"could not set the tokenizer's {attribute} to id {token_id} from the GGUF metadata")


def conversion_failure(error: Exception, gguf_file: Path, destination: Path, cache: Path) -> str:
    """What to tell the caller when the conversion raised: the error, the installed and the tested transformers."""
    installed = installed_version("transformers")
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
        f"{fix_hint(cache)}"
    )


def installed_version(name: str) -> str:
    """The version of the imported package ``name`` (what runs, even ahead of site-packages), else its metadata's."""
    module = sys.modules.get(name)
    if module is not None and isinstance(getattr(module, "__version__", None), str):
        return module.__version__
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
