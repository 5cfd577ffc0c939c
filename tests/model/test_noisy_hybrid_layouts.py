"""The noisy ``HybridModel`` under tensor and sequence parallelism: TP=2 gives TP=1's noised decoder input, losses
and gradients (issue 35; the GPT model's layouts: ``tests/noise/test_layout_invariance.py`` and its neighbours).

Real Megatron-Core ``HybridModel``s from the plugin's ``NoisyHybridModelProvider`` on the local hybrid stack, one
training step of two microbatches each, through Megatron's own ``schedules.forward_step`` / ``backward_step`` with
``noise_forward_step`` (``tests.support.schedule_plan``), on two gloo CPU processes. The TP=2 ranks load the TP=1
model's weights, each its shard (split along each parameter's ``partition_dim``); their decoder inputs are put back
at the rows each holds (all of them without SP, its half of the sequence with SP), their gradients gathered along
``partition_dim`` and, for the sequence-parallel parameters, summed over the TP ranks as Megatron's
``finalize_model_grads`` does.

Without SP the stack is the recipes' kind: attention, MLP, attention, MLP (``*-*-``) with torch norms. Sequence
parallelism needs a norm that supports it, and Megatron-Core's only norm without Apex or Transformer Engine,
``WrappedTorchNorm``, refuses it (``transformer/torch_norm.py:50``): the SP layout runs the local stack with
Megatron's ``IdentityOp`` in the norms' places (``_norm_free_stack_spec``; as in Transformer Engine specs, whose
norm is fused into the next linear layer), compared with that stack at TP=1. It carries a MoE layer (``*-*E``),
which Megatron-Core trains at TP > 1 only with SP (``transformer/moe/moe_layer.py:629-633``).

Not here, because the CPU cannot run them on a hybrid model: context parallelism and packed sequences, which
Megatron-Core's local ``DotProductAttention`` refuses (``transformer/dot_product_attention.py:57-59`` and
``:153-156``); only Transformer Engine's attention runs them. The noise layer itself is tested under both
(``tests/noise/test_layout_invariance.py``, ``tests/noise/test_packed_sequences.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.gloo_ranks import run_on_gloo_ranks

MICROBATCHES, MICRO_BATCH_SIZE = 2, 2
STACKS = {"local": "*-*-", "norm-free": "*-*E"}
"""Stack -> layer pattern: the recipes' local hybrid stack and pattern kind (torch norms: no SP), and the same stack
without norms (SP allowed) with a MoE layer (Megatron refuses MoE training at TP > 1 without SP)."""


def _norm_free_stack_spec(config):
    """``local_hybrid_stack_spec`` with Megatron-Core's ``IdentityOp`` for every layer norm."""
    from megatron.core.transformer.identity_op import IdentityOp

    from nemo_noise_plugin.providers.hybrid import local_hybrid_stack_spec

    spec = local_hybrid_stack_spec(config)
    for layer in (spec.submodules.attention_layer, spec.submodules.mlp_layer, spec.submodules.moe_layer):
        layer.submodules.input_layernorm = IdentityOp
        layer.submodules.pre_mlp_layernorm = IdentityOp
    return spec


def _step(rank: int, world_size: int, port: int, tp: int, layouts: dict, weights: dict | None) -> dict:
    """One training step of the noisy hybrid model at each of ``layouts`` (name -> (stack, sequence_parallel))."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.providers.hybrid import local_hybrid_stack_spec
    from nemo_noise_plugin.training.forward_step import noise_forward_step
    from tests.support.attention_variables import clean_attention_variables
    from tests.support.hybrid_schedule_plan import build_hybrid_provider
    from tests.support.models import destroy_cpu_parallel, init_cpu_parallel
    from tests.support.schedule_plan import bound_forward_step, bridge_state, build_model, microbatches, run_normal_path

    init_cpu_parallel(rank=rank, world_size=world_size, port=port, tensor_model_parallel_size=tp)
    init_num_microbatches_calculator(rank, None, MICROBATCHES * MICRO_BATCH_SIZE, MICRO_BATCH_SIZE, 1)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    results = {}
    try:
        with clean_attention_variables():
            for name, (stack, sequence_parallel) in layouts.items():
                provider = build_hybrid_provider(
                    NoiseConfig(alpha=10.0, tokens="response"),
                    pattern=STACKS[stack],
                    hybrid_stack_spec=local_hybrid_stack_spec if stack == "local" else _norm_free_stack_spec,
                    tensor_model_parallel_size=tp,
                    sequence_parallel=sequence_parallel,
                    params_dtype=torch.float32,
                    bf16=False,  # HybridModelProvider defaults to bf16 weights and softmax output
                    moe_token_dispatcher_type="allgather",  # the alltoall one allocates CUDA streams
                )
                torch.manual_seed(3)
                model = build_model(provider)
                if weights is not None:
                    _load_shards(model, weights[stack], tp_rank, tp)
                inputs, clean = _record_decoder_inputs(model)
                step = bound_forward_step(noise_forward_step, bridge_state(provider, 4, MICRO_BATCH_SIZE, step=5))
                result = run_normal_path(step, model, microbatches(MICROBATCHES, MICRO_BATCH_SIZE, seed=11))
                results[name] = {
                    "reports": result.reports,
                    "grads": _whole_gradients(model, result.grads, sequence_parallel),
                    "decoder inputs": inputs,
                    "embeddings": clean,
                    "weights": {key: v.clone() for key, v in model.state_dict().items() if torch.is_tensor(v)},
                    "model": type(model).__name__,
                }
    finally:
        destroy_num_microbatches_calculator()
        destroy_cpu_parallel()
    return {"tp rank": tp_rank, "results": results}


def _record_decoder_inputs(model: torch.nn.Module) -> tuple[list, list]:
    """Lists that fill with each microbatch's decoder input (noised) and clean embedding."""
    inputs, clean = [], []
    model.embedding.register_forward_hook(lambda module, args, output: clean.append(output.detach().clone()))
    model.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.append(kwargs["hidden_states"].detach().clone()), with_kwargs=True
    )
    return inputs, clean


