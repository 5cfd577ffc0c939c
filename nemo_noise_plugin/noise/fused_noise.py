"""The fused noise as autograd functions over the Triton kernel: on an input, or with the embedding lookup in one pass.

``fused_add_noise`` puts the noise on an ``[s, b, h]`` input, ``fused_gather_add_noise`` on the embedding lookup (one
pass); the kernel is ``noise/triton_kernel.py``'s.

``fused_add_noise`` computes what ``sampling.add_noise_reference`` computes, ``(x * input_scale + noise_scale *
unit).to(x.dtype)`` with per-token ``[s, b]`` scales, reading ``x`` once and writing the result once; uniform noise
bit-identical to the reference, Gaussian and Laplace to float32 rounding (``triton_kernel``'s docstring says how,
and what ``fast_math`` changes). ``fused_gather_add_noise`` reads the rows from the embedding table instead, with the
same noise bits, for a model whose decoder input is the lookup itself (``model/noised_lookup.py``). The noise is a
constant: gradients are the plain path's.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from nemo_noise_plugin.noise.triton_kernel import launch_add_noise


def _check_distribution(distribution: str) -> None:
    if distribution not in ("uniform", "gaussian", "laplace"):
        raise ValueError(f"distribution must be 'uniform', 'gaussian' or 'laplace', got {distribution!r}.")


def _kernel_arguments(
    shape: tuple[int, int, int],
    device: torch.device,
    *,
    seed: int,
    iteration: int | torch.Tensor,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
    noise_scale: torch.Tensor,
    distribution: str,
    fast_math: bool = False,
) -> dict[str, Any]:
    """The kernel's keys and per-token tensors for an ``[s, b, h]`` output on ``device``, in the dtypes and shapes
    ``launch_add_noise`` takes; Gaussian noise (drawn in pairs of hidden elements) needs an even hidden size."""
    seq, batch, hidden = shape
    if distribution == "gaussian" and hidden % 2:
        raise ValueError(f"Gaussian noise pairs hidden elements: hidden size {hidden} must be even.")
    return {
        "distribution": distribution,
        "fast_math": bool(fast_math),
        "seed": int(seed),
        "iteration": _iteration_key(iteration, device),
        "sample_index": sample_index.to(device=device, dtype=torch.int64).reshape(batch).contiguous(),
        "token_position": token_position.to(device=device, dtype=torch.int64).reshape(seq).contiguous(),
        "noise_scale": noise_scale.to(device=device, dtype=torch.float32).expand(seq, batch).contiguous(),
    }


def _iteration_key(iteration: int | torch.Tensor, device: torch.device) -> int | torch.Tensor:
    """The iteration as the kernel takes it: an int, or a 0-dim int64 tensor on ``device`` (read by the kernel)."""
    if not isinstance(iteration, torch.Tensor):
        return int(iteration)
    if iteration.dim() != 0 or iteration.dtype != torch.int64 or iteration.device != device:
        raise ValueError(
            f"an iteration tensor must be a 0-dim int64 tensor on {device}: got shape {tuple(iteration.shape)}, "
            f"{iteration.dtype} on {iteration.device}."
        )
    return iteration


class _FusedAddNoise(torch.autograd.Function):
    """Autograd wrapper: the noise is a constant, so ``d out / d x = input_scale`` (or 1); scales get no gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, input_scale: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor:
        out = torch.empty_like(x)
        launch_add_noise(x, out, input_scale=input_scale, **kwargs)
        ctx.save_for_backward(input_scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (input_scale,) = ctx.saved_tensors
        if input_scale is None:
            return grad, None, None
        return (grad.float() * input_scale.unsqueeze(-1)).to(grad.dtype), None, None


def fused_add_noise(
    x: torch.Tensor,
    *,
    seed: int,
    iteration: int | torch.Tensor,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
    noise_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    distribution: Literal["uniform", "gaussian", "laplace"] = "uniform",
    fast_math: bool = False,
) -> torch.Tensor:
    """``(x * input_scale + noise_scale * unit).to(x.dtype)`` in one pass on the GPU; see ``add_noise_reference``.

    ``x`` is a CUDA ``[s, b, h]`` bf16/fp16/fp32 tensor; ``token_position`` is int64 ``[s]`` and ``sample_index``
    int64 ``[b]`` (global indices); ``noise_scale`` and the optional ``input_scale`` are float32 ``[s, b]``.
    Uniform noise is bit-identical to the reference; Gaussian and Laplace agree to float32 rounding (a few 1e-6), or
    with ``fast_math`` (``NoiseConfig.fast_math``) to the hardware log2's (Gaussian < 1e-3, Laplace < 5e-5 at unit
    scale). Gradients flow to ``x`` (scaled by ``input_scale``); the scales get none.
    """
    _check_distribution(distribution)
    if x.dim() != 3 or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be a CUDA [s, b, h] bf16/fp16/fp32 tensor: {tuple(x.shape)} {x.dtype} {x.device}.")
    seq, batch, _ = x.shape
    kwargs = _kernel_arguments(
        x.shape,
        x.device,
        seed=seed,
        iteration=iteration,
        sample_index=sample_index,
        token_position=token_position,
        noise_scale=noise_scale,
        distribution=distribution,
        fast_math=fast_math,
    )
    if input_scale is not None:
        input_scale = input_scale.to(device=x.device, dtype=torch.float32).expand(seq, batch).contiguous()
    return _FusedAddNoise.apply(x.contiguous(), input_scale, kwargs)


class _FusedGatherAddNoise(torch.autograd.Function):
    """Autograd wrapper of the lookup with noise: the weight's gradient is the plain lookup's (the noise is a
    constant), computed by the same ``embedding_backward`` call on the same ``[b, s]`` layout as ``F.embedding``
    followed by Megatron's ``transpose(0, 1)``, so it is bit-identical to the unfused path's."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        batch, seq = input_ids.shape
        out = torch.empty((seq, batch, weight.size(1)), dtype=weight.dtype, device=weight.device)
        launch_add_noise(weight, out, input_ids=input_ids, input_scale=None, **kwargs)
        ctx.save_for_backward(input_ids)
        ctx.vocab = weight.size(0)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (input_ids,) = ctx.saved_tensors
        weight_grad = torch.ops.aten.embedding_backward(grad.transpose(0, 1), input_ids, ctx.vocab, -1, False, False)
        return weight_grad, None, None


def fused_gather_add_noise(
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    seed: int,
    iteration: int | torch.Tensor,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
    noise_scale: torch.Tensor,
    distribution: Literal["uniform", "gaussian", "laplace"] = "uniform",
    fast_math: bool = False,
) -> torch.Tensor:
    """The embedding lookup with noise in one pass: ``fused_add_noise(F.embedding(input_ids, weight).transpose(0,
    1))`` without the ``[b, s, h]`` lookup output, its transposed copy or a second pass; the same noise bits.

    ``weight`` is a contiguous CUDA ``[vocab, h]`` bf16/fp16/fp32 table, ``input_ids`` int ``[b, s]`` (every id in
    ``[0, vocab)``, as for ``F.embedding`` on the GPU); returns ``[s, b, h]``. Gradients flow to ``weight`` as the
    plain lookup's; ``noise_scale`` is float32 ``[s, b]``.
    """
    _check_distribution(distribution)
    if weight.dim() != 2 or not weight.is_cuda or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"weight must be a CUDA [vocab, h] bf16/fp16/fp32 tensor: {tuple(weight.shape)} {weight.dtype} "
            f"{weight.device}."
        )
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [b, s], got shape {tuple(input_ids.shape)}.")
    batch, seq = input_ids.shape
    kwargs = _kernel_arguments(
        (seq, batch, weight.size(1)),
        weight.device,
        seed=seed,
        iteration=iteration,
        sample_index=sample_index,
        token_position=token_position,
        noise_scale=noise_scale,
        distribution=distribution,
        fast_math=fast_math,
    )
    return _FusedGatherAddNoise.apply(weight.contiguous(), input_ids.to(weight.device), kwargs)
