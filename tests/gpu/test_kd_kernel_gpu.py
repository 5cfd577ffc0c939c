"""The fused Triton CE + KL kernels against the torch reference of ``distillation.kd_kernel`` (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.distillation import cross_entropy_and_forward_kl, kd_kernel
from nemo_noise_plugin.noise.triton_kernel import triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton"),
]


def _inputs(tokens: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    student = (4 * torch.randn(tokens, vocab, generator=generator)).to(dtype).cuda()
    teacher = (4 * torch.randn(tokens, vocab, generator=generator)).to(dtype).cuda()
    labels = torch.randint(-vocab // 4, vocab + vocab // 4, (tokens,), generator=generator).cuda()  # some unowned
    return student, teacher, labels


@pytest.mark.parametrize("vocab", [32768, 50257, 1000])  # a multiple of the block, an odd size, one partial block
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_statistics_and_gradient_equal_the_torch_reference(vocab, temperature, dtype):
    student, teacher, labels = _inputs(96, vocab, dtype)
    assert kd_kernel.use_kd_kernel(student)
    fused = kd_kernel._statistics_triton(student, teacher, labels, temperature)
    reference = kd_kernel._statistics_torch(student, teacher, labels, temperature)
    for name, ours, theirs in zip(fused._fields, fused, reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=1e-4, msg=name)
    generator = torch.Generator(device="cuda").manual_seed(1)  # its own stream: the same draws in any test order
    lse = tuple(torch.randn(96, device="cuda", generator=generator) + 10 for _ in range(3))
    ce_weight = torch.rand(96, device="cuda", generator=generator)
    kd_weight = torch.rand(96, device="cuda", generator=generator)
    ours = kd_kernel._gradient_triton(student, teacher, labels, temperature, lse, ce_weight, kd_weight)
    theirs = kd_kernel._gradient_torch(student, teacher, labels, temperature, lse, ce_weight, kd_weight)
    assert ours.dtype == dtype
    tolerance = dict(rtol=1.6e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours, theirs, **tolerance)


def test_the_loss_on_cuda_matches_the_float64_cpu_loss():
    student, teacher, labels = _inputs(4 * 512, 32768, torch.bfloat16, seed=1)
    labels = labels.clamp(0, 32767)
    weights = torch.rand(4, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    cuda_student = student.reshape(4, 512, -1).clone().requires_grad_()
    ce, kd = cross_entropy_and_forward_kl(cuda_student, teacher.reshape(4, 512, -1), labels.reshape(4, 512), 2.0)
    (ce * weights + kd * weights.flip(1)).sum().backward()
    cpu_student = student.reshape(4, 512, -1).double().cpu().requires_grad_()
    cpu_teacher, cpu_labels = teacher.reshape(4, 512, -1).double().cpu(), labels.reshape(4, 512).cpu()
    expected_ce, expected_kd = cross_entropy_and_forward_kl(cpu_student, cpu_teacher, cpu_labels, 2.0)
    (expected_ce * weights.double().cpu() + expected_kd * weights.flip(1).double().cpu()).sum().backward()
    torch.testing.assert_close(ce.double().cpu(), expected_ce, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kd.double().cpu(), expected_kd, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cuda_student.grad.double().cpu(), cpu_student.grad, rtol=1.6e-2, atol=1e-6)
