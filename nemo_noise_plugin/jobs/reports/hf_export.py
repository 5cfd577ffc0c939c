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

__all__ = ["DECISIVE_MARGIN", "export_hf", "hf_generate", "hf_logit_agreement"]


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


DECISIVE_MARGIN = 0.5
"""Logits by which Megatron's top token must lead its second for a position to count as decisive: four bf16 steps at
the logit magnitudes of a trained LM (16-32, where one step is 0.125). Below it, two correct bf16 models may rank the
top two either way: on SmolLM2 in bf16 (CPU), every argmax disagreement between Megatron and its HF export was at a
margin of at most 0.375, and agreement above 0.5 was 1.0 on four batches."""


def hf_logit_agreement(model: nn.Module, folder: str, batches: Sequence[dict[str, Any]]) -> dict[str, float]:
    """How closely the HF folder, reloaded with transformers, reproduces ``model``'s logits on ``batches``.

    The HF model runs in the dtype of ``model``'s parameters (bf16 on a GPU: both sides then round alike) on the same
    device; compared at every position of every row (both causal, so right padding changes no earlier position).
    Returns the largest and the mean absolute logit difference, the fraction of positions whose argmax agrees, and
    that fraction over the decisive positions alone (``DECISIVE_MARGIN``) with their share of all positions: a wrong
    export disagrees at decisive positions, bf16 rounding only at near-ties.
    """
    import transformers

    parameter = next(model.parameters())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=parameter.dtype)
    hf_model = hf_model.to(parameter.device).eval()
    largest = total = agree = count = decisive = decisive_agree = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in batches:
            ours = model(batch["tokens"], batch["position_ids"], batch["attention_mask"]).float()
            theirs = hf_model(input_ids=batch["tokens"]).logits.float()
            difference = (ours - theirs).abs()
            largest = max(largest, float(difference.max()))
            total += float(difference.mean(-1).sum())
            same = ours.argmax(-1) == theirs.argmax(-1)
            top_two = ours.topk(2, dim=-1).values
            clear = top_two[..., 0] - top_two[..., 1] > DECISIVE_MARGIN
            agree += float(same.sum())
            count += ours.shape[0] * ours.shape[1]
            decisive += float(clear.sum())
            decisive_agree += float((same & clear).sum())
    model.train(was_training)
    del hf_model
    return {
        "max_abs_logit_difference": largest,
        "mean_abs_logit_difference": total / count,
        "argmax_agreement": agree / count,
        "decisive_argmax_agreement": decisive_agree / decisive if decisive else 1.0,
        "decisive_fraction": decisive / count,
        "dtype": str(parameter.dtype).removeprefix("torch."),
    }
