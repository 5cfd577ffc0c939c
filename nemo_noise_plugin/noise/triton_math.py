"""The Triton kernel's element-wise device functions: Philox4x32-10, the noise families' transforms of its words, and
the special functions they need, each written so that the kernel stays in one register layout.

``device_functions()`` builds them once (Triton is imported lazily, as in ``noise/triton_kernel.py``) and returns
them by name: the kernel calls them, and the GPU tests check ``logf`` against libdevice's over every input the kernel
gives it. Three rules learnt from the compiled code (sm_90 SASS, benchmarks/SFT_THROUGHPUT.md):

- ``tl.sqrt`` and ``tl.log`` in the Box-Muller chain made Triton compute the Philox words in another register layout
  than the output's and move every unit through shared memory (two barriers a step); the same instructions as inline
  assembly (``_instruction``) or written out (``logf``) keep one layout.
- libdevice's ``logf`` checks for subnormal, zero, infinite and NaN inputs; the kernel's inputs (odd multiples of
  2**-24 in (0, 1)) are none of them, so ``logf`` here is its arithmetic alone, the same bits in that domain.
- A sign taken from an odd integer ``k`` is one xor of sign bits (``flip_sign``), not a compare, negation and select.
"""

from __future__ import annotations

import functools
import types


@functools.cache
def device_functions() -> types.SimpleNamespace:
    """Build (once) the ``@triton.jit`` device functions; returns those called from outside (by the kernel, and
    ``logf`` by its GPU test), by name without the leading underscore."""
    import triton
    import triton.language as tl

    @triton.jit
    def _instruction(x, OPCODE: tl.constexpr):
        """One PTX instruction ``OPCODE`` on float32 ``x``: the hardware ``sin.approx``/``cos.approx`` (accurate to
        ~1e-6 absolute on [-pi, pi]), ``lg2.approx`` (absolute error ~2**-22, so its relative error grows as ``x``
        nears 1) and ``sqrt.approx``, the instruction ``tl.sqrt`` emits. Inline assembly, because with ``tl.sqrt``
        (and with ``tl.log``) in the Box-Muller chain Triton computed the Philox words in another register layout
        than the output's and moved every unit through shared memory, two barriers a step
        (benchmarks/SFT_THROUGHPUT.md). ``.ftz`` (no subnormal-input handling) gives the same values for the normal
        inputs they get here (>= 2**-24)."""
        return tl.inline_asm_elementwise(OPCODE + " $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _logf(x):
        """libdevice's float32 ``logf`` (``__nv_logf``, what ``tl.log`` calls) for positive normal finite ``x``,
        operation for operation: the same bits in that domain (tested over every input the kernel can give it),
        without its branches for subnormal, zero, infinite and NaN inputs, which the kernel's inputs (odd
        multiples of 2**-24 in (0, 1)) never are."""
        bits = x.to(tl.int32, bitcast=True)
        exponent_bits = (bits - 0x3F2AAAAB) & -8388608  # the exponent that puts the mantissa in [2/3, 4/3)
        f = (bits - exponent_bits).to(tl.float32, bitcast=True) - 1.0
        exponent = exponent_bits.to(tl.float32) * 1.1920928955078125e-07  # 2**-23, exact
        p = tl.fma(f, -0.13018856942653656, 0.1408461034297943)
        p = tl.fma(p, f, -0.12148627638816833)
        p = tl.fma(p, f, 0.1398061066865921)
        p = tl.fma(p, f, -0.16684235632419586)
        p = tl.fma(p, f, 0.20012299716472626)
        p = tl.fma(p, f, -0.24999669194221497)
        p = tl.fma(p, f, 0.333331823348999)
        p = tl.fma(p, f, -0.5)
        return tl.fma(exponent, 0.6931471824645996, tl.fma(f * p, f, f))

    @triton.jit
    def _flip_sign(value, k, FLIP: tl.constexpr):
        """``value`` with its sign bit xor-ed with ``k``'s (and flipped once more with ``FLIP``): one bitwise
        operation where ``tl.where(k < 0, ..)`` takes a compare, a negation and a select."""
        sign = k.to(tl.uint32, bitcast=True) & 0x80000000
        if FLIP:
            sign = sign ^ 0x80000000
        return (value.to(tl.uint32, bitcast=True) ^ sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _laplace(k, FAST_MATH: tl.constexpr):
        """Laplace(0, 1) of the symmetric uniform ``v = k * 2**-24`` (``k`` an odd integer held in float32), ``1 -
        |v|`` one exact multiply-add, the sign applied by ``_flip_sign``: ``sign(v) * -ln(1 - |v|)`` with
        libdevice's float32 ``logf`` (``ln(1 - |v|) < 0``, so the bits are those of a negate-and-select), or with
        ``FAST_MATH`` ``sign(v) * log2(1 - |v|)`` from the hardware ``log2`` (the factor carries ``-ln 2``)."""
        one_minus_magnitude = tl.fma(tl.abs(k), -5.960464477539063e-08, 1.0)
        if FAST_MATH:
            unit = _flip_sign(_instruction(one_minus_magnitude, "lg2.approx.ftz.f32"), k, False)
        else:
            unit = _flip_sign(_logf(one_minus_magnitude), k, True)
        return unit

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
        ub``, with ``u = (2 (w >> 9) + 1) * 2**-24`` (odd multiples of 2**-24, each one exact multiply-add in
        float32). ``t = a + pi`` with ``a = 2 pi (ub - 1/2)`` in (-pi, pi), where the hardware sin/cos are accurate to
        ~1e-6 absolute, so ``cos t = -cos a`` and ``sin t = -sin a``: the pair is returned negated, ``(r cos a, r sin
        a)``, and the caller scales by minus the noise scale. ``FAST_MATH``: ``ln ua`` from the hardware ``log2``,
        ``a`` one multiply-add (the exact kernel rounds ``ub - 1/2``, exact, then its product with 2 pi)."""
        ua = tl.fma((wa >> 9).to(tl.float32), 1.1920928955078125e-07, 5.960464477539063e-08)
        if FAST_MATH:
            # max(, 0): the approximate log2 of a u just below 1 could come out a hair above 0.
            log2_u = _instruction(ua, "lg2.approx.ftz.f32")
            radius = _instruction(tl.maximum(log2_u * -1.3862943611198906, 0.0), "sqrt.approx.ftz.f32")  # -2 ln 2
            a = tl.fma((wb >> 9).to(tl.float32), 7.490140565847857e-07, -3.1415922790827646)
        else:
            radius = _instruction(-2.0 * _logf(ua), "sqrt.approx.ftz.f32")
            a = tl.fma((wb >> 9).to(tl.float32), 1.1920928955078125e-07, -0.4999999403953552) * 6.283185307179586
        return radius * _instruction(a, "cos.approx.f32"), radius * _instruction(a, "sin.approx.f32")

    @triton.jit
    def _noise_quad(w0, w1, w2, w3, GAUSSIAN: tl.constexpr, LAPLACE: tl.constexpr, FAST_MATH: tl.constexpr):
        """The unit noise of one quad's four words as ``[R, Q, 2, 2]`` (``[..., k, l]`` the unit of word ``2k + l``;
        flattened, the quad's four hidden elements in order), to be multiplied by the per-token factor
        ``_scale_factor`` gives. Uniform: the odd integer ``k = 2 * (w >> 8) - (2**24 - 1)`` (exact in float32; the
        2**-24 of the symmetric uniform ``k * 2**-24`` is in the factor, which rounds exactly like the reference's
        ``(k * 2**-24) * scale``). Laplace: ``sign(v) * -ln(1 - |v|)`` of that uniform, or with ``FAST_MATH``
        ``sign(k) * log2(1 - |v|)`` (the ``-ln 2`` in the factor). Gaussian: the pairs ``(w0, w1)`` and ``(w2,
        w3)`` computed side by side as ``[R, Q, 2]`` tensors, one join at the end: with a join per pair Triton moved
        the units through shared memory (see ``_instruction``)."""
        if GAUSSIAN:
            cosines, sines = _gaussian_pair(tl.join(w0, w2), tl.join(w1, w3), FAST_MATH)
            unit = tl.join(cosines, sines)
        else:
            n0 = tl.fma((w0 >> 8).to(tl.float32), 2.0, -16777215.0)
            n1 = tl.fma((w1 >> 8).to(tl.float32), 2.0, -16777215.0)
            n2 = tl.fma((w2 >> 8).to(tl.float32), 2.0, -16777215.0)
            n3 = tl.fma((w3 >> 8).to(tl.float32), 2.0, -16777215.0)
            if LAPLACE:
                n0, n1 = _laplace(n0, FAST_MATH), _laplace(n1, FAST_MATH)
                n2, n3 = _laplace(n2, FAST_MATH), _laplace(n3, FAST_MATH)
            unit = tl.join(tl.join(n0, n2), tl.join(n1, n3))
        return unit

    @triton.jit
    def _scale_factor(noise_scale, GAUSSIAN, LAPLACE, FAST_MATH):
        """The per-token factor of ``_noise_quad``'s units: ``-scale`` (Gaussian, its pairs negated), ``-scale *
        ln 2`` (fast Laplace, its units negated), ``scale`` (Laplace) or ``scale * 2**-24`` (uniform)."""
        if GAUSSIAN:
            factor = -noise_scale
        elif LAPLACE:
            if FAST_MATH:
                factor = noise_scale * -0.6931471805599453
            else:
                factor = noise_scale
        else:
            factor = noise_scale * 5.960464477539063e-08
        return factor

    return types.SimpleNamespace(logf=_logf, philox=_philox, noise_quad=_noise_quad, scale_factor=_scale_factor)
