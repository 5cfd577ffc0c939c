"""The Triton noise kernel: generate the noise and add it in one pass over the embedding output.

``launch_add_noise`` runs it; the autograd functions over it are ``noise/fused_noise.py``'s. The kernel computes
exactly what ``sampling.add_noise_reference`` computes, ``(x * input_scale + noise_scale * unit).to(x.dtype)`` with
per-token ``[s, b]`` scales, reading ``x`` once and writing the result once. The Philox words are made in registers
with the counter contract of ``noise/philox.py`` (key ``(seed, iteration)``, counter ``(hidden // 4, token position,
sample index, stream)``): by Triton's ``tl.philox`` rounds, written out with one wide multiply per product (tested
equal to ``tl.philox`` itself), so uniform noise, and with it the whole uniform output, is bit-identical to the torch
reference. Gaussian noise uses the same Box-Muller pairing in float32 with the hardware sine and cosine (the reference
works in float64): it agrees to about 1e-5 absolute. Laplace noise inverts the CDF of the same symmetric uniform,
``sign(v) * -ln(1 - |v|)``, with ``1 - |v|`` exact in float32 and a float32 log (the reference's log is float64): a
few 1e-6.

The element-wise device functions (Philox, the transforms, the special functions) are ``noise/triton_math.py``'s.

``fast_math`` (``NoiseConfig.fast_math``) evaluates the same transforms of the same words with the hardware
``lg2.approx`` for the logarithm and explicit multiply-adds (Laplace noise in 0.6x the exact kernel's instructions),
in one column step per program, which suits its use of the special-function unit (benchmarks/SFT_THROUGHPUT.md). Its
values differ from the exact kernel's in the last bits (Gaussian by up to a few 1e-4 at unit scale, where the
Box-Muller radius is near 0 and the hardware log's absolute error is a large part of ``ln u``; Laplace a few 1e-6):
other noise bits, so a run resumes only with the setting it was saved with. Uniform noise is the same either way.

Each program takes a block of token positions of one sample and walks along the hidden dimension in a few steps, so
that a token's indices and its position, scale and id loads are made once per 2,048 elements, not once per step.

With ``GATHER`` the kernel reads its rows from the embedding table: the lookup and the noise in one pass, with the
same noise bits (``fused_noise.fused_gather_add_noise``).

Triton is imported lazily: this module imports on machines without Triton or CUDA, where ``triton_available()`` is
False and callers use the torch reference.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from nemo_noise_plugin.noise.philox import STREAM_NOISE
from nemo_noise_plugin.noise.triton_math import device_functions

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

    functions = device_functions()
    _philox, _noise_quad, _scale_factor = functions.philox, functions.noise_quad, functions.scale_factor

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
        seq,
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
        COLUMN_STEPS: tl.constexpr,
        TL_PHILOX: tl.constexpr,
        GATHER: tl.constexpr,
        ITERATION_IN_MEMORY: tl.constexpr,
        FAST_MATH: tl.constexpr,
    ):
        # Program (i, b, j): BLOCK_ROWS token positions i * BLOCK_ROWS + ... of sample b (rows s * batch + b of the
        # [s * b, h] view), hidden elements from j * COLUMN_STEPS * 4 * BLOCK_QUADS in COLUMN_STEPS steps of
        # 4 * BLOCK_QUADS, so that the per-token work (indices, loads of the position, scale and token id) is done
        # once for COLUMN_STEPS steps. One Philox call per quad gives the words of hidden indices 4q .. 4q + 3.
        # GATHER: x is the [vocab, h] embedding table and row (s, b) reads table row ids[b, s].
        positions = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = positions < seq
        b = tl.program_id(1)
        rows = positions.to(tl.int64) * batch + b
        position = tl.load(position_ptr + positions, mask=row_ok, other=0)
        sample = tl.load(sample_ptr + b)
        factor = _scale_factor(tl.load(noise_scale_ptr + rows, mask=row_ok, other=0.0), GAUSSIAN, LAPLACE, FAST_MATH)
        if HAS_INPUT_SCALE:
            input_scale = tl.load(input_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
        if GATHER:
            token = tl.load(ids_ptr + b * ids_stride_b + positions * ids_stride_s, mask=row_ok, other=0)
            source_rows = token.to(tl.int64) * hidden
        else:
            source_rows = rows * hidden
        out_rows = rows * hidden
        k0 = seed.to(tl.uint32)
        if ITERATION_IN_MEMORY:  # a 0-dim int64 tensor a CUDA graph's replays read anew (noise/replayable.py)
            k1 = tl.load(iteration).to(tl.uint32)
        else:
            k1 = iteration.to(tl.uint32)

        for step in range(COLUMN_STEPS):
            first_quad = (tl.program_id(2) * COLUMN_STEPS + step) * BLOCK_QUADS
            quads = first_quad + tl.arange(0, BLOCK_QUADS)
            c0 = tl.broadcast_to(quads.to(tl.uint32)[None, :], (BLOCK_ROWS, BLOCK_QUADS))
            c1 = tl.broadcast_to(position.to(tl.uint32)[:, None], (BLOCK_ROWS, BLOCK_QUADS))
            c2 = c0 * 0 + sample.to(tl.uint32)
            c3 = c0 * 0 + stream.to(tl.uint32)
            w0, w1, w2, w3 = _philox(c0, c1, c2, c3, k0, k1, TL_PHILOX)
            quad_units = _noise_quad(w0, w1, w2, w3, GAUSSIAN, LAPLACE, FAST_MATH)
            unit = tl.reshape(quad_units, (BLOCK_ROWS, 4 * BLOCK_QUADS))

            cols = first_quad * 4 + tl.arange(0, 4 * BLOCK_QUADS)
            mask = row_ok[:, None] & (cols < hidden)[None, :]
            x = tl.load(x_ptr + source_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_INPUT_SCALE:
                x = x * input_scale
            if FAST_MATH:
                out = tl.fma(unit, factor[:, None], x)
            else:
                out = x + unit * factor[:, None]
            tl.store(out_ptr + out_rows[:, None] + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)

    return add_noise_kernel


def _default_config(hidden: int, fast_math: bool = False) -> tuple[int, int, int, int]:
    """(token rows per program, hidden elements per step, warps, steps per program): 4 rows x 512 elements for 4
    warps, the fastest of the configurations an H200 sweep tried at h = 2048, 4096 and 8192 (benchmarks/RESULTS.md),
    and up to 4 steps along the hidden dimension per program, so that a row's indices and loads serve 2,048
    elements; one step with ``fast_math``, whose Gaussian kernel leans on the special-function unit (four of its
    instructions per Gaussian pair) and ran 1.06-1.08x the copy floor in one step against 1.09-1.14x in four on an
    H100 sweep (benchmarks/SFT_THROUGHPUT.md, "One register layout")."""
    block_hidden = min(512, max(16, 1 << (hidden - 1).bit_length()))
    steps = 1 if fast_math else max(1, min(4, hidden // block_hidden))
    return 2048 // block_hidden, block_hidden, 4, steps


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
    fast_math: bool = False,
    stream: int = STREAM_NOISE,
    config: tuple[int, int, int, int] | None = None,
    tl_philox: bool = False,
) -> Any:
    """Run the kernel into ``out`` (no autograd, no checks); returns Triton's compiled kernel (its ``asm`` holds the
    code), None for an empty output. ``fast_math`` takes the Gaussian and Laplace logarithms from the hardware
    ``lg2.approx`` and contracts their multiply-adds (other bits than the exact kernel's; uniform noise is the same
    either way; ``NoiseConfig.fast_math``). For tuning and measurement only: ``config`` overrides (rows, hidden
    elements per step, warps, steps) and ``tl_philox`` uses ``tl.philox`` itself instead of the kernel's own
    (bit-identical) rounds. With ``input_ids`` (``[b, s]``, any strides), ``x`` is a contiguous ``[vocab, h]``
    embedding table and ``out`` (``[s, b, h]``) gets the noised rows ``x[input_ids].transpose(0, 1)``. An
    ``iteration`` tensor (0-dim int64 on the device) is read by the kernel, so a CUDA graph's replays take its
    current value."""
    seq, batch, hidden = out.shape
    if seq * batch == 0 or hidden == 0:
        return None
    block_rows, block_hidden, num_warps, steps = config or _default_config(hidden, fast_math)
    grid = (math.ceil(seq / block_rows), batch, math.ceil(hidden / (block_hidden * steps)))
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
        seq,
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
        COLUMN_STEPS=steps,
        TL_PHILOX=tl_philox,
        GATHER=gather,
        ITERATION_IN_MEMORY=in_memory,
        FAST_MATH=fast_math,
        num_warps=num_warps,
        # No implicit multiply-add contraction: the exact kernel rounds x * input_scale and noise_scale * unit
        # separately, as the reference does (the fast path asks for its fma explicitly).
        enable_fp_fusion=False,
    )
