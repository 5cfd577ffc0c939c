"""Replayable noise under a real CUDA graph (issue 34: what full-iteration graphs need before they can carry noise).

A graph is captured over two microbatches of the replayable noise layer at one iteration; each later replay, after
``publish_step`` for its iteration, must give exactly the eager layer's noise for that iteration (the Triton kernel
reading its iteration key from device memory, and the torch path of metric-DP), the fused lookup too; an overflow
inside the graph must stop the run outside it, naming its iteration; publishing and replaying never syncs. One CUDA
device; skipped without one. Needs no Megatron wheels.
"""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.schedule import NoiseClock
from nemo_noise_plugin.validation import SettingError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ, BATCH, HIDDEN, VOCAB = 128, 4, 576, 49152  # SmolLM2-135M's hidden size and vocabulary

CONFIGS = {
    "neftune": NoiseConfig(alpha=5.0),
    "neftune_cosine_warmup": NoiseConfig(alpha=5.0, schedule="cosine", warmup_steps=3, decay_steps=6, min_factor=0.2),
    "gaussian_prompt": NoiseConfig(mechanism="gaussian", sigma=0.5, scaling="absolute", tokens="prompt"),
    "laplace_special_ids": NoiseConfig(mechanism="laplace", laplace_scale=0.05, special_token_ids=[0, 2]),
    "metric_dp": NoiseConfig(mechanism="metric_dp", eta=50.0),
}


def _batch() -> NoiseBatchInputs:
    generator = torch.Generator().manual_seed(3)
    padding = torch.arange(SEQ)[None, :] >= torch.tensor([128, 100, 64, 17])[:, None]
    loss_mask = (~padding).float()
    loss_mask[:, :16] = 0.0  # a prompt
    return NoiseBatchInputs(
        loss_mask=loss_mask.cuda(),
        padding_mask=padding.cuda(),
        input_ids=torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).cuda(),
    )


def _layer(config: NoiseConfig, replayable: bool) -> EmbeddingNoise:
    return EmbeddingNoise(
        config,
        sequence_parallel=False,
        pg_collection=None,
        megatron_groups=False,
        defer_finite_check=not replayable,
        replayable=replayable,
    )


def _two_microbatches(layer, clock, forward) -> list[torch.Tensor]:
    outputs = []
    for _ in range(2):
        outputs.append(forward(layer, clock))
        clock.advance(2)
    return outputs


def _capture(layer, clock, forward, iteration: int) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """Warm up (eager, iteration 0) on a side stream, then capture two microbatches at ``iteration``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        clock.start_iteration(0)
        _two_microbatches(layer, clock, forward)
    torch.cuda.current_stream().wait_stream(side)
    clock.start_iteration(iteration)
    layer.publish_step(clock, torch.device("cuda", torch.cuda.current_device()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = _two_microbatches(layer, clock, forward)
    return graph, static_outputs


def _output_forward(embedded, batch):
    return lambda layer, clock: layer(embedded, batch, clock)


def _lookup_forward(table, batch):
    return lambda layer, clock: layer.noised_lookup(table, batch.input_ids, batch, clock)


@pytest.mark.parametrize("path", ["output", "lookup"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_replay_adds_its_own_iterations_noise_bit_for_bit(name, path):
    config = CONFIGS[name]
    batch = _batch()
    torch.manual_seed(0)
    if path == "output":
        forward = _output_forward(torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16), batch)
    else:
        forward = _lookup_forward(torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16), batch)
    layer, clock = _layer(config, True), NoiseClock()
    graph, static_outputs = _capture(layer, clock, forward, iteration=1)
    eager_layer = _layer(config, False)
    seen = []
    for iteration in (2, 5, 1, 9, 2**33 + 4):
        clock.start_iteration(iteration)
        layer.publish_step(clock, static_outputs[0].device)
        graph.replay()
        eager_clock = NoiseClock()
        eager_clock.start_iteration(iteration)
        expected = _two_microbatches(eager_layer, eager_clock, forward)
        for replayed, eager in zip(static_outputs, expected, strict=True):
            assert torch.equal(replayed, eager), (iteration, name, path)
        seen.append(static_outputs[0].clone())
    assert all(not torch.equal(seen[0], other) for other in seen[1:])  # each iteration its own noise: nothing froze


def test_publishing_and_replaying_never_sync_and_an_overflow_in_the_graph_stops_the_run_naming_its_iteration():
    batch = _batch()
    embedded = torch.full((SEQ, BATCH, HIDDEN), 10.0, device="cuda")
    finite = NoiseConfig(mechanism="relative", relative_scale=0.1)
    layer, clock = _layer(finite, True), NoiseClock()
    graph, static_outputs = _capture(layer, clock, _output_forward(embedded, batch), iteration=1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
    try:
        for iteration in range(2, 6):
            clock.start_iteration(iteration)
            layer.publish_step(clock, embedded.device)
            graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(static_outputs[0]).all() and int(layer.replayable_step.overflow_at) == 0

    # The same graph over an embedding that overflows under the captured scale from iteration 7 on.
    stopped = None
    for iteration in range(6, 12):
        if iteration == 7:
            embedded.fill_(3e38)  # the RMS of rows of 3e38 overflows float32: the relative noise is inf
        clock.start_iteration(iteration)
        try:
            layer.publish_step(clock, embedded.device)
        except SettingError as error:
            stopped = (iteration, str(error))
            break
        graph.replay()
        torch.cuda.synchronize()  # the flag's copy lands before the next publish reads it
    assert stopped is not None, "the overflow was never raised"
    assert stopped[0] == 9  # recorded at 7, copied at 8's publish, read at 9's: one step late
    assert "at iteration 7 they hold inf or NaN; training stopped" in stopped[1]
