"""The Bridge forward steps hand a batch's ``private_mask`` to the noise layer (``tokens='spans'``), for one step."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from tests.support.models import TINY_CPU_TRANSFORMER_SETTINGS, causal_attention_mask

SEQ = 32
SPANS = ((3, 7), (12, 20))
NOISE = NoiseConfig(mechanism="gaussian", sigma=0.5, scaling="absolute", tokens="spans", seed=9)


def _model(distillation: bool):
    from nemo_noise_plugin.providers import NoisyDistillationProvider, NoisyGPTModelProvider

    settings = dict(
        **TINY_CPU_TRANSFORMER_SETTINGS,
        vocab_size=256,
        seq_length=SEQ,
        make_vocab_size_divisible_by=128,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        noise=NOISE,
    )
    provider = (
        NoisyDistillationProvider(**settings, kd=KDConfig()) if distillation else NoisyGPTModelProvider(**settings)
    )
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(5)
    (model,) = provider.provide_distributed_model(
        use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
    )
    return provider, model


def _state(provider):
    config = import_bridge("megatron.bridge.training.config")
    tokenizers = import_bridge("megatron.bridge.training.tokenizers.config")
    container = config.ConfigContainer(
        model=provider,
        train=config.TrainingConfig(train_iters=4, global_batch_size=2, micro_batch_size=2),
        optimizer=config.OptimizerConfig(optimizer="adam", lr=1e-4),
        scheduler=config.SchedulerConfig(),
        dataset=config.MockGPTDatasetConfig(
            seq_length=SEQ, random_seed=1, reset_attention_mask=False, reset_position_ids=False, eod_mask_loss=False
        ),
        logger=config.LoggerConfig(),
        tokenizer=tokenizers.TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256),
        checkpoint=config.CheckpointConfig(),
        rng=config.RNGConfig(),
    )
    container.dataset.skip_getting_attention_mask_from_dataset = False  # the CPU needs an explicit causal mask
    state = import_bridge("megatron.bridge.training.state").GlobalState()
    state.cfg = container
    state.train_state.step = 2
    return state


def _batch(with_private_mask: bool = True) -> dict:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, SEQ), generator=generator)
    loss_mask = torch.zeros(2, SEQ)
    loss_mask[:, 24:31] = 1
    private_mask = torch.zeros(2, SEQ, dtype=torch.bool)
    private_mask[0, SPANS[0][0] : SPANS[0][1]] = True
    private_mask[1, SPANS[1][0] : SPANS[1][1]] = True
    batch = {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(SEQ).expand(2, -1).contiguous(),
        "attention_mask": causal_attention_mask(SEQ),
    }
    if with_private_mask:
        batch["private_mask"] = private_mask
    return batch, private_mask


def _noised_positions(model, step, state, batch) -> torch.Tensor:
    """``[s, b]`` True where the decoder input differs from the clean embedding in one forward step."""
    seen = {}
    handle = model.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(decoder_input=kwargs["hidden_states"].detach()), with_kwargs=True
    )
    try:
        step(state, iter([batch]), model)
    finally:
        handle.remove()
    with torch.no_grad():
        clean = model.embedding(input_ids=batch["tokens"], position_ids=batch["position_ids"])
    return (seen["decoder_input"] - clean).abs().amax(dim=-1) > 0


@pytest.mark.parametrize("distillation", [False, True], ids=["noise_forward_step", "distillation_forward_step"])
def test_the_forward_step_noises_exactly_the_batch_private_mask(megatron_cpu, distillation):
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step

    provider, model = _model(distillation)
    model.train()
    batch, private_mask = _batch()
    step = distillation_forward_step if distillation else noise_forward_step
    noised = _noised_positions(model, step, _state(provider), batch)
    assert torch.equal(noised, private_mask.t())
    with model.noise_batch_inputs() as handed:
        assert handed.private_mask is None, "the private mask is handed over for one forward step only"


def test_a_batch_without_private_mask_under_tokens_spans_is_a_clear_error(megatron_cpu):
    from nemo_noise_plugin.training.forward_step import noise_forward_step

    provider, model = _model(False)
    model.train()
    batch, _ = _batch(with_private_mask=False)
    with pytest.raises(ValueError, match="tokens='spans' needs the batch's private_mask"):
        noise_forward_step(_state(provider), iter([batch]), model)
