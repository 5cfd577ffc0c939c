"""Drive a small MoE GPT through Megatron-Core's normal path and its fine-grained schedule plan, side by side.

Both paths use Megatron's own schedule code with the plugin's Bridge forward steps (``noise_forward_step``,
``distillation_forward_step``) and a Bridge ``GlobalState``:

- normal: ``schedules.forward_step`` / ``schedules.backward_step`` per microbatch, the loop of
  ``forward_backward_no_pipelining`` (which itself allocates on ``cuda`` and so cannot run on a CPU);
- plan: ``combined_1f1b_schedule_for_no_pipelining``, the combined 1F1B schedule that
  ``forward_backward_no_pipelining`` calls when ``overlap_moe_expert_parallel_comm`` is set.

On a CPU the plan needs ``install_schedule_plan_substitutes()`` (fake streams and events, the tests'
``tests/support/schedule_plan_substitutes.py``); on a GPU nothing. Shared by ``benchmarks/schedule_plan_step.py``
and the tests (through ``tests/support/schedule_plan.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from benchmarks.tiny_gpt import TINY_CPU_TRANSFORMER_SETTINGS, causal_attention_mask

SEQ = 32
VOCAB = 256


def local_moe_block_spec(config, vp_stage: int | None = None):
    """Megatron-Core's GPT decoder block spec on local (non-Transformer-Engine) modules, MoE per ``moe_layer_freq``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)


def moe_settings(**overrides: Any) -> dict[str, Any]:
    """Provider fields of a 2-layer MoE GPT (4 experts, top-2, alltoall dispatcher) on the local spec."""
    return {
        **TINY_CPU_TRANSFORMER_SETTINGS,
        "vocab_size": VOCAB,
        "seq_length": SEQ,
        "make_vocab_size_divisible_by": 128,
        "transformer_layer_spec": local_moe_block_spec,
        "num_moe_experts": 4,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 64,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_aux_loss_coeff": 0.0,
        "add_bias_linear": False,  # the local experts' bias path modifies a view in place
        **overrides,
    }


def build_provider(noise=None, kd=None, **overrides: Any):
    """A finalized ``NoisyGPTModelProvider`` (``NoisyDistillationProvider`` with ``kd``; Bridge's plain
    ``GPTModelProvider`` when ``noise`` is None too)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_noise_plugin.providers import NoisyDistillationProvider, NoisyGPTModelProvider
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    settings = moe_settings(**overrides)
    if kd is not None:
        provider = NoisyDistillationProvider(**settings, noise=noise, kd=kd)
    elif noise is not None:
        provider = NoisyGPTModelProvider(**settings, noise=noise)
    else:
        provider = import_bridge("megatron.bridge.models.gpt_provider").GPTModelProvider(**settings)
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return provider


def build_model(provider, mixed_precision_wrapper=None):
    """One model chunk (no DDP), with the provider's pre/post-wrap hooks (the teacher, with KD)."""
    (chunk,) = provider.provide_distributed_model(
        use_cpu_initialization=not torch.cuda.is_available(),
        wrap_with_ddp=False,
        mixed_precision_wrapper=mixed_precision_wrapper,
    )
    return chunk


def bridge_state(provider, global_batch_size: int, micro_batch_size: int, step: int = 0, seq_length: int = SEQ):
    """A Bridge ``GlobalState`` whose config holds ``provider`` (the forward steps read its loss settings)."""
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    config = import_bridge("megatron.bridge.training.config")
    tokenizer = import_bridge("megatron.bridge.training.tokenizers.config")
    container = config.ConfigContainer(
        model=provider,
        train=config.TrainingConfig(
            train_iters=4, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size
        ),
        optimizer=config.OptimizerConfig(optimizer="adam", lr=1e-4),
        scheduler=config.SchedulerConfig(),
        dataset=config.MockGPTDatasetConfig(
            seq_length=seq_length,
            random_seed=1,
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
        ),
        logger=config.LoggerConfig(),
        tokenizer=tokenizer.TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=provider.vocab_size),
        checkpoint=config.CheckpointConfig(),
        rng=config.RNGConfig(),
    )
    container.dataset.skip_getting_attention_mask_from_dataset = False  # an explicit causal mask (CPU attention)
    state = import_bridge("megatron.bridge.training.state").GlobalState()
    state.cfg = container
    state.train_state.step = step
    return state


