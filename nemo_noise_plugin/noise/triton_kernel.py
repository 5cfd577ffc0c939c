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

``fast_math`` (``NoiseConfig.fast_math``) evaluates the same transforms of the same words with the hardware
``lg2.approx`` for the logarithm and explicit multiply-adds: about a third fewer instructions for Gaussian and Laplace
noise, whose kernel is otherwise bound by instruction issue, not memory (benchmarks/SFT_THROUGHPUT.md). Its values
differ from the exact kernel's in the last bits (Gaussian by up to a few 1e-4 at unit scale, where the Box-Muller
radius is near 0 and the hardware log's absolute error is a large part of ``ln u``; Laplace a few 1e-6): other noise
bits, so a run resumes only with the setting it was saved with. Uniform noise is the same either way.

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
    def _lg2(x):
        """The hardware ``log2`` of float32 ``x`` > 0 (``lg2.approx``: one special-function instruction, absolute
        error ~2**-22, so its relative error grows as ``x`` nears 1)."""
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _laplace(k):
        """Laplace(0, 1) of the symmetric uniform ``v = k * 2**-24`` (``k`` an odd integer held in float32), with
        libdevice's float32 ``logf``: ``sign(v) * -ln(1 - |v|)``."""
        magnitude = -tl.log(1.0 - tl.abs(k) * 5.960464477539063e-08)
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

    @triton.jit
    def _philox(c0, c1, c2, c3, k0, k1, TL_PHILOX: tl.constexpr):
        """The four Philox4x32-10 words of counter ``(c0, c1, c2, c3)`` under key ``(k0, k1)``."""
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
        return w0, w1, w2, w3

    @triton.jit
    def _gaussian_pair(wa, wb, FAST_MATH: tl.constexpr):
        """Box-Muller on the words ``(wa, wb)``: the pair ``(r cos t, r sin t)``, ``r = sqrt(-2 ln ua)``, ``t = 2 pi
        ub``, with ``u = (2 (w >> 9) + 1) * 2**-24`` (odd multiples of 2**-24, exact in float32). ``t = a + pi`` with
        ``a = 2 pi (ub - 1/2)`` in (-pi, pi), where the hardware sin/cos are accurate to ~1e-6 absolute, so
        ``cos t = -cos a`` and ``sin t = -sin a``: the pair is returned negated, ``(r cos a, r sin a)``, and the caller
        scales by minus the noise scale. ``FAST_MATH``: ``ln ua`` from the hardware ``log2``, ``ua`` and ``a`` each
        one multiply-add."""
        if FAST_MATH:
            ua = tl.fma((wa >> 9).to(tl.float32), 1.1920928955078125e-07, 5.960464477539063e-08)
            # max(, 0): the approximate log2 of a u just below 1 could come out a hair above 0.
            radius = tl.sqrt(tl.maximum(_lg2(ua) * -1.3862943611198906, 0.0))  # -2 ln 2
            a = tl.fma((wb >> 9).to(tl.float32), 7.490140565847857e-07, -3.1415922790827646)
        else:
            ua = ((wa >> 9).to(tl.float32) * 2.0 + 1.0) * 5.960464477539063e-08
            ub = ((wb >> 9).to(tl.float32) * 2.0 + 1.0) * 5.960464477539063e-08
            radius = tl.sqrt(-2.0 * tl.log(ua))
            a = (ub - 0.5) * 6.283185307179586
        return radius * _approx(a, "cos"), radius * _approx(a, "sin")

    @triton.jit
    def _signed_lg2(k):
        """``-sign(k) * log2(1 - |k| * 2**-24)`` (> 0 for k > 0) for the odd integer ``k`` in float32."""
        lg = _lg2(tl.fma(tl.abs(k), -5.960464477539063e-08, 1.0))
        return tl.where(k < 0, lg, -lg)

    @triton.jit
    def _noise_quad(w0, w1, w2, w3, GAUSSIAN: tl.constexpr, LAPLACE: tl.constexpr, FAST_MATH: tl.constexpr):
        """The unit noise of one quad's four words, to be multiplied by the per-token factor ``_scale_factor`` gives.
        Uniform: the odd integer ``k = 2 * (w >> 8) - (2**24 - 1)`` (exact in float32; the 2**-24 of the symmetric
        uniform ``k * 2**-24`` is in the factor, which rounds exactly like the reference's ``(k * 2**-24) *
        scale``). Laplace: ``sign(v) * -ln(1 - |v|)`` of that uniform, or with ``FAST_MATH`` ``sign(k) * -log2(1 -
        |v|)`` (the ``ln 2`` in the factor), ``1 - |v|`` exact either way."""
        if GAUSSIAN:
            n0, n1 = _gaussian_pair(w0, w1, FAST_MATH)
            n2, n3 = _gaussian_pair(w2, w3, FAST_MATH)
        else:
            n0 = tl.fma((w0 >> 8).to(tl.float32), 2.0, -16777215.0)
            n1 = tl.fma((w1 >> 8).to(tl.float32), 2.0, -16777215.0)
            n2 = tl.fma((w2 >> 8).to(tl.float32), 2.0, -16777215.0)
            n3 = tl.fma((w3 >> 8).to(tl.float32), 2.0, -16777215.0)
            if LAPLACE:
                if FAST_MATH:
                    n0 = _signed_lg2(n0)
                    n1 = _signed_lg2(n1)
                    n2 = _signed_lg2(n2)
                    n3 = _signed_lg2(n3)
                else:
                    n0, n1, n2, n3 = _laplace(n0), _laplace(n1), _laplace(n2), _laplace(n3)
        return n0, n1, n2, n3

    @triton.jit
    def _scale_factor(noise_scale, GAUSSIAN, LAPLACE, FAST_MATH):
        """The per-token factor of ``_noise_quad``'s units: ``-scale`` (Gaussian, its pairs negated), ``scale *
        ln 2`` (fast Laplace), ``scale`` (Laplace) or ``scale * 2**-24`` (uniform)."""
        if GAUSSIAN:
            factor = -noise_scale
        elif LAPLACE:
            if FAST_MATH:
                factor = noise_scale * 0.6931471805599453
            else:
                factor = noise_scale
        else:
            factor = noise_scale * 5.960464477539063e-08
        return factor

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
            n0, n1, n2, n3 = _noise_quad(w0, w1, w2, w3, GAUSSIAN, LAPLACE, FAST_MATH)
            # [R, Q, 2, 2] with [..., k, l] = n(2k + l), flattened row-major: n0, n1, n2, n3 per quad.
            unit = tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), (BLOCK_ROWS, 4 * BLOCK_QUADS))

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


def _default_config(hidden: int) -> tuple[int, int, int, int]:
    """(token rows per program, hidden elements per step, warps, steps per program): 4 rows x 512 elements for 4
    warps, the fastest of the configurations an H200 sweep tried at h = 2048, 4096 and 8192 (benchmarks/RESULTS.md),
    and up to 4 steps along the hidden dimension per program, so that a row's indices and loads serve 2,048 elements."""
    block_hidden = min(512, max(16, 1 << (hidden - 1).bit_length()))
    steps = max(1, min(4, hidden // block_hidden))
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
    block_rows, block_hidden, num_warps, steps = config or _default_config(hidden)
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
