"""Noise + distillation under data parallelism: DP=2 gives the DP=1 loss, token count, report and gradients.

Real Megatron-Core (dense GPT, local spec) on gloo processes, the plugin's ``NoisyDistillationProvider`` and
``distillation_forward_step`` with a Bridge ``GlobalState``. One global batch of 4 samples: DP=1 runs it as one
microbatch of 4; DP=2 gives each rank 2 samples, as Megatron's sampler does (rank r gets rows 2r, 2r+1), and sums
losses and gradients over the data-parallel group as Megatron's gradient reduction does. The noise of a sample
depends on its global index, not on the rank that holds it, so the noisy student, the clean teacher and the KD loss
must agree.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.gloo_ranks import run_on_gloo_ranks

GLOBAL_BATCH, SEQ = 4, 32


def _global_batch() -> dict[str, torch.Tensor]:
    from tests.support.models import causal_attention_mask

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=generator)
    loss_mask = torch.zeros(GLOBAL_BATCH, SEQ)
    for row, (start, end) in enumerate([(4, 30), (10, 20), (2, 32), (6, 18)]):
        loss_mask[row, start:end] = 1
    return {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(SEQ).expand(GLOBAL_BATCH, -1).contiguous(),
        "attention_mask": causal_attention_mask(SEQ),
    }


def _distil_on_dp_rank(rank: int, world_size: int, port: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.providers import NoisyDistillationProvider
    from nemo_noise_plugin.training.forward_step import distillation_forward_step
    from tests.support.models import TINY_CPU_TRANSFORMER_SETTINGS, destroy_cpu_parallel, init_cpu_parallel
    from tests.support.schedule_plan import bridge_state

    init_cpu_parallel(rank=rank, world_size=world_size, port=port)
    micro_batch = GLOBAL_BATCH // world_size
    init_num_microbatches_calculator(rank, None, GLOBAL_BATCH, micro_batch, world_size)
    try:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        provider = NoisyDistillationProvider(
            **TINY_CPU_TRANSFORMER_SETTINGS,
            vocab_size=256,
            seq_length=SEQ,
            make_vocab_size_divisible_by=128,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            noise=NoiseConfig(alpha=10.0, tokens="response"),
            kd=KDConfig(temperature=2.0, kd_weight=0.5),
        )
        provider.finalize()
        provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        torch.manual_seed(5)
        (model,) = provider.provide_distributed_model(
            use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
        )
        state = bridge_state(provider, GLOBAL_BATCH, micro_batch)
        dp_rank = parallel_state.get_data_parallel_rank()
        rows = slice(dp_rank * micro_batch, (dp_rank + 1) * micro_batch)
        batch = {key: value[rows] if key != "attention_mask" else value for key, value in _global_batch().items()}
        logits, loss_function = distillation_forward_step(state, iter([batch]), model)
        loss_sum, num_tokens, report = loss_function(logits)
        loss_sum.backward()
        group = parallel_state.get_data_parallel_group()
        totals = {"loss sum": loss_sum.detach().clone(), "tokens": num_tokens.detach().clone()}
        totals.update({name: value.detach().clone() for name, value in report.items()})
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        for tensor in [*totals.values(), *grads.values()]:
            dist.all_reduce(tensor, group=group)
        weights = sum(p.detach().double().sum().item() for p in model.parameters())
        return {"totals": totals, "grads": grads, "weights": weights}
    finally:
        destroy_num_microbatches_calculator()
        destroy_cpu_parallel()


@pytest.mark.slow
def test_dp2_noise_and_distillation_equal_dp1():
    (reference,) = run_on_gloo_ranks(_distil_on_dp_rank, 1)
    first, second = run_on_gloo_ranks(_distil_on_dp_rank, 2)
    assert first["weights"] == second["weights"] == reference["weights"]  # the same initial model everywhere
    assert reference["totals"]["kd loss"][0] > 1e-4  # the noise makes the student differ from its clean teacher
    for result in (first, second):
        assert result["totals"].keys() == reference["totals"].keys()
        for name, expected in reference["totals"].items():
            torch.testing.assert_close(result["totals"][name], expected, rtol=1e-5, atol=1e-6, msg=name)
        assert result["grads"].keys() == reference["grads"].keys()
        for name, expected in reference["grads"].items():
            torch.testing.assert_close(result["grads"][name], expected, rtol=1e-4, atol=1e-6, msg=name)