def microbatches(
    count: int,
    micro_batch_size: int,
    seed: int,
    device: str | torch.device = "cpu",
    seq_length: int = SEQ,
    vocab_size: int = VOCAB,
) -> list[dict]:
    """``count`` Bridge-style batches: random tokens, a prompt/response loss mask and padding at the end."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=generator)
        loss_mask = torch.zeros(micro_batch_size, seq_length)
        for row in range(micro_batch_size):
            start = int(torch.randint(2, max(3, seq_length // 4), (), generator=generator))
            end = int(torch.randint(start + 4, seq_length, (), generator=generator))
            loss_mask[row, start:end] = 1
        batch = {
            "tokens": tokens,
            "labels": torch.roll(tokens, -1, dims=1),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(seq_length).expand(micro_batch_size, -1).contiguous(),
            "attention_mask": causal_attention_mask(seq_length),
        }
        batches.append({key: value.to(device) for key, value in batch.items()})
    return batches


@dataclass
class PathResult:
    """What one training step through a path produced: per-microbatch reports and the parameters' gradients."""

    reports: list[dict[str, torch.Tensor]]
    grads: dict[str, torch.Tensor]


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, parameter in model.named_parameters():
        grad = getattr(parameter, "main_grad", None)
        grad = parameter.grad if grad is None else grad
        if grad is not None:
            grads[name] = grad.detach().float().clone()
    return grads


def run_normal_path(forward_step: Callable, model: torch.nn.Module, batches: list[dict]) -> PathResult:
    """One step of ``forward_backward_no_pipelining``'s loop: forward_step then backward_step per microbatch."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    data = iter(batches)
    store: list = []
    for index in range(len(batches)):
        output, _ = schedules.forward_step(
            forward_step,
            data,
            model,
            len(batches),
            None,
            store,
            config,
            cp_group_size=1,
            is_first_microbatch=index == 0,
            current_microbatch=index,
        )
        schedules.backward_step(None, output, None, config)
    return PathResult(store, _gradients(model))


def run_plan_path(forward_step: Callable, model: torch.nn.Module, batches: list[dict]) -> PathResult:
    """One step of the combined 1F1B schedule (``overlap_moe_expert_parallel_comm``) over the same microbatches."""
    from megatron.core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_no_pipelining
    from megatron.core.pipeline_parallel.schedules import check_first_val_step
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    if not config.overlap_moe_expert_parallel_comm:
        raise ValueError("run_plan_path needs a model whose config has overlap_moe_expert_parallel_comm=True.")
    store: list = []
    combined_1f1b_schedule_for_no_pipelining(
        forward_step,
        iter(batches),
        model,
        len(batches),
        None,
        None,
        store,
        config,
        False,
        None,
        False,
        contextlib.nullcontext,
        torch.zeros([], dtype=torch.int, device=torch.cuda.current_device()),
        partial(check_first_val_step, None, False),
    )
    return PathResult(store, _gradients(model))


def bound_forward_step(forward_step: Callable, state: Any) -> Callable:
    """Megatron's ``forward_step_func(data_iterator, model, return_schedule_plan=False)`` for a Bridge step."""

    def step(data_iterator: Iterable, model: torch.nn.Module, return_schedule_plan: bool = False):
        return forward_step(state, data_iterator, model, return_schedule_plan)

    return step


def same_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy ``source``'s parameters and buffers into ``target`` (built from the same provider)."""
    target.load_state_dict(source.state_dict())


def run_interleaved(chunks: list[torch.nn.Module], batches: list[dict], state: Any, forward_step=None) -> PathResult:
    """One step of Megatron's interleaved pipeline schedule over the model chunks of this rank.

    ``forward_backward_pipelining_with_interleaving`` takes the plan path (combined 1F1B) when the chunks' config
    has ``overlap_moe_expert_parallel_comm``. Gradients are keyed ``"<chunk>.<parameter name>"``.
    """
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from nemo_noise_plugin.training.forward_step import noise_forward_step

    config = get_model_config(chunks[0])
    store = get_forward_backward_func()(
        forward_step_func=bound_forward_step(forward_step or noise_forward_step, state),
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=len(batches),
        seq_length=config.seq_length,
        micro_batch_size=batches[0]["tokens"].size(0),
    )
    grads = {f"{index}.{name}": grad for index, chunk in enumerate(chunks) for name, grad in _gradients(chunk).items()}
    return PathResult(list(store), grads)


def global_layer_name(chunk: torch.nn.Module, name: str) -> str:
    """``name`` of a parameter/buffer of ``chunk`` with its decoder layer index made global (``layer_number - 1``).

    A pipeline chunk numbers its layers from 0; the unsplit model numbers them 0..num_layers-1. Other names (the
    embedding, final layernorm, output layer) are the same in both.
    """
    from megatron.core.utils import unwrap_model

    marker = "decoder.layers."
    if marker not in name:
        return name
    head, tail = name.split(marker, 1)
    local, rest = tail.split(".", 1)
    layer = unwrap_model(chunk).decoder.layers[int(local)]
    return f"{head}{marker}{layer.layer_number - 1}.{rest}"


def load_from_unsplit(chunk: torch.nn.Module, unsplit_state: dict[str, torch.Tensor]) -> None:
    """Give a pipeline chunk the weights of the same layers of an unsplit (PP=1) model's ``state_dict``."""
    state = {name: unsplit_state[global_layer_name(chunk, name)] for name in chunk.state_dict()}
    chunk.load_state_dict(state)


def global_gradients(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The gradients of this rank's chunks, keyed by the unsplit model's parameter names."""
    return {global_layer_name(chunk, name): grad for chunk in chunks for name, grad in _gradients(chunk).items()}
