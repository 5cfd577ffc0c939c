"""The fused Triton noise kernel against the torch reference, on one CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.fused_noise import fused_add_noise
from nemo_noise_plugin.noise.philox import STREAM_NOISE, element_words, words_to_symmetric_uniform
from nemo_noise_plugin.noise.sampling import add_noise_reference, unit_noise
from nemo_noise_plugin.noise.triton_kernel import launch_add_noise, triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton"),
]

SEED = 2**32 + 1234  # reduced modulo 2**32, like the reference
ITERATION = 3_000_000_019  # above 2**31: the key word must be handled as unsigned 32-bit


def _inputs(seq: int, batch: int, hidden: int, dtype: torch.dtype, generator_seed: int = 0) -> dict:
    """Random x and per-token scales on the GPU, with global positions and sample indices far from zero."""
    gen = torch.Generator().manual_seed(generator_seed)
    noise_scale = torch.rand(seq, batch, generator=gen) * 0.5
    noise_scale[::5] = 0.0
    return {
        "x": (torch.randn(seq, batch, hidden, generator=gen) * 3).to(dtype).cuda(),
        "token_position": (torch.arange(seq, dtype=torch.int64) + 4_294_967_000).cuda(),  # crosses 2**32
        "sample_index": (torch.arange(batch, dtype=torch.int64) * 1_000_003 + 2_147_483_000).cuda(),
        "noise_scale": noise_scale.cuda(),
        "input_scale": (torch.rand(seq, batch, generator=gen) + 0.5).cuda(),
    }


def _kernel(inputs: dict, distribution: str = "uniform", with_input_scale: bool = True) -> torch.Tensor:
    return fused_add_noise(
        inputs["x"],
        seed=SEED,
        iteration=ITERATION,
        sample_index=inputs["sample_index"],
        token_position=inputs["token_position"],
        noise_scale=inputs["noise_scale"],
        input_scale=inputs["input_scale"] if with_input_scale else None,
        distribution=distribution,
    )


def _reference(inputs: dict, distribution: str = "uniform", with_input_scale: bool = True) -> torch.Tensor:
    cpu = {key: value.cpu() for key, value in inputs.items()}
    return add_noise_reference(
        cpu["x"],
        seed=SEED,
        iteration=ITERATION,
        sample_index=cpu["sample_index"],
        token_position=cpu["token_position"],
        noise_scale=cpu["noise_scale"],
        input_scale=cpu["input_scale"] if with_input_scale else None,
        distribution=distribution,
    )


@pytest.mark.parametrize("hidden", [2048, 1000, 6])
def test_uniform_unit_noise_is_bit_identical_to_reference_words(hidden):
    seq, batch = 37, 3
    inputs = _inputs(seq, batch, hidden, torch.float32)
    inputs["x"] = torch.zeros_like(inputs["x"])
    inputs["noise_scale"] = torch.ones(seq, batch, device="cuda")
    unit = _kernel(inputs, with_input_scale=False).cpu()

    positions = inputs["token_position"].cpu().repeat_interleave(batch)
    samples = inputs["sample_index"].cpu().repeat(seq)
    words = element_words(SEED, ITERATION, samples, positions, hidden, STREAM_NOISE)
    expected = words_to_symmetric_uniform(words).view(seq, batch, hidden)
    assert torch.equal(unit, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_input_scale", [True, False])
def test_uniform_output_is_bit_identical_to_reference(dtype, with_input_scale):
    inputs = _inputs(64, 2, 4096, dtype)
    out = _kernel(inputs, with_input_scale=with_input_scale)
    assert out.dtype == dtype and out.shape == inputs["x"].shape
    assert torch.equal(out.cpu(), _reference(inputs, with_input_scale=with_input_scale))


def test_gaussian_unit_noise_matches_reference_to_float32_rounding():
    # The reference does Box-Muller in float64; the kernel in float32 with libdevice log/sqrt/cos/sin. The angle
    # 2*pi*u rounds to ~5e-7 and the radius is at most ~5.8, so 2e-5 absolute bounds the difference with margin.
    seq, batch, hidden = 64, 2, 2048
    inputs = _inputs(seq, batch, hidden, torch.float32)
    inputs["x"] = torch.zeros_like(inputs["x"])
    inputs["noise_scale"] = torch.ones(seq, batch, device="cuda")
    unit = _kernel(inputs, "gaussian", with_input_scale=False).cpu()
    expected = unit_noise(
        SEED, ITERATION, inputs["sample_index"].cpu(), inputs["token_position"].cpu(), hidden, "gaussian"
    )
    assert torch.isfinite(unit).all()
    assert (unit - expected).abs().max().item() < 2e-5
    assert abs(unit.std().item() - 1.0) < 0.01


def test_laplace_unit_noise_matches_reference_to_float32_rounding():
    # The reference inverts the CDF in float64; the kernel in float32 (1 - |v| exact, a float32 log). Values reach
    # 24 ln 2 = 16.6 (|v| = 1 - 2**-24), where one float32 ulp is ~2e-6.
    seq, batch, hidden = 64, 2, 2048
    inputs = _inputs(seq, batch, hidden, torch.float32)
    inputs["x"] = torch.zeros_like(inputs["x"])
    inputs["noise_scale"] = torch.ones(seq, batch, device="cuda")
    unit = _kernel(inputs, "laplace", with_input_scale=False).cpu()
    expected = unit_noise(
        SEED, ITERATION, inputs["sample_index"].cpu(), inputs["token_position"].cpu(), hidden, "laplace"
    )
    assert torch.isfinite(unit).all()
    assert ((unit - expected).abs() <= 1e-5 * expected.abs() + 2e-6).all(), (unit - expected).abs().max().item()
    assert abs(unit.std().item() - 2**0.5) < 0.02
    assert torch.equal(unit > 0, expected > 0)


def test_gaussian_output_matches_reference_in_bf16():
    inputs = _inputs(32, 2, 2048, torch.bfloat16)
    out = _kernel(inputs, "gaussian").cpu().float()
    ref = _reference(inputs, "gaussian").float()
    # At most one bf16 rounding step apart where the float32 sums straddle a rounding boundary.
    assert ((out - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()
    assert (out != ref).float().mean().item() < 1e-2


def test_zero_noise_scale_tokens_are_scaled_input_exactly():
    inputs = _inputs(16, 2, 512, torch.bfloat16)
    inputs["noise_scale"] = torch.zeros(16, 2, device="cuda")
    scaled = (inputs["x"].float() * inputs["input_scale"].unsqueeze(-1)).to(torch.bfloat16)
    assert torch.equal(_kernel(inputs), scaled)
    assert torch.equal(_kernel(inputs, with_input_scale=False), inputs["x"])


def test_zero_noise_scale_only_on_chosen_tokens():
    inputs = _inputs(16, 2, 512, torch.float32)
    inputs["noise_scale"] = torch.full((16, 2), 0.3, device="cuda")
    inputs["noise_scale"][3, 1] = 0.0
    out = _kernel(inputs, with_input_scale=False)
    assert torch.equal(out[3, 1], inputs["x"][3, 1])
    assert (out[3, 0] != inputs["x"][3, 0]).float().mean().item() > 0.99


@pytest.mark.parametrize("distribution", ["uniform", "gaussian", "laplace"])
def test_slice_of_tokens_and_samples_equals_slice_of_full_computation(distribution):
    """What TP/SP/CP/DP sharding does: each rank computes its slice with the slice's global indices."""
    inputs = _inputs(96, 4, 1024, torch.bfloat16)
    full = _kernel(inputs, distribution)
    # A context-parallel style zig-zag of token chunks and a data-parallel subset of samples.
    tokens = torch.cat([torch.arange(0, 16), torch.arange(80, 96)]).cuda()
    samples = torch.tensor([1, 3]).cuda()
    shard = {
        "x": inputs["x"][tokens][:, samples].contiguous(),
        "token_position": inputs["token_position"][tokens],
        "sample_index": inputs["sample_index"][samples],
        "noise_scale": inputs["noise_scale"][tokens][:, samples].contiguous(),
        "input_scale": inputs["input_scale"][tokens][:, samples].contiguous(),
    }
    assert torch.equal(_kernel(shard, distribution), full[tokens][:, samples])


