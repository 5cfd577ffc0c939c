"""``SDPADotProductAttention`` computes what Megatron-Core's local ``DotProductAttention`` computes (outputs and
gradients), on the same parameters, for every mask Megatron gives it; what it cannot do is refused at build time."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from nemo_noise_plugin.model.sdpa_attention import SDPADotProductAttention, sdpa_layer_spec
from nemo_noise_plugin.validation import SettingError
from tests.support.models import build_tiny_gpt, causal_attention_mask, tiny_gpt_config

pytestmark = pytest.mark.usefixtures("megatron_cpu")


def _pair(**overrides):
    config = tiny_gpt_config(**overrides)
    args = dict(layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(config, **args), SDPADotProductAttention(config, **args), config


def _qkv(config, sq=24, sk=24, batch=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    head = config.kv_channels
    shape = lambda s, n: (s, batch, n, head)  # noqa: E731
    q = torch.randn(shape(sq, config.num_attention_heads), generator=generator)
    k = torch.randn(shape(sk, config.num_query_groups), generator=generator)
    v = torch.randn(shape(sk, config.num_query_groups), generator=generator)
    return [t.requires_grad_() for t in (q, k, v)]


def _run(module, qkv, mask, grad):
    qkv = [t.detach().clone().requires_grad_() for t in qkv]
    out = module(*qkv, mask)
    out.backward(grad)
    return out, [t.grad for t in qkv]


def _padding_causal_mask(lengths, seq):
    """Megatron's boolean mask (True = masked): causal, and keys past each row's true length masked too."""
    mask = causal_attention_mask(seq).expand(len(lengths), 1, seq, seq).clone()
    for row, length in enumerate(lengths):
        mask[row, :, :, length:] = True
    return mask


@pytest.mark.parametrize(
    "settings, mask",
    [
        (dict(), None),  # no mask: causal inside (Bridge's SFT step passes none)
        (dict(num_query_groups=2), None),  # grouped-query attention: 4 heads over 2 key/value groups
        (dict(), "causal"),  # an explicit causal mask [1, 1, s, s]
        (dict(num_query_groups=2), "padding"),  # a per-row mask [b, 1, s, s]: causal plus padded keys
        (dict(apply_query_key_layer_scaling=True, fp16=False), None),  # the layer-number scaling cancels out
    ],
    ids=["causal-inside", "gqa", "explicit-causal", "gqa-padding", "layer-scaling"],
)
def test_sdpa_equals_megatrons_unfused_attention_in_outputs_and_gradients(settings, mask):
    local, sdpa, config = _pair(**settings)
    qkv = _qkv(config)
    seq = qkv[0].size(0)
    masks = {None: None, "causal": causal_attention_mask(seq), "padding": _padding_causal_mask((24, 17, 5), seq)}
    grad = torch.randn(seq, qkv[0].size(1), config.num_attention_heads * config.kv_channels)
    # Megatron builds its default causal mask on the GPU: on the CPU the unfused side is given it explicitly.
    expected, expected_grads = _run(local, qkv, causal_attention_mask(seq) if mask is None else masks[mask], grad)
    got, got_grads = _run(sdpa, qkv, masks[mask], grad)
    assert got.shape == expected.shape == grad.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for name, a, b in zip("qkv", got_grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


def test_a_single_query_attends_to_every_key_as_in_megatrons_decoding_step():
    local, sdpa, config = _pair()
    q, k, v = _qkv(config, sq=1, sk=9)
    torch.testing.assert_close(sdpa(q, k, v, None), local(q, k, v, None), rtol=1e-5, atol=1e-5)


def test_the_mask_is_not_a_no_op():
    """A check that the comparison above can fail: the padding mask changes the output."""
    _, sdpa, config = _pair()
    qkv = _qkv(config)
    seq = qkv[0].size(0)
    with torch.no_grad():
        causal = sdpa(*qkv, None)
        padded = sdpa(*qkv, _padding_causal_mask((24, 17, 5), seq))
    assert torch.equal(causal[:, 0], padded[:, 0])  # row 0 has no padding
    assert (causal[:, 2] - padded[:, 2]).abs().max() > 0.1


def test_a_model_on_the_sdpa_spec_has_the_local_specs_parameters_and_its_logits():
    config = tiny_gpt_config()
    torch.manual_seed(3)
    local = build_tiny_gpt(config)
    from megatron.core.models.gpt.gpt_model import GPTModel

    sdpa = GPTModel(
        config=config, transformer_layer_spec=sdpa_layer_spec(_Provider()), vocab_size=256, max_sequence_length=64,
        position_embedding_type="rope",
    )  # fmt: skip
    assert sdpa.state_dict().keys() == local.state_dict().keys()
    sdpa.load_state_dict(local.state_dict())
    core = sdpa.decoder.layers[0].self_attention.core_attention
    assert type(core) is SDPADotProductAttention
    tokens = torch.randint(0, 256, (2, 32))
    positions = torch.arange(32).expand(2, -1)
    with torch.no_grad():
        expected = local(tokens, positions, causal_attention_mask(32))
        got = sdpa(tokens, positions, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


class _Provider:
    """The fields Bridge's ``local_layer_spec`` reads from a provider."""

    num_moe_experts = None
    moe_grouped_gemm = False
    qk_layernorm = False
    normalization = "LayerNorm"


@pytest.mark.parametrize(
    "settings, setting",
    [(dict(window_size=(8, 0)), "window_size"), (dict(softmax_type="off-by-one"), "softmax_type")],
)
def test_what_sdpa_cannot_compute_is_refused_when_the_module_is_built(settings, setting):
    with pytest.raises(SettingError, match=rf"^{setting}=.* is invalid: expected "):
        SDPADotProductAttention(
            tiny_gpt_config(**settings), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )


def test_packed_sequences_are_refused_naming_the_spec():
    _, sdpa, config = _pair()
    with pytest.raises(SettingError, match="packed sequences and attention bias need TEDotProductAttention"):
        sdpa(*_qkv(config), None, packed_seq_params=object())


def test_use_sdpa_attention_converts_a_built_model_in_place_with_the_same_logits():
    from nemo_noise_plugin.model.sdpa_attention import use_sdpa_attention

    torch.manual_seed(5)
    model = build_tiny_gpt(tiny_gpt_config())
    tokens = torch.randint(0, 256, (2, 32))
    positions = torch.arange(32).expand(2, -1)
    with torch.no_grad():
        before = model(tokens, positions, causal_attention_mask(32))
    keys = list(model.state_dict())
    assert use_sdpa_attention(model) == 2
    assert [type(m) for m in model.modules() if isinstance(m, DotProductAttention)] == [SDPADotProductAttention] * 2
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        after = model(tokens, positions, None)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert use_sdpa_attention(model) == 0  # already converted


def test_converting_a_sliding_window_layer_is_refused():
    from nemo_noise_plugin.model.sdpa_attention import use_sdpa_attention

    model = build_tiny_gpt(tiny_gpt_config(window_size=(8, 0)))
    with pytest.raises(SettingError, match=r"^window_size=\(8, 0\) is invalid: expected None"):
        use_sdpa_attention(model)


def test_a_refused_conversion_leaves_the_module_as_it_was():
    from nemo_noise_plugin.model.sdpa_attention import use_sdpa_attention

    model = build_tiny_gpt(tiny_gpt_config(window_size=(8, 0)))
    with pytest.raises(SettingError):
        use_sdpa_attention(model)
    assert all(type(m) is DotProductAttention for m in model.modules() if isinstance(m, DotProductAttention))
