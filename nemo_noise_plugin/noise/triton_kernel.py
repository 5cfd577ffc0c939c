"""The fused GPU noise kernel: generate the noise and add it in one pass over the embedding output.

``fused_add_noise`` computes exactly what ``sampling.add_noise_reference`` computes,
``(x * input_scale + noise_scale * unit).to(x.dtype)`` with per-token ``[s, b]`` scales, but reads ``x`` once and
writes the result once. The Philox words are made in registers with the counter contract of ``noise/philox.py``
(key ``(seed, iteration)``, counter ``(hidden // 4, token position, sample index, stream)``): by Triton's
``tl.philox`` rounds, written out with one wide multiply per product (tested equal to ``tl.philox`` itself), so
uniform noise, and with it the whole uniform output, is bit-identical to the torch reference. Gaussian noise uses
the same Box-Muller pairing in float32 with the hardware sine and cosine (the reference works in float64): it
agrees to about 1e-5 absolute. Laplace noise inverts the CDF of the same symmetric uniform, ``sign(v) * -ln(1 -
|v|)``, with ``1 - |v|`` exact in float32 and a float32 log (the reference's log is float64): a few 1e-6.

``fused_gather_add_noise`` is the same kernel reading its rows from the embedding table (``GATHER``): the lookup
and the noise in one pass, with the same noise bits, for a model whose decoder input is the lookup itself
(``model/noised_lookup.py``).

Triton is imported lazily: this module imports on machines without Triton or CUDA, where ``triton_available()`` is
False and callers use the torch reference.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import torch

from nemo_noise_plugin.noise.philox import STREAM_NOISE

_MASK32 = 0xFFFFFFFF


@functools.cache
def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present, i.e. when ``fused_add_noise`` can run."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.cache
def _kernel() -> Any:
    """Build (once) the Triton kernel; deferred so that importing this module never needs Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def _approx(angle, fn: tl.constexpr):
        """The hardware ``sin``/``cos`` (``fn``) of float32 angles in [-pi, pi]."""
        return tl.inline_asm_elementwise(
            fn + ".approx.f32 $0, $1;", "=r,r", [angle], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def _log(x, FAST: tl.constexpr):
        """``ln x`` of float32 ``x`` > 0: ``tl.log``, or with ``FAST`` the hardware ``lg2.approx`` times ln 2 (one
        special-function instruction; absolute error ~1e-7, so relative error grows as ``x`` nears 1)."""
        if FAST:
            y = 0.6931471805599453 * tl.inline_asm_elementwise(
                "lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            y = tl.log(x)
        return y

    @triton.jit
    def _laplace(k, FAST: tl.constexpr):
        """Laplace(0, 1) of the symmetric uniform ``v = k * 2**-24`` (``k`` an odd integer held in float32)."""
        magnitude = -_log(1.0 - tl.abs(k) * 5.960464477539063e-08, FAST)
        return tl.where(k < 0, -magnitude, magnitude)

    @triton.jit
    def _mul_wide(a, multiplier: tl.constexpr):
        """High and low 32-bit words of the 64-bit product of uint32 ``a`` and a 32-bit constant."""
        return tl.inline_asm_elementwise(
            "{ .reg .b64 t; mul.wide.u32 t, $2, " + multiplier + "; mov.b64 {$1, $0}, t; }",
            "=r,=r,r",
            [a],
            dtype=(tl.uint32, tl.uint32),
            is_pure=True,
            pack=1,
        )

    # The key and stream words vary from call to call: no value specialisation, so no recompiles.
    @triton.jit(do_not_specialize=["seed", "iteration", "stream"])
    def add_noise_kernel(
        x_ptr,
        out_ptr,
        ids_ptr,
        ids_stride_b,
        ids_stride_s,
        position_ptr,
        sample_ptr,
        noise_scale_ptr,
        input_scale_ptr,
        n_rows,
        batch,
        hidden,
        seed,
        iteration,
        stream,
        HAS_INPUT_SCALE: tl.constexpr,
        GAUSSIAN: tl.constexpr,
        LAPLACE: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_QUADS: tl.constexpr,
        TL_PHILOX: tl.constexpr,
        GATHER: tl.constexpr,
        ITERATION_IN_MEMORY: tl.constexpr,
        FAST_LOG: tl.constexpr,
    ):
        # One program: BLOCK_ROWS tokens (rows of the [s * b, h] view) by 4 * BLOCK_QUADS hidden elements; one
        # Philox call per quad gives the four words of hidden indices 4q .. 4q + 3. GATHER: x is the [vocab, h]
        # embedding table and row r = (s_r, b_r) reads table row ids[b_r, s_r] (the lookup and noise in one pass).
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < n_rows
        position = tl.load(position_ptr + rows // batch, mask=row_ok, other=0)
        sample = tl.load(sample_ptr + rows % batch, mask=row_ok, other=0)
        noise_scale = tl.load(noise_scale_ptr + rows, mask=row_ok, other=0.0)

        quads = tl.program_id(1) * BLOCK_QUADS + tl.arange(0, BLOCK_QUADS)
        c0 = tl.broadcast_to(quads.to(tl.uint32)[None, :], (BLOCK_ROWS, BLOCK_QUADS))
        c1 = tl.broadcast_to(position.to(tl.uint32)[:, None], (BLOCK_ROWS, BLOCK_QUADS))
        c2 = tl.broadcast_to(sample.to(tl.uint32)[:, None], (BLOCK_ROWS, BLOCK_QUADS))
        c3 = c0 * 0 + stream.to(tl.uint32)
        k0 = seed.to(tl.uint32)
        if ITERATION_IN_MEMORY:  # a 0-dim int64 tensor a CUDA graph's replays read anew (noise/replayable.py)
            k1 = tl.load(iteration).to(tl.uint32)
        else:
            k1 = iteration.to(tl.uint32)
        if TL_PHILOX:
            # tl.philox keys with (seed & 0xffffffff, seed >> 32) = (k0, k1) for 32-bit counters, as the reference.
            w0, w1, w2, w3 = tl.philox((k1.to(tl.uint64) << 32) | k0.to(tl.uint64), c0, c1, c2, c3)
        else:
            # tl.philox's rounds, but each 32 x 32 -> 64-bit product is one wide multiply (IMAD.WIDE.U32) instead of
            # separate high and low halves: a sixth fewer instructions, up to 10% faster (benchmarks/RESULTS.md).
            for _ in tl.static_range(10):
                hi0, lo0 = _mul_wide(c0, "0xD2511F53")
                hi1, lo1 = _mul_wide(c2, "0xCD9E8D57")
                c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
                k0 += 0x9E3779B9
                k1 += 0xBB67AE85
            w0, w1, w2, w3 = c0, c1, c2, c3

        if GAUSSIAN:
            # Box-Muller on (w0, w1) and (w2, w3); u = open-interval uniform, odd multiples of 2**-24.
            u0 = ((w0 >> 9).to(tl.float32) * 2.0 + 1.0) * 5.960464477539063e-08
            u1 = ((w1 >> 9).to(tl.float32) * 2.0 + 1.0) * 5.960464477539063e-08
            u2 = ((w2 >> 9).to(tl.float32) * 2.0 + 1.0) * 5.960464477539063e-08
            u3 = ((w3 >> 9).to(tl.float32) * 2.0 + 1.0) * 5.960464477539063e-08
            r01 = tl.sqrt(-2.0 * _log(u0, FAST_LOG))
            r23 = tl.sqrt(-2.0 * _log(u2, FAST_LOG))
            # t = 2 pi u = a + pi with a = 2 pi (u - 0.5) in (-pi, pi), where the hardware sin/cos are accurate to
            # ~1e-6 absolute (libdevice's full range reduction costs several times more); cos t = -cos a, etc.
            a01 = (u1 - 0.5) * 6.283185307179586
            a23 = (u3 - 0.5) * 6.283185307179586
            n0, n1 = -r01 * _approx(a01, "cos"), -r01 * _approx(a01, "sin")
            n2, n3 = -r23 * _approx(a23, "cos"), -r23 * _approx(a23, "sin")
            row_scale = noise_scale
        else:
            # Symmetric uniform unit = k * 2**-24 with the odd integer k = 2 * (w >> 8) - (2**24 - 1), exact in
            # float32 (one explicit fma). The 2**-24 moves into the per-token scale: k * (scale * 2**-24) rounds
            # exactly like the reference's (k * 2**-24) * scale, with two fewer instructions per element.
            n0 = tl.fma((w0 >> 8).to(tl.float32), 2.0, -16777215.0)
            n1 = tl.fma((w1 >> 8).to(tl.float32), 2.0, -16777215.0)
            n2 = tl.fma((w2 >> 8).to(tl.float32), 2.0, -16777215.0)
            n3 = tl.fma((w3 >> 8).to(tl.float32), 2.0, -16777215.0)
            if LAPLACE:
                n0, n1 = _laplace(n0, FAST_LOG), _laplace(n1, FAST_LOG)
                n2, n3 = _laplace(n2, FAST_LOG), _laplace(n3, FAST_LOG)
                row_scale = noise_scale
            else:
                row_scale = noise_scale * 5.960464477539063e-08
        # [R, Q, 2, 2] with [..., k, l] = n(2k + l), flattened row-major: n0, n1, n2, n3 per quad.
        unit = tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), (BLOCK_ROWS, 4 * BLOCK_QUADS))

        cols = tl.program_id(1) * (4 * BLOCK_QUADS) + tl.arange(0, 4 * BLOCK_QUADS)
        offsets = rows.to(tl.int64)[:, None] * hidden + cols[None, :]
        mask = row_ok[:, None] & (cols < hidden)[None, :]
        if GATHER:
            token = tl.load(
                ids_ptr + (rows % batch) * ids_stride_b + (rows // batch) * ids_stride_s, mask=row_ok, other=0
            )
            source = token.to(tl.int64)[:, None] * hidden + cols[None, :]
        else:
            source = offsets
        x = tl.load(x_ptr + source, mask=mask, other=0.0).to(tl.float32)
        if HAS_INPUT_SCALE:
            x = x * tl.load(input_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
        out = x + unit * row_scale[:, None]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)

    return add_noise_kernel


def _default_config(hidden: int) -> tuple[int, int, int]:
    """(rows per program, hidden elements per program, warps): 4 x 512 elements for 4 warps, the fastest of the
    configurations an H200 sweep tried at h = 2048, 4096 and 8192 (benchmarks/RESULTS.md)."""
    block_hidden = min(512, max(16, 1 << (hidden - 1).bit_length()))
    return 2048 // block_hidden, block_hidden, 4


def launch_add_noise(
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    input_ids: torch.Tensor | None = None,
    seed: int,
    iteration: int | torch.Tensor,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
    noise_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    distribution: str,
    stream: int = STREAM_NOISE,
    config: tuple[int, int, int] | None = None,
    tl_philox: bool = False,
    fast_log: bool = False,
) -> Any:
    """Run the kernel into ``out`` (no autograd, no checks); returns Triton's compiled kernel (its ``asm`` holds the
    code), None for an empty output. For tuning and measurement only: ``config`` overrides (rows, hidden, warps),
    ``tl_philox`` uses ``tl.philox`` itself instead of the kernel's own (bit-identical) rounds, and ``fast_log`` takes
    the Gaussian and Laplace logarithms from the hardware ``lg2.approx`` (other bits than the training path's: not
    used by it; ``benchmarks/noise_in_lookup.py`` measures what it would buy). With ``input_ids``
    (``[b, s]``, any strides), ``x`` is a contiguous ``[vocab, h]`` embedding table and ``out`` (``[s, b, h]``) gets
    the noised rows ``x[input_ids].transpose(0, 1)``. An ``iteration`` tensor (0-dim int64 on the device) is read by the
    kernel, so a CUDA graph's replays take its current value."""
    seq, batch, hidden = out.shape
    n_rows = seq * batch
    if n_rows == 0 or hidden == 0:
        return None
    block_rows, block_hidden, num_warps = config or _default_config(hidden)
    grid = (math.ceil(n_rows / block_rows), math.ceil(hidden / block_hidden))
    gather = input_ids is not None
    in_memory = isinstance(iteration, torch.Tensor)
    return _kernel()[grid](
        x,
        out,
        input_ids if gather else token_position,
        input_ids.stride(0) if gather else 0,
        input_ids.stride(1) if gather else 0,
        token_position,
        sample_index,
        noise_scale,
        noise_scale if input_scale is None else input_scale,
        n_rows,
        batch,
        hidden,
        seed & _MASK32,
        iteration if in_memory else iteration & _MASK32,
        stream & _MASK32,
        HAS_INPUT_SCALE=input_scale is not None,
        GAUSSIAN=distribution == "gaussian",
        LAPLACE=distribution == "laplace",
        BLOCK_ROWS=block_rows,
        BLOCK_QUADS=block_hidden // 4,
        TL_PHILOX=tl_philox,
        GATHER=gather,
        ITERATION_IN_MEMORY=in_memory,
        FAST_LOG=fast_log,
        num_warps=num_warps,
        # No multiply-add contraction: the reference rounds x * input_scale and noise_scale * unit separately.
        enable_fp_fusion=False,
    )


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
) -> dict[str, Any]:
    """The kernel's keys and per-token tensors for an ``[s, b, h]`` output on ``device``, in the dtypes and shapes
    ``launch_add_noise`` takes; Gaussian noise (drawn in pairs of hidden elements) needs an even hidden size."""
    seq, batch, hidden = shape
    if distribution == "gaussian" and hidden % 2:
        raise ValueError(f"Gaussian noise pairs hidden elements: hidden size {hidden} must be even.")
    return {
        "distribution": distribution,
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
) -> torch.Tensor:
    """``(x * input_scale + noise_scale * unit).to(x.dtype)`` in one pass on the GPU; see ``add_noise_reference``.

    ``x`` is a CUDA ``[s, b, h]`` bf16/fp16/fp32 tensor; ``token_position`` is int64 ``[s]`` and ``sample_index``
    int64 ``[b]`` (global indices); ``noise_scale`` and the optional ``input_scale`` are float32 ``[s, b]``.
    Uniform noise is bit-identical to the reference; Gaussian and Laplace agree to float32 rounding (a few 1e-6).
    Gradients flow to ``x`` (scaled by ``input_scale``); the scales get none.
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
    )
    return _FusedGatherAddNoise.apply(weight.contiguous(), input_ids.to(weight.device), kwargs)
