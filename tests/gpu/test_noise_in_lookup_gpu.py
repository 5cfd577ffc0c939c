"""The lookup with the noise in one kernel pass (issue 34, item 3) against today's kernel and the float64 reference.

``fused_gather_add_noise`` reads the embedding table's rows and writes the noised ``[s, b, h]`` decoder input: the
output must be bit-identical to today's two-step path (Megatron's lookup and transposed copy, then
``fused_add_noise``) for every family the kernel draws, agree with the CPU reference (uniform exactly, Gaussian and
Laplace to float32 rounding), give the table the plain lookup's gradient, and never make the host wait (with the
deferred finiteness check reading the table). One CUDA device; skipped without one. Needs no Megatron wheels.
"""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.fused_noise import fused_add_noise, fused_gather_add_noise
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.sampling import lookup_with_noise_reference
from nemo_noise_plugin.noise.schedule import NoiseClock
from nemo_noise_plugin.validation import SettingError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEED, ITERATION = 1234, 77
FAMILIES = ("uniform", "gaussian", "laplace")


def _inputs(seq: int, batch: int, hidden: int, vocab: int, dtype: torch.dtype, scale: float = 0.3) -> dict:
    gen = torch.Generator().manual_seed(seq * 31 + hidden)
    ids = torch.randint(0, vocab, (batch, seq + 5), generator=gen)[:, 2 : seq + 2]  # strided, repeated ids
    ids[:, : seq // 4] = ids[0, 0]  # many repeats of one row: the gradient's summation order matters
    return {
        "weight": torch.randn(vocab, hidden, generator=gen).to(dtype).cuda(),
        "input_ids": ids.cuda(),
        "sample_index": (torch.arange(batch) + 1000).cuda(),
        "token_position": (torch.arange(seq) + 64).cuda(),
        "noise_scale": (torch.rand(seq, batch, generator=gen) * scale).cuda(),
    }


def _noise_arguments(inputs: dict, distribution: str) -> dict:
    return {
        "seed": SEED,
        "iteration": ITERATION,
        "sample_index": inputs["sample_index"],
        "token_position": inputs["token_position"],
        "noise_scale": inputs["noise_scale"],
        "distribution": distribution,
    }


def _two_step(weight: torch.Tensor, inputs: dict, distribution: str) -> torch.Tensor:
    """Today's path: Megatron's lookup, its transposed contiguous copy, then the noise kernel."""
    looked_up = torch.nn.functional.embedding(inputs["input_ids"], weight).transpose(0, 1).contiguous()
    return fused_add_noise(looked_up, input_scale=None, **_noise_arguments(inputs, distribution))


@pytest.mark.parametrize("distribution", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("seq", "batch", "hidden"), [(37, 3, 576), (128, 2, 2048), (9, 5, 6)])
def test_one_pass_output_is_bit_identical_to_the_two_step_kernel_path(distribution, dtype, seq, batch, hidden):
    inputs = _inputs(seq, batch, hidden, 4099, dtype)
    fused = fused_gather_add_noise(inputs["weight"], inputs["input_ids"], **_noise_arguments(inputs, distribution))
    assert fused.shape == (seq, batch, hidden) and fused.dtype == dtype and fused.is_contiguous()
    assert torch.equal(fused, _two_step(inputs["weight"], inputs, distribution))


@pytest.mark.parametrize("distribution", FAMILIES)
def test_one_pass_output_matches_the_float64_reference(distribution):
    inputs = _inputs(64, 3, 1024, 5000, torch.float32, scale=1.0)
    fused = fused_gather_add_noise(inputs["weight"], inputs["input_ids"], **_noise_arguments(inputs, distribution))
    cpu = {key: value.cpu() for key, value in inputs.items()}
    reference = lookup_with_noise_reference(cpu["weight"], cpu["input_ids"], **_noise_arguments(cpu, distribution))
    difference = (fused.cpu() - reference).abs().max().item()
    if distribution == "uniform":
        assert difference == 0.0
    else:  # float32 Box-Muller / log against float64 (test_noise_kernel_gpu.py's bounds); Laplace's tail reaches 16.6
        assert difference < (2e-5 if distribution == "gaussian" else 2e-4)
    assert (fused.cpu() - cpu["weight"][cpu["input_ids"]].transpose(0, 1)).std().item() > 0.1  # noise was added


@pytest.mark.parametrize(("distribution", "bound"), [("gaussian", 1e-3), ("laplace", 5e-5)])
def test_fast_math_stays_near_the_float64_reference_in_one_pass_and_two_steps(distribution, bound):
    """``fast_math`` (``NoiseConfig.fast_math``): other bits than the exact kernel's, the same in one pass and in two
    steps, near the float64 reference: the hardware log2's ~2**-22 absolute error moves Box-Muller's radius by up to
    a few 1e-4 where u nears 1 (the radius there is ~3e-4), Laplace's magnitude by ~1e-7 relative."""
    inputs = _inputs(64, 3, 1024, 5000, torch.float32, scale=1.0)
    arguments = _noise_arguments(inputs, distribution)
    fast = fused_gather_add_noise(inputs["weight"], inputs["input_ids"], fast_math=True, **arguments)
    looked_up = torch.nn.functional.embedding(inputs["input_ids"], inputs["weight"]).transpose(0, 1).contiguous()
    assert torch.equal(fast, fused_add_noise(looked_up, fast_math=True, **arguments))
    assert not torch.equal(fast, fused_gather_add_noise(inputs["weight"], inputs["input_ids"], **arguments))
    assert torch.isfinite(fast).all()
    cpu = {key: value.cpu() for key, value in inputs.items()}
    reference = lookup_with_noise_reference(cpu["weight"], cpu["input_ids"], **_noise_arguments(cpu, distribution))
    assert (fast.cpu() - reference).abs().max().item() < bound


@pytest.mark.parametrize("distribution", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_table_gets_the_plain_lookups_gradient(distribution, dtype):
    inputs = _inputs(128, 4, 576, 4099, dtype)
    upstream = torch.randn(128, 4, 576, device="cuda", dtype=dtype)

    def gradient(fused: bool) -> torch.Tensor:
        weight = inputs["weight"].clone().requires_grad_(True)
        if fused:
            out = fused_gather_add_noise(weight, inputs["input_ids"], **_noise_arguments(inputs, distribution))
        else:
            out = _two_step(weight, inputs, distribution)
        out.backward(upstream)
        return weight.grad

    unfused, fused = gradient(False), gradient(True)
    if torch.equal(unfused, gradient(False)):  # the card's embedding backward is deterministic: require bits
        assert torch.equal(fused, unfused)
    torch.testing.assert_close(fused, unfused)


def _layer(config: NoiseConfig) -> EmbeddingNoise:
    return EmbeddingNoise(
        config, sequence_parallel=False, pg_collection=None, megatron_groups=False, defer_finite_check=True
    )


def _batch(seq: int, lengths: list[int], ids: torch.Tensor) -> NoiseBatchInputs:
    padding = torch.arange(seq)[None, :] >= torch.tensor(lengths)[:, None]
    return NoiseBatchInputs(padding_mask=padding.cuda(), input_ids=ids)


@pytest.mark.parametrize(
    "config",
    [
        NoiseConfig(alpha=5.0),
        NoiseConfig(mechanism="gaussian", sigma=0.5, scaling="absolute"),
        NoiseConfig(mechanism="metric_dp", eta=50.0, special_token_ids=[0, 2]),  # the torch path: no kernel draws it
    ],
    ids=["neftune", "gaussian", "metric-dp-special-ids"],
)
def test_the_layers_noised_lookup_never_syncs_and_equals_noise_on_the_lookup(config):
    seq, batch, hidden = 128, 4, 576
    inputs = _inputs(seq, batch, hidden, 49152, torch.bfloat16)
    weight = inputs["weight"].requires_grad_(True)
    ids = inputs["input_ids"]
    noise_batch = _batch(seq, [128, 100, 64, 17], ids)
    layer, clock = _layer(config), NoiseClock()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for iteration in range(3):
            clock.start_iteration(iteration)
            for _ in range(2):
                noised = layer.noised_lookup(weight, ids, noise_batch, clock)
                noised.float().square().sum().backward()
                clock.advance(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    clock.start_iteration(2)
    clock.advance(2)  # the last forward's (iteration, microbatch)
    with torch.no_grad():
        looked_up = torch.nn.functional.embedding(ids, weight).transpose(0, 1).contiguous()
        assert torch.equal(noised, _layer(config)(looked_up, noise_batch, clock))


def test_an_overflow_in_the_lookup_stops_the_run_naming_its_iteration():
    # Past the bound check_noise_fits refuses when a model is built; the layer alone does not check it.
    config = NoiseConfig(mechanism="gaussian", sigma=3e38, scaling="absolute")
    inputs = _inputs(16, 2, 64, 100, torch.bfloat16)
    layer, clock = _layer(config), NoiseClock()
    noise_batch = _batch(16, [16, 16], inputs["input_ids"])
    clock.start_iteration(3)
    layer.noised_lookup(inputs["weight"], inputs["input_ids"], noise_batch, clock)
    torch.cuda.synchronize()
    clock.start_iteration(4)
    with pytest.raises(SettingError, match="at iteration 3 they hold inf or NaN; training stopped"):
        layer.noised_lookup(inputs["weight"], inputs["input_ids"], noise_batch, clock)
