"""The noise layer on CUDA (fused kernel where it applies) against the CPU reference, for every mechanism."""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
from nemo_noise_plugin.noise.families import NOISE_FAMILIES
from nemo_noise_plugin.noise.geometry import NoiseBatchInputs
from nemo_noise_plugin.noise.layer import EmbeddingNoise
from nemo_noise_plugin.noise.schedule import NoiseClock

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ, BATCH, HIDDEN = 128, 4, 256
MECHANISMS = {
    "neftune": NoiseConfig(alpha=5.0),
    "gaussian_response": NoiseConfig(mechanism="gaussian", sigma=2.0, tokens="response", special_token_ids=[3]),
    "metric_dp": NoiseConfig(mechanism="metric_dp", eta=100.0, clip_norm=1.0),
    "gaussian_mechanism": NoiseConfig(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=8.0),
    "quantization": NoiseConfig(mechanism="quantization", quantization_step=0.05),
    "relative": NoiseConfig(mechanism="relative", relative_scale=0.1),
    "laplace": NoiseConfig(mechanism="laplace", laplace_scale=0.05, clip_norm=10.0),
    **{f"family_{name}": load_noise_config(family.preset) for name, family in NOISE_FAMILIES.items()},
}


ALL_ROWS = slice(None)


def _inputs(device: str, rows: slice = ALL_ROWS) -> NoiseBatchInputs:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (BATCH, SEQ), generator=generator)
    loss_mask = torch.zeros(BATCH, SEQ)
    for row, (prompt, length) in enumerate(((10, 128), (20, 100), (5, 64), (40, 41))):
        loss_mask[row, prompt - 1 : length] = 1
    return NoiseBatchInputs(loss_mask=loss_mask[rows].to(device), input_ids=tokens[rows].to(device))


def _noised(config: NoiseConfig, x: torch.Tensor, inputs: NoiseBatchInputs, clock: NoiseClock) -> torch.Tensor:
    return EmbeddingNoise(config, sequence_parallel=False, pg_collection=None)(x, inputs, clock)


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_cuda_noise_matches_the_cpu_reference(name):
    config = MECHANISMS[name]
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1))
    clock = NoiseClock(iteration=7)
    cpu = _noised(config, x, _inputs("cpu"), clock) - x
    cuda = _noised(config, x.cuda(), _inputs("cuda"), clock).cpu() - x
    scale = cpu.abs().max().item()
    # Uniform words are bit-identical; Gaussian and Laplace values go through CUDA's log/cos instead of the CPU's.
    assert torch.allclose(cuda, cpu, rtol=0, atol=1e-5 * scale + 1e-6), (cuda - cpu).abs().max().item()
    assert torch.equal(cuda == 0, cpu == 0), "the same tokens are noised"


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_microbatch_split_on_cuda_is_bit_identical(name):
    config = MECHANISMS[name]
    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    clock = NoiseClock()
    clock.start_iteration(3)
    whole = _noised(config, x, _inputs("cuda"), clock)
    pieces = []
    for first in range(0, BATCH, 2):
        pieces.append(_noised(config, x[:, first : first + 2], _inputs("cuda", slice(first, first + 2)), clock))
        clock.advance(num_microbatches=BATCH // 2)
    assert torch.equal(torch.cat(pieces, dim=1), whole)


def test_bf16_input_keeps_its_dtype_and_the_gradient_is_the_identity():
    generator = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator, requires_grad=True)
    out = _noised(MECHANISMS["neftune"], x, _inputs("cuda"), NoiseClock())
    assert out.dtype == torch.bfloat16
    grad = torch.randn(out.shape, dtype=out.dtype, device="cuda", generator=generator)
    out.backward(grad)
    assert torch.equal(x.grad, grad)