def test_different_iterations_and_streams_of_keys_give_different_noise():
    inputs = _inputs(8, 2, 256, torch.float32)
    first = _kernel(inputs, with_input_scale=False)
    other = fused_add_noise(
        inputs["x"],
        seed=SEED,
        iteration=ITERATION + 1,
        sample_index=inputs["sample_index"],
        token_position=inputs["token_position"],
        noise_scale=inputs["noise_scale"],
    )
    noised = inputs["noise_scale"] > 0
    assert (first[noised] != other[noised]).float().mean().item() > 0.99


def test_gradient_flows_to_x_through_input_scale():
    inputs = _inputs(8, 2, 256, torch.bfloat16)
    x = inputs["x"].clone().requires_grad_(True)
    out = fused_add_noise(
        x,
        seed=SEED,
        iteration=ITERATION,
        sample_index=inputs["sample_index"],
        token_position=inputs["token_position"],
        noise_scale=inputs["noise_scale"],
        input_scale=inputs["input_scale"],
    )
    generator = torch.Generator(device="cuda").manual_seed(3)  # its own stream: the same draw in any test order
    grad = torch.randn(out.shape, dtype=out.dtype, device="cuda", generator=generator)
    out.backward(grad)
    assert torch.equal(x.grad, (grad.float() * inputs["input_scale"].unsqueeze(-1)).to(torch.bfloat16))


def test_every_element_is_written():
    inputs = _inputs(33, 3, 1000, torch.float32)  # row and hidden tails that do not fill a block
    out = _kernel(inputs)
    assert torch.isfinite(out).all()
    assert torch.equal(out.cpu(), _reference(inputs))


@pytest.mark.parametrize("distribution", ["uniform", "gaussian", "laplace"])
def test_kernel_philox_rounds_equal_triton_philox(distribution):
    """The kernel's own Philox rounds (one wide multiply per product) give tl.philox's words exactly."""
    inputs = _inputs(40, 2, 768, torch.float32)
    outs = []
    for tl_philox in (False, True):
        out = torch.full_like(inputs["x"], float("nan"))
        launch_add_noise(
            inputs["x"],
            out,
            seed=SEED,
            iteration=ITERATION,
            sample_index=inputs["sample_index"],
            token_position=inputs["token_position"],
            noise_scale=inputs["noise_scale"],
            input_scale=inputs["input_scale"],
            distribution=distribution,
            tl_philox=tl_philox,
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
