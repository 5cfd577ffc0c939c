"""The trained model exported to Hugging Face, reloaded with transformers, checked against Megatron and asked.

``export_hf`` writes a Megatron model chunk as an HF folder with Bridge's ``AutoBridge.save_hf_pretrained``;
``hf_logit_agreement`` says how closely transformers' reload reproduces Megatron's logits; ``hf_generate`` answers
chats with it (greedy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = ["export_hf", "hf_generate", "hf_logit_agreement"]


def export_hf(model: nn.Module, hf_source: str, output_dir: str) -> str:
    """Write ``model`` (a Megatron chunk of the ``hf_source`` architecture) as an HF folder with Bridge's exporter."""
    auto_bridge = import_bridge("megatron.bridge").AutoBridge
    bridge = auto_bridge.from_hf_pretrained(hf_source)
    bridge.save_hf_pretrained([model], output_dir)
    return output_dir


def hf_generate(folder: str, questions: Sequence[list[dict[str, str]]], max_new_tokens: int = 64) -> list[str]:
    """Reload an HF folder with transformers and answer each chat (greedy), returning the decoded replies."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    replies = []
    for messages in questions:
        inputs = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        replies.append(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    return replies


def hf_logit_agreement(model: nn.Module, folder: str, batches: Sequence[dict[str, Any]]) -> dict[str, float]:
    """How closely the HF folder, reloaded with transformers, reproduces ``model``'s logits on ``batches``.

    The HF model runs in the dtype of ``model``'s parameters (bf16 on a GPU: both sides then round alike) on the same
    device; compared at every position of every row (both causal, so right padding changes no earlier position).
    Returns the largest and the mean absolute logit difference and the fraction of positions whose argmax agrees.
    """
    import transformers

    parameter = next(model.parameters())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=parameter.dtype)
    hf_model = hf_model.to(parameter.device).eval()
    largest = total = agree = count = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in batches:
            ours = model(batch["tokens"], batch["position_ids"], batch["attention_mask"]).float()
            theirs = hf_model(input_ids=batch["tokens"]).logits.float()
            difference = (ours - theirs).abs()
            largest = max(largest, float(difference.max()))
            total += float(difference.mean(-1).sum())
            agree += float((ours.argmax(-1) == theirs.argmax(-1)).sum())
            count += ours.shape[0] * ours.shape[1]
    model.train(was_training)
    del hf_model
    return {
        "max_abs_logit_difference": largest,
        "mean_abs_logit_difference": total / count,
        "argmax_agreement": agree / count,
        "dtype": str(parameter.dtype).removeprefix("torch."),
    }
