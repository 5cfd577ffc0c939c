"""The Hugging Face serving helper's inputs (``noise/hf_inference.py``): checked, and read into what the noise needs.

The checks raise a ``ValueError`` naming the argument, its value or shape, and what is expected; the readers turn a
transformers call's arguments into token positions, the prompt/response split, the private spans and the KV
cache's length. Imports
torch and the noise config only; transformers is never imported (the models are duck-typed).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.validation import check_int

__all__ = [
    "cached_length",
    "check_input_ids",
    "check_mask",
    "check_noise_config",
    "first_positions",
    "input_embeddings",
    "named_arguments",
    "private_columns",
    "response_from_loss_mask",
    "shape_of",
    "shown",
    "token_parts",
]


def input_embeddings(model: Any) -> torch.nn.Module:
    """``model.get_input_embeddings()``, checked to be a module; a ``ValueError`` naming the model otherwise."""
    getter = getattr(model, "get_input_embeddings", None)
    if not callable(getter):
        raise ValueError(
            f"model={type(model).__name__} is invalid: expected a Hugging Face transformers model with "
            "get_input_embeddings() (a PreTrainedModel such as LlamaForCausalLM)."
        )
    try:
        embedding = getter()
    except NotImplementedError:
        embedding = None
    if not isinstance(embedding, torch.nn.Module):
        raise ValueError(
            f"model={type(model).__name__} is invalid: get_input_embeddings() returned {type(embedding).__name__}, "
            "expected the torch module that looks input ids up (e.g. nn.Embedding)."
        )
    return embedding


def check_noise_config(noise_config: object) -> None:
    """A ``ValueError`` unless ``noise_config`` is a ``NoiseConfig``."""
    if not isinstance(noise_config, NoiseConfig):
        raise ValueError(
            f"noise_config={noise_config!r} is invalid: expected a nemo_noise_plugin NoiseConfig "
            "(e.g. NoiseConfig(mechanism='gaussian', sigma=1.0, scaling='absolute') or load_noise_config(name))."
        )


def check_input_ids(input_ids: object, embedding: torch.nn.Module) -> None:
    """A ``ValueError`` unless ``input_ids`` is an integer ``[b, s]`` tensor of ids of ``embedding``'s rows."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids has shape {shape_of(input_ids)}: expected an integer [b, s] tensor of token ids.")
    vocab = getattr(embedding, "num_embeddings", None)
    if input_ids.numel() and (int(input_ids.min()) < 0 or (vocab is not None and int(input_ids.max()) >= vocab)):
        allowed = f"[0, {vocab - 1}]" if vocab is not None else ">= 0"
        raise ValueError(
            f"input_ids has values in [{int(input_ids.min())}, {int(input_ids.max())}]: expected ids in {allowed} "
            "(the input embedding's rows)."
        )


def check_mask(name: str, mask: object, input_ids: torch.Tensor) -> torch.Tensor:
    """The mask as a boolean tensor (all True when None), checked to have ``input_ids``'s shape."""
    if mask is None:
        return torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        raise ValueError(f"{name} has shape {shape_of(mask)}: expected input_ids's shape {shape_of(input_ids)}.")
    return mask.bool()


def first_positions(position_offset: object, input_ids: torch.Tensor) -> torch.Tensor:
    """``[b]`` int64 (CPU) token position of each row's first real token."""
    batch = input_ids.size(0)
    if isinstance(position_offset, torch.Tensor):
        if (
            position_offset.shape != (batch,)
            or position_offset.is_floating_point()
            or bool((position_offset < 0).any())
        ):
            raise ValueError(
                f"position_offset has shape {shape_of(position_offset)}: expected an integer >= 0 or a [{batch}] "
                "integer tensor of them (one per row)."
            )
        return position_offset.to(device="cpu", dtype=torch.int64)
    check_int("position_offset", position_offset)
    return torch.full((batch,), position_offset, dtype=torch.int64)


def response_from_loss_mask(loss_mask: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` True for real tokens whose previous real token carries loss (training's prompt/response split)."""
    response = torch.zeros_like(real)
    for row in range(real.size(0)):
        columns = real[row].nonzero().view(-1)
        carries = loss_mask[row, columns] != 0
        response[row, columns[1:]] = carries[:-1]
    return response


def named_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The forward's arguments by name (positional ones bound to the forward's signature)."""
    if not args:
        return kwargs
    try:
        return {**inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments}
    except (TypeError, ValueError):
        return {"input_ids": args[0], **kwargs}


def cached_length(past_key_values: object) -> int:
    """Tokens already in the KV cache (0 without one)."""
    if past_key_values is None:
        return 0
    get_seq_length = getattr(past_key_values, "get_seq_length", None)
    if not callable(get_seq_length):
        raise ValueError(
            f"past_key_values of type {type(past_key_values).__name__} is invalid for EmbeddingNoiseHook: expected "
            "a transformers Cache (with get_seq_length())."
        )
    return int(get_seq_length())


def shape_of(value: object) -> str:
    """A tensor's shape as a list, or any other value's repr, for error messages."""
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else repr(value)


def shown(value: object) -> str:
    """A tensor's values as a list, or any other value's repr, for error messages."""
    return str(value.tolist()) if isinstance(value, torch.Tensor) else repr(value)


def token_parts(
    noise_config: NoiseConfig,
    real: torch.Tensor,
    loss_mask: torch.Tensor | None,
    private_mask: torch.Tensor | None,
    position_offset: object,
    *,
    resumes: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``noised_inputs_embeds``'s ``[b, s]`` response mask (``tokens='prompt'``/``'response'``) and private-span mask
    (``tokens='spans'``), each None when the selection does not need it; errors name the missing argument."""
    private = None
    if noise_config.tokens == "spans":
        if private_mask is None:
            raise ValueError(
                "private_mask=None is invalid with NoiseConfig.tokens='spans': expected the [b, s] mask of the "
                "private-span tokens (True inside a span), as training's batch carries it (or tokens='all')."
            )
        private = check_mask("private_mask", private_mask, real).to(real.device)
    if noise_config.tokens not in ("prompt", "response"):
        return None, private
    if loss_mask is None:
        raise ValueError(
            f"loss_mask=None is invalid with NoiseConfig.tokens={noise_config.tokens!r}: expected the [b, s] "
            "loss mask that tells prompt from response (or tokens='all')."
        )
    if resumes:
        raise ValueError(
            f"position_offset={shown(position_offset)} is invalid with NoiseConfig.tokens="
            f"{noise_config.tokens!r}: whether the first token is a response token depends on the loss mask "
            "before it. Expected position_offset=0 (pass whole sequences) or EmbeddingNoiseHook."
        )
    return response_from_loss_mask(loss_mask.to(real.device), real), None


def private_columns(
    noise_config: NoiseConfig, mask: object, batch: int, past: int, width: int, device: torch.device
) -> torch.Tensor | None:
    """The hook's ``[b, width]`` private-span mask of a forward's columns ``past ..`` (``tokens='spans'``), else None;
    columns past the given mask's width (generated tokens) are not private."""
    if noise_config.tokens != "spans":
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.size(0) != batch:
        raise ValueError(
            f"EmbeddingNoiseHook.private_mask has shape {shape_of(mask)}: NoiseConfig.tokens='spans' expected a "
            f"[{batch}, w] mask of the private-span tokens (True inside a span) over the query's columns; set "
            "hook.private_mask before the query."
        )
    private = torch.zeros(batch, width, dtype=torch.bool, device=device)
    known = max(0, min(width, mask.size(1) - past))
    private[:, :known] = mask[:, past : past + known].to(device=device, dtype=torch.bool)
    return private