def _load_shards(model: torch.nn.Module, whole: dict[str, torch.Tensor], tp_rank: int, tp: int) -> None:
    """Give ``model`` (built at ``tp``) this TP rank's shards of the TP=1 model's ``whole`` state dict."""
    parameters = dict(model.named_parameters())
    state = {}
    for name, value in model.state_dict().items():
        parameter = parameters.get(name)
        if parameter is not None and getattr(parameter, "tensor_model_parallel", False):
            dim = parameter.partition_dim
            state[name] = whole[name].chunk(tp, dim=dim)[tp_rank].clone()
            assert state[name].shape == value.shape, name
        else:  # replicated; non-tensor entries (``_extra_state``) stay the model's own
            state[name] = whole[name] if torch.is_tensor(value) else value
    model.load_state_dict(state)


def _whole_gradients(model: torch.nn.Module, grads: dict, sequence_parallel: bool) -> dict[str, torch.Tensor]:
    """The gradients of the unsplit model: TP shards gathered along ``partition_dim``; the sequence-parallel
    parameters' partial gradients summed over the TP ranks (``finalize_model_grads``'s all-reduce)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = parallel_state.get_tensor_model_parallel_world_size()
    parameters = dict(model.named_parameters())
    whole = {}
    for name, grad in grads.items():
        parameter = parameters[name]
        if size > 1 and getattr(parameter, "tensor_model_parallel", False):
            shards = [torch.empty_like(grad) for _ in range(size)]
            dist.all_gather(shards, grad.contiguous(), group=group)
            grad = torch.cat(shards, dim=parameter.partition_dim)
        elif size > 1 and sequence_parallel and getattr(parameter, "sequence_parallel", False):
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
        whole[name] = grad
    return whole


LAYOUTS = {"tp2": ("local", False), "tp2_sp": ("norm-free", True)}


@pytest.fixture(scope="module")
def reference():
    """TP=1, one process: both stacks."""
    (result,) = run_on_gloo_ranks(_step, 1, 1, {stack: (stack, False) for stack in STACKS}, None, timeout=600)
    return result["results"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_noisy_hybrid_model_at_tp2_with_and_without_sp_gives_tp1s_decoder_input_losses_and_gradients(reference):
    weights = {stack: reference[stack]["weights"] for stack in STACKS}
    ranks = run_on_gloo_ranks(_step, 2, 2, LAYOUTS, weights, timeout=600)
    for name, (stack, sequence_parallel) in LAYOUTS.items():
        expected = reference[stack]
        assert expected["model"] == "NoisyHybridModel"
        for index, whole in enumerate(expected["decoder inputs"]):  # [s, b, h], noised
            rows = whole.size(0) // 2
            parts = [rank["results"][name]["decoder inputs"][index] for rank in ranks]
            if sequence_parallel:  # each TP rank holds its half of the sequence, noised there
                assert torch.equal(torch.cat(parts, dim=0), whole), (name, index)
                assert [part.size(0) for part in parts] == [rows, rows]
            else:  # every TP rank holds the whole decoder input
                assert all(torch.equal(part, whole) for part in parts), (name, index)
        for rank in ranks:
            got = rank["results"][name]
            assert len(got["reports"]) == len(expected["reports"]) == MICROBATCHES
            for mine, theirs in zip(got["reports"], expected["reports"], strict=True):
                assert mine.keys() == theirs.keys()
                for key in theirs:
                    torch.testing.assert_close(mine[key], theirs[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
            assert got["grads"].keys() == expected["grads"].keys()
            assert any(".experts." in key for key in got["grads"]) == ("E" in STACKS[stack])
            for key, grad in expected["grads"].items():
                torch.testing.assert_close(got["grads"][key], grad, rtol=1e-4, atol=1e-6, msg=f"{name} {key}")


@pytest.mark.multiprocess
def test_the_compared_decoder_inputs_carry_the_noise_on_the_response_tokens_only(reference):
    """What the layouts are compared on is noised: the TP=1 decoder input minus the clean embedding is nonzero
    exactly on the response tokens: token p when its label, at p - 1, carries loss and p is a real token, before
    the sequence's end one past its last loss position (``noise/geometry.py``)."""
    from tests.support.schedule_plan import microbatches

    for stack in STACKS:
        result = reference[stack]
        batches = microbatches(MICROBATCHES, MICRO_BATCH_SIZE, seed=11)
        for batch, noised, clean in zip(batches, result["decoder inputs"], result["embeddings"], strict=True):
            loss = batch["loss_mask"] > 0
            positions = torch.arange(loss.size(1))
            labelled = torch.zeros_like(loss)
            labelled[:, 1:] = loss[:, :-1]
            ends = torch.where(loss, positions + 1, 0).amax(dim=1, keepdim=True)
            touched = (noised - clean).abs().amax(dim=-1) > 0  # [s, b]
            assert torch.equal(touched, (labelled & (positions < ends)).t()), stack
            assert touched.sum() > 10
