"""Fused attention without Transformer Engine: Megatron-Core's local core attention on PyTorch's SDPA.

Megatron-Core's local layer spec (what runs where Transformer Engine is absent: the CPU, and GPU images without TE)
computes attention unfused (``DotProductAttention``): it materialises the ``[b, heads, s, s]`` scores, masks and
softmaxes them in separate kernels and copies them around. On an H200 at sequence 2048 that was 40 % of a
Llama-3.2-1B-sized step (``benchmarks/SFT_THROUGHPUT.md``). ``SDPADotProductAttention`` is the same module with its
``forward`` on ``torch.nn.functional.scaled_dot_product_attention``, which picks a flash or memory-efficient kernel on
a GPU and the math kernel on a CPU; weights, state dict and checkpoints are those of ``DotProductAttention`` (it has
none of its own), so a run can switch between the two.

What it computes is what ``DotProductAttention`` computes: softmax(scale * q k^T + mask) v with Megatron's scale
(``1/sqrt(head dim)``, or ``softmax_scale``; query-key layer scaling cancels as there), Megatron's masks (a boolean
``attention_mask``, True = masked, applied as -10000 as ``attention_mask_func`` does; the causal mask when none is
given) and grouped-query attention without repeating the keys (``enable_gqa``). What ``DotProductAttention``
supports and this does not is refused when the module is built, as a ``SettingError``: sliding-window attention and
softmax variants other than ``vanilla``; packed sequences and attention bias are refused by both, at the call.

Two ways in: ``use_sdpa_attention(model)`` turns every ``DotProductAttention`` of a built model into this class in
place (what the plugin's providers do for ``core_attention="sdpa"``: Bridge's ``provide`` puts
``DotProductAttention`` back into any spec when ``attention_backend`` is ``local``, so a spec alone does not reach
the model there), and ``sdpa_layer_spec`` for a ``GPTModel`` built directly.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from nemo_noise_plugin.validation import SettingError

__all__ = ["CORE_ATTENTION", "MASKED_SCORE", "SDPADotProductAttention", "sdpa_layer_spec", "use_sdpa_attention"]

CORE_ATTENTION = ("unfused", "sdpa")
"""The plugin providers' ``core_attention`` choices: Megatron-Core's ``DotProductAttention`` as built (``unfused``) or
turned into ``SDPADotProductAttention`` (``sdpa``). Transformer Engine attention is never touched."""

MASKED_SCORE = -10000.0
"""The score a masked position gets: Megatron's ``attention_mask_func`` fills masked scores with this value."""


class SDPADotProductAttention(DotProductAttention):
    """``DotProductAttention`` whose forward is one ``scaled_dot_product_attention`` call (same inputs, same output
    ``[sq, b, heads * head dim]``, same parameters)."""

    def __init__(self, config: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
        self.check_computable(config, max(1, layer_number))
        super().__init__(config, layer_number, *args, **kwargs)
        self.sdpa_scale = self._scores_scale()

    @classmethod
    def convert(cls, module: DotProductAttention) -> SDPADotProductAttention:
        """``module`` (a built ``DotProductAttention``) as this class, in place: no parameters or buffers change;
        checked before anything changes."""
        cls.check_computable(module.config, module.layer_number)
        module.__class__ = cls
        module.sdpa_scale = module._scores_scale()
        return module

    @staticmethod
    def check_computable(config: Any, layer_number: int) -> None:
        """``SettingError`` for a layer whose attention SDPA cannot compute (sliding window, softmax variants)."""
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise SettingError(
                "window_size", config.window_size, "None", why=": sliding-window attention needs the local spec's "
                "unfused attention (core_attention='unfused') or Transformer Engine",
            )  # fmt: skip
        if config.softmax_type != "vanilla":
            raise SettingError(
                "softmax_type", config.softmax_type, "vanilla",
                why=": SDPA has no softmax offset; use the unfused attention (core_attention='unfused')",
            )  # fmt: skip

    def _scores_scale(self) -> float:
        """The scale of ``q k^T``: ``DotProductAttention``'s, whose query-key layer scaling divides by the layer
        number and whose softmax multiplies it back."""
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:
            scale *= self.layer_number
        return scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Attention of ``query`` ``[sq, b, heads, d]`` over ``key``/``value`` ``[sk, b, groups, d]``; returns
        ``[sq, b, heads * d]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise SettingError(
                "core_attention", "sdpa", "Transformer Engine attention",
                why=": packed sequences and attention bias need TEDotProductAttention (as for the local spec)",
            )  # fmt: skip
        sq, batch, heads, _ = query.shape
        sk = key.size(0)
        mask, causal = None, False
        if attention_mask is not None:
            mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
            mask.masked_fill_(attention_mask.to(torch.bool), MASKED_SCORE)
        elif (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise ValueError(f"a causal mask needs as many queries as keys, got {sq} and {sk}")
            causal = True  # sq == 1 (a decoding step) takes no mask, as in DotProductAttention
        dropout = self.attention_dropout.p if self.training else 0.0
        q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))  # [b, heads or groups, s, d]
        forked = dropout and not self.config.sequence_parallel  # DotProductAttention's dropout stream, likewise
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext():
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.sdpa_scale,
                enable_gqa=k.size(1) != heads,
            )  # fmt: skip
        return context.permute(2, 0, 1, 3).reshape(sq, batch, self.hidden_size_per_partition)


def sdpa_layer_spec(config: Any) -> Any:
    """Bridge's ``local_layer_spec(config)`` (Megatron-Core's local layers, no Transformer Engine) with
    ``SDPADotProductAttention`` as the core attention, for a ``GPTModel`` built without Bridge's provider (whose
    ``provide`` puts ``DotProductAttention`` back when ``attention_backend`` is ``local``: use the plugin providers'
    ``core_attention="sdpa"`` there). Example::

        model = GPTModel(config=config, transformer_layer_spec=sdpa_layer_spec(provider), ...)
    """
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    spec = import_bridge("megatron.bridge.models.gpt_provider").local_layer_spec(config)
    spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    return spec


def use_sdpa_attention(model: torch.nn.Module) -> int:
    """Turn every ``DotProductAttention`` inside ``model`` (any wrapper, any layer kind) into an
    ``SDPADotProductAttention`` in place; returns how many. ``SettingError`` for a layer SDPA cannot compute.
    Example::

        model = provider.provide()
        use_sdpa_attention(model)
    """
    found = [module for module in model.modules() if type(module) is DotProductAttention]
    for module in found:
        SDPADotProductAttention.convert(module)
    return len(found)
