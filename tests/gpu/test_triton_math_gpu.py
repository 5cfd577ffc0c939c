"""The kernel's written-out ``logf`` against libdevice's, on one CUDA device (skipped without one).

``noise/triton_math.py``'s ``logf`` is libdevice's ``__nv_logf`` without its special-input branches; the exact
Gaussian and Laplace kernels keep their bits only if the two agree bit for bit wherever the kernel calls it: on every
odd multiple of 2**-24 in (0, 1) (``u`` of Box-Muller and ``1 - |v|`` of Laplace are exactly these 2**23 numbers).
"""

from __future__ import annotations

import functools

import pytest
import torch

from nemo_noise_plugin.noise.triton_kernel import triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton"),
]

BLOCK = 1024


@functools.cache
def _logf_pair_kernel():
    """A kernel writing ``(logf(x), tl.log(x))`` as int32 bits for float32 inputs ``x``."""
    import triton
    import triton.language as tl

    from nemo_noise_plugin.noise.triton_math import device_functions

    logf = device_functions().logf

    @triton.jit
    def logf_pair(x_ptr, ours_ptr, theirs_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask, other=1.0)
        tl.store(ours_ptr + offsets, logf(x).to(tl.int32, bitcast=True), mask=mask)
        tl.store(theirs_ptr + offsets, tl.log(x).to(tl.int32, bitcast=True), mask=mask)

    return logf_pair


def _both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ours, theirs = torch.empty_like(x, dtype=torch.int32), torch.empty_like(x, dtype=torch.int32)
    _logf_pair_kernel()[(x.numel() + BLOCK - 1) // BLOCK,](x, ours, theirs, x.numel(), BLOCK=BLOCK)
    return ours, theirs


def test_logf_has_libdevice_bits_on_every_input_the_kernel_gives_it():
    # (2 m + 1) * 2**-24 for m < 2**23: exact in float32 (and in float64 before the cast)
    odd = torch.arange(2**23, dtype=torch.float64, device="cuda") * 2 + 1
    x = (odd * 2.0**-24).to(torch.float32)
    ours, theirs = _both(x)
    differing = (ours != theirs).sum().item()
    assert differing == 0, f"{differing} of {x.numel()} inputs differ, first at x = {x[ours != theirs][:4].tolist()}"
    # a sanity check that the comparison compares logarithms
    assert torch.allclose(ours.view(torch.float32).double(), x.double().log(), rtol=2e-7, atol=1e-7)


def test_logf_has_libdevice_bits_on_positive_normal_floats():
    # the docstring's wider claim: every positive normal finite float32 (a random 2**22 of them, all exponents)
    generator = torch.Generator(device="cuda").manual_seed(0)
    bits = torch.randint(0x00800000, 0x7F800000, (2**22,), generator=generator, device="cuda", dtype=torch.int32)
    x = bits.view(torch.float32)
    ours, theirs = _both(x)
    assert torch.equal(ours, theirs)
