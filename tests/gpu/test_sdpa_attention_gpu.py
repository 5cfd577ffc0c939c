"""``SDPADotProductAttention`` on CUDA in bf16 (PyTorch's flash / memory-efficient kernels): against a float64
reference of the same attention, no further from it than Megatron-Core's unfused ``DotProductAttention``, outputs and
gradients, with Megatron's causal mask built inside (Bridge's SFT step passes none) and with a padding mask."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 1024, 2, 8, 2, 64


@pytest.fixture(scope="module")
def modules():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from benchmarks.tiny_gpt import free_port
    from nemo_noise_plugin.model.sdpa_attention import SDPADotProductAttention

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
        bf16=True, params_dtype=torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
        masked_softmax_fusion=False,
    )  # fmt: skip
    args = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(config, **args).cuda(), SDPADotProductAttention(config, **args).cuda()


def _reference(q, k, v, mask):
    """float64 softmax(q k^T / sqrt(d) + mask) v, grouped heads repeated, ``mask`` boolean True = masked."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / HEAD_DIM**0.5
    scores = scores.masked_fill(mask, -10000.0)
    return (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(SEQ, BATCH, HEADS * HEAD_DIM)


def _inputs():
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = lambda heads: (SEQ, BATCH, heads, HEAD_DIM)  # noqa: E731
    return [torch.randn(shape(n), generator=generator, device="cuda").bfloat16() for n in (HEADS, GROUPS, GROUPS)]


def _padding_mask():
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda").triu(1).expand(BATCH, 1, SEQ, SEQ).clone()
    mask[1, :, :, SEQ // 3 :] = True  # row 1's keys past a third of the window are padding
    return mask


def _forward_backward(module, qkv, mask, grad):
    qkv = [t.detach().clone().requires_grad_() for t in qkv]
    out = module(*qkv, mask)
    out.backward(grad.to(out.dtype))
    return out.double(), [t.grad.double() for t in qkv]


@pytest.mark.parametrize("mask_kind", ["causal_inside", "padding"])
def test_sdpa_in_bf16_is_as_close_to_the_float64_reference_as_megatrons_unfused_attention(modules, mask_kind):
    unfused, sdpa = modules
    qkv = _inputs()
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda").triu(1)[None, None]
    mask = None if mask_kind == "causal_inside" else _padding_mask()
    grad = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    leaves = [t.double().requires_grad_() for t in qkv]
    reference = _reference(*leaves, causal if mask is None else mask)
    reference.backward(grad.double())
    ref_grads = [t.grad for t in leaves]
    for name, module in (("unfused", unfused), ("sdpa", sdpa)):
        out, grads = _forward_backward(module, qkv, mask, grad)
        error = (out - reference).abs().max().item()
        grad_errors = [(a - b).abs().max().item() / b.abs().max().item() for a, b in zip(grads, ref_grads, strict=True)]
        print(f"{mask_kind} {name}: max |out - ref| {error:.2e}, max relative grad error {max(grad_errors):.2e}")
        if name == "unfused":
            floor, grad_floor = error, max(grad_errors)
    assert error <= max(2 * floor, 1e-2), (error, floor)
    assert max(grad_errors) <= max(2 * grad_floor, 2e-2), (grad_errors, grad_floor)
