"""KD losses: values and gradients against float64 references, conventions, masks, and TP=1 == TP=2.

References are built from ``torch.nn.functional`` on the full vocabulary (``F.log_softmax``, ``F.kl_div``; the JSD
transcribes HF TRL's ``generalized_jsd_loss``). The tensor-parallel tests split the same logits along the vocabulary
over two gloo processes with real Megatron TP groups and compare with the one-process result.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nemo_noise_plugin.distillation import (
    KDConfig,
    combined_distillation_loss,
    cross_entropy_and_forward_kl,
    forward_kl,
    hidden_state_loss,
    jsd,
    kd_token_mask,
    logit_divergence,
    masked_token_mean,
    reverse_kl,
    token_cross_entropy,
    vocab_parallel_log_softmax,
)
from tests.support.gloo_ranks import run_on_gloo_ranks

BATCH, SEQ, VOCAB, HIDDEN = 3, 6, 16, 8
TP = 2
KINDS = ("forward_kl", "reverse_kl", "jsd")
JSD_BETA = 0.3  # asymmetric, so a swapped beta convention fails
TOP_KS = (None, 3, 11)  # 11 > VOCAB / TP: a shard cannot hold all candidates
TIGHT = dict(rtol=1e-10, atol=1e-12)


def make_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """float64 student/teacher logits ``[b, s, V]``, token weights, labels, masks, hidden states ``[s, b, h]``."""
    generator = torch.Generator().manual_seed(seed)
    student = 3.0 * torch.randn(BATCH, SEQ, VOCAB, generator=generator, dtype=torch.float64)
    teacher = 3.0 * torch.randn(BATCH, SEQ, VOCAB, generator=generator, dtype=torch.float64)
    teacher[0, 0, VOCAB // 2 : VOCAB // 2 + 3] += 20.0  # this token's teacher top-3 all live on the second shard
    loss_mask = torch.zeros(BATCH, SEQ, dtype=torch.float64)
    padding_mask = torch.zeros(BATCH, SEQ, dtype=torch.float64)
    for row, (prompt, length) in enumerate(((2, 6), (1, 4), (3, 5))):
        loss_mask[row, prompt:length] = 1.0
        padding_mask[row, :length] = 1.0
    return {
        "student": student,
        "teacher": teacher,
        "weights": torch.rand(BATCH, SEQ, generator=generator, dtype=torch.float64) + 0.5,
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        "loss_mask": loss_mask,
        "padding_mask": padding_mask,
        "student_hidden": torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64),
        "teacher_hidden": torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64),
    }


def reference_divergence(kind, student, teacher, temperature=1.0, beta=JSD_BETA, top_k=None):
    """Full-vocabulary float64 reference with torch.nn.functional; top-k renormalises both over the teacher's top-k."""
    student, teacher = student / temperature, teacher.detach() / temperature
    if top_k is not None:
        index = teacher.topk(top_k, dim=-1).indices
        student, teacher = student.gather(-1, index), teacher.gather(-1, index)
    log_s, log_t = F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)
    if kind == "forward_kl":
        return F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)
    if kind == "reverse_kl":
        return F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    beta = torch.tensor(beta, dtype=log_s.dtype)  # TRL's generalized_jsd_loss, 0 < beta < 1
    mixture = torch.logsumexp(torch.stack([log_s + torch.log(1 - beta), log_t + torch.log(beta)]), dim=0)
    kl_teacher = F.kl_div(mixture, log_t, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture, log_s, reduction="none", log_target=True)
    return (beta * kl_teacher + (1 - beta) * kl_student).sum(-1)


def value_and_gradient(function, student, weights):
    """Per-token values and the gradient of their weighted sum w.r.t. the student logits."""
    student = student.detach().clone().requires_grad_()
    values = function(student)
    (values * weights).sum().backward()
    return values.detach(), student.grad


# (a) values and gradients against float64 references


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("top_k", TOP_KS, ids=lambda k: f"top{k}")
@pytest.mark.parametrize("kind", KINDS)
def test_divergence_value_and_gradient_match_float64_reference(kind, top_k, temperature):
    data = make_inputs()
    ours = value_and_gradient(
        lambda s: logit_divergence(
            s, data["teacher"], kind, temperature=temperature, beta=JSD_BETA, top_k=top_k, tp_group=None
        ),
        data["student"],
        data["weights"],
    )
    expected = value_and_gradient(
        lambda s: reference_divergence(kind, s, data["teacher"], temperature, JSD_BETA, top_k),
        data["student"],
        data["weights"],
    )
    torch.testing.assert_close(ours[0], expected[0], **TIGHT)
    torch.testing.assert_close(ours[1], expected[1], **TIGHT)
    assert ours[0].shape == (BATCH, SEQ)


def test_named_functions_are_the_divergences():
    data = make_inputs()
    s, t = data["student"], data["teacher"]
    torch.testing.assert_close(forward_kl(s, t, 2.0), reference_divergence("forward_kl", s, t, 2.0), **TIGHT)
    torch.testing.assert_close(reverse_kl(s, t, 2.0), reference_divergence("reverse_kl", s, t, 2.0), **TIGHT)
    torch.testing.assert_close(jsd(s, t, 0.7, 2.0), reference_divergence("jsd", s, t, 2.0, beta=0.7), **TIGHT)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_fused_cross_entropy_and_forward_kl_equal_the_separate_losses(temperature):
    """The memory-lean path gives the values and gradients of token_cross_entropy and forward_kl."""
    data = make_inputs(3)
    ce_weights, kd_weights = data["weights"], data["weights"].flip(1)
    fused = data["student"].clone().requires_grad_()
    ce, kd = cross_entropy_and_forward_kl(fused, data["teacher"], data["labels"], temperature)
    (ce * ce_weights + kd * kd_weights).sum().backward()
    separate = data["student"].clone().requires_grad_()
    expected_ce = F.cross_entropy(separate.transpose(1, 2), data["labels"], reduction="none")
    expected_kd = reference_divergence("forward_kl", separate, data["teacher"], temperature)
    (expected_ce * ce_weights + expected_kd * kd_weights).sum().backward()
    torch.testing.assert_close(ce, expected_ce, **TIGHT)
    torch.testing.assert_close(kd, expected_kd, **TIGHT)
    torch.testing.assert_close(fused.grad, separate.grad, **TIGHT)


def test_log_softmax_and_cross_entropy_match_torch():
    data = make_inputs()
    torch.testing.assert_close(vocab_parallel_log_softmax(data["student"]), F.log_softmax(data["student"], -1))
    ours = value_and_gradient(lambda s: token_cross_entropy(s, data["labels"]), data["student"], data["weights"])
    expected = value_and_gradient(
        lambda s: F.cross_entropy(s.transpose(1, 2), data["labels"], reduction="none"), data["student"], data["weights"]
    )
    torch.testing.assert_close(ours[0], expected[0], **TIGHT)
    torch.testing.assert_close(ours[1], expected[1], **TIGHT)


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_gets_no_gradient(kind):
    data = make_inputs()
    student = data["student"].clone().requires_grad_()
    teacher = data["teacher"].clone().requires_grad_()
    logit_divergence(student, teacher, kind).sum().backward()
    assert teacher.grad is None and student.grad is not None


def test_half_precision_logits_are_computed_in_float32():
    data = make_inputs()
    student, teacher = data["student"].bfloat16(), data["teacher"].bfloat16()
    value = forward_kl(student, teacher)
    assert value.dtype == torch.float32
    expected = reference_divergence("forward_kl", student.double(), teacher.double())
    torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-5)


# (b) zero at equality, positive otherwise, JSD conventions


@pytest.mark.parametrize("top_k", [None, 5])
@pytest.mark.parametrize("kind", KINDS)
def test_divergence_is_zero_iff_distributions_match(kind, top_k):
    data = make_inputs()
    shifted = data["student"] + 4.0 * torch.randn(BATCH, SEQ, 1, dtype=torch.float64)  # same softmax
    same, gradient = value_and_gradient(
        lambda s: logit_divergence(s, shifted, kind, top_k=top_k), data["student"], data["weights"]
    )
    assert same.abs().max() < 1e-12
    assert gradient.abs().max() < 1e-12
    different = logit_divergence(data["student"], data["teacher"], kind, top_k=top_k)
    assert different.min() > 1e-3


def test_jsd_is_symmetric_at_half_and_swaps_beta_with_the_arguments():
    data = make_inputs()
    s, t = data["student"], data["teacher"]
    torch.testing.assert_close(jsd(s, t, 0.5), jsd(t, s, 0.5), **TIGHT)
    torch.testing.assert_close(jsd(s, t, 0.3), jsd(t, s, 0.7), **TIGHT)
    assert (jsd(s, t, 0.3) - jsd(s, t, 0.7)).abs().max() > 1e-3


def test_jsd_of_disjoint_distributions_is_the_entropy_of_beta():
    """beta*KL(T||M) + (1-beta)*KL(S||M) -> H(beta) when p_T and p_S do not overlap (log 2 at beta = 1/2)."""
    teacher = torch.full((1, VOCAB), -60.0, dtype=torch.float64)
    student = teacher.clone()
    teacher[0, 0], student[0, 1] = 60.0, 60.0
    for beta in (0.3, 0.5):
        entropy = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
        assert jsd(student, teacher, beta).item() == pytest.approx(entropy, rel=1e-12)


# (c) temperature and the T^2 factor


@pytest.mark.parametrize("kind", KINDS)
def test_temperature_divides_student_and_teacher_logits(kind):
    data = make_inputs()
    s, t = data["student"], data["teacher"]
    hot = logit_divergence(s, t, kind, temperature=2.5)
    torch.testing.assert_close(hot, logit_divergence(s / 2.5, t / 2.5, kind), **TIGHT)
    assert (hot - logit_divergence(s, t, kind)).abs().max() > 1e-2


def test_t_squared_times_kl_tends_to_the_logit_matching_loss():
    """Hinton et al.: T^2 KL -> sum_v (d_v - mean d)^2 / (2V), d = z_T - z_S, so T^2 keeps KD on a fixed scale."""
    data = make_inputs()
    s, t = data["student"], data["teacher"]
    difference = t - s
    matching = (difference - difference.mean(-1, keepdim=True)).square().sum(-1) / (2 * VOCAB)
    temperature = 1000.0
    torch.testing.assert_close(temperature**2 * forward_kl(s, t, temperature), matching, rtol=2e-2, atol=0)


@pytest.mark.parametrize(
    ("ce_weight", "scale", "expected_kd_factor"),
    [(1.0, True, 0.5 * 4.0), (1.0, False, 0.5), (0.0, True, 0.5)],
    ids=["mixed_scaled", "mixed_unscaled", "kd_only"],
)
def test_combined_loss_scales_kd_by_t_squared_only_when_mixed_with_ce(ce_weight, scale, expected_kd_factor):
    data = make_inputs()
    config = KDConfig(temperature=2.0, kd_weight=0.5, ce_weight=ce_weight, scale_by_temperature_squared=scale)
    assert config.kd_scale == expected_kd_factor
    result = combined_distillation_loss(
        config, data["student"], data["teacher"], data["loss_mask"], labels=data["labels"]
    )
    mask = data["loss_mask"]
    kd = (reference_divergence("forward_kl", data["student"], data["teacher"], 2.0) * mask).sum() / mask.sum()
    ce = (F.cross_entropy(data["student"].transpose(1, 2), data["labels"], reduction="none") * mask).sum() / mask.sum()
    torch.testing.assert_close(result.loss, ce_weight * ce + expected_kd_factor * kd, **TIGHT)
    torch.testing.assert_close(result.parts["kd"], kd, **TIGHT)
    torch.testing.assert_close(result.parts["ce"], ce, **TIGHT)


# (d) top-k


def test_top_k_over_the_whole_vocabulary_is_the_full_divergence():
    data = make_inputs()
    for kind in KINDS:
        torch.testing.assert_close(
            logit_divergence(data["student"], data["teacher"], kind, top_k=VOCAB),
            logit_divergence(data["student"], data["teacher"], kind),
            **TIGHT,
        )


def test_top_k_ignores_the_student_outside_the_teacher_top_k():
    data = make_inputs()
    outside = data["teacher"].topk(VOCAB - 3, dim=-1, largest=False).indices
    perturbed = data["student"].scatter_add(-1, outside, torch.randn(outside.shape, dtype=torch.float64))
    value, gradient = value_and_gradient(lambda s: forward_kl(s, data["teacher"], top_k=3), perturbed, data["weights"])
    torch.testing.assert_close(value, forward_kl(data["student"], data["teacher"], top_k=3), **TIGHT)
    assert gradient.gather(-1, outside).abs().max() == 0


def test_top_k_larger_than_the_vocabulary_raises():
    data = make_inputs()
    with pytest.raises(ValueError, match="top_k=17 exceeds the vocabulary size 16"):
        forward_kl(data["student"], data["teacher"], top_k=VOCAB + 1)


# (e) masks and reduction


def test_response_tokens_exclude_prompt_and_padding():
    data = make_inputs()
    config = KDConfig(ce_weight=0.0, tokens="response")
    response = data["loss_mask"].bool()
    perturbed = torch.where(
        response.unsqueeze(-1), data["student"], data["student"] + 5.0 * torch.rand_like(data["student"])
    )
    student = perturbed.clone().requires_grad_()
    result = combined_distillation_loss(config, student, data["teacher"], data["loss_mask"])
    result.loss.backward()
    per_token = forward_kl(data["student"], data["teacher"])
    torch.testing.assert_close(result.loss, per_token[response].mean(), **TIGHT)
    assert student.grad[~response].abs().max() == 0
    assert (student.grad[response].abs().sum(-1) > 0).all()
    assert result.num_tokens.item() == int(response.sum()) and result.num_tokens.dtype == torch.int32


def test_all_tokens_include_the_prompt_but_not_padding():
    data = make_inputs()
    config = KDConfig(ce_weight=0.0, tokens="all")
    real = data["padding_mask"].bool()
    student = data["student"].clone().requires_grad_()
    result = combined_distillation_loss(
        config, student, data["teacher"], data["loss_mask"], padding_mask=data["padding_mask"]
    )
    result.loss.backward()
    torch.testing.assert_close(result.loss, forward_kl(data["student"], data["teacher"])[real].mean(), **TIGHT)
    assert student.grad[~real].abs().max() == 0
    assert (student.grad[real].abs().sum(-1) > 0).all()
    assert torch.equal(kd_token_mask(data["loss_mask"], "all"), torch.ones_like(data["loss_mask"]))


PADDED_SEQ = SEQ + 3
"""make_inputs' rows (true lengths 6, 4, 5) padded to 9 positions: every row has padding."""


def _padded_batch(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """make_inputs' real tokens in ``[b, PADDED_SEQ]`` rows, with loss mask and padding mask 0 after each row's true
    length, and garbage there: logits of +-1e30 and 1e4-sized noise, label ids of other tokens."""
    generator = torch.Generator().manual_seed(7)
    lengths = data["padding_mask"].sum(-1).long().tolist()
    shape = (BATCH, PADDED_SEQ, VOCAB)
    padded = {key: 1e4 * torch.randn(shape, generator=generator, dtype=torch.float64) for key in ("student", "teacher")}
    padded["student"][..., 0], padded["teacher"][..., 1] = 1e30, -1e30
    padded["labels"] = torch.randint(0, VOCAB, (BATCH, PADDED_SEQ), generator=generator)
    padded["loss_mask"] = torch.zeros(BATCH, PADDED_SEQ, dtype=torch.float64)
    padded["padding_mask"] = torch.zeros(BATCH, PADDED_SEQ, dtype=torch.float64)
    for row, length in enumerate(lengths):
        for key in padded:
            padded[key][row, :length] = data[key][row, :length]
    return padded


@pytest.mark.parametrize("tokens", ["response", "all"])
@pytest.mark.parametrize(
    ("kind", "top_k", "temperature", "ce_weight"),
    [
        ("forward_kl", None, 1.0, 1.0),
        ("forward_kl", 3, 2.0, 0.0),
        ("reverse_kl", None, 2.0, 0.5),
        ("jsd", None, 1.0, 0.0),
    ],
    ids=["forward_kl-fused_with_ce", "forward_kl-top3-T2", "reverse_kl-T2", "jsd"],
)
def test_padded_positions_change_neither_the_loss_nor_its_gradient(tokens, kind, top_k, temperature, ce_weight):
    """Rows padded with garbage logits and labels, loss mask 0 on the padding (as Bridge's batch has it, and as
    ``distillation_forward_step`` passes it, without a padding mask), give the loss of the real tokens alone: the
    unpadded rows laid end to end as one sequence with no padding. ``tokens='all'`` gets the padding mask."""
    data = make_inputs(3)
    config = KDConfig(
        loss=kind, top_k=top_k, temperature=temperature, ce_weight=ce_weight, tokens=tokens, jsd_beta=JSD_BETA
    )
    padded = _padded_batch(data)
    real = padded["padding_mask"].bool()
    student = padded["student"].clone().requires_grad_()
    result = combined_distillation_loss(
        config,
        student,
        padded["teacher"],
        padded["loss_mask"],
        labels=padded["labels"],
        padding_mask=padded["padding_mask"] if tokens == "all" else None,
    )
    result.loss.backward()

    unpadded = {key: padded[key][real].unsqueeze(0) for key in ("student", "teacher", "labels", "loss_mask")}
    alone_student = unpadded["student"].clone().requires_grad_()
    alone = combined_distillation_loss(
        config, alone_student, unpadded["teacher"], unpadded["loss_mask"], labels=unpadded["labels"]
    )
    alone.loss.backward()
    assert 0 < alone.loss.item() < 100
    torch.testing.assert_close(result.loss, alone.loss, **TIGHT)
    for part in ("ce", "kd"):
        torch.testing.assert_close(result.parts[part], alone.parts[part], **TIGHT)
    assert (
        result.num_tokens.item()
        == alone.num_tokens.item()
        == (real.sum() if tokens == "all" else data["loss_mask"].sum())
    )
    torch.testing.assert_close(student.grad[real], alone_student.grad[0], **TIGHT)
    assert student.grad[~real].abs().max() == 0


def test_masked_token_mean_returns_numerator_and_count_and_ignores_masked_nans():
    per_token = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]], dtype=torch.float64)
    mean, total, count = masked_token_mean(per_token, mask)
    assert (mean.item(), total.item(), count.item()) == (13.0 / 4.0, 13.0, 4.0)
    mean, total, count = masked_token_mean(per_token, torch.zeros_like(mask))
    assert (mean.item(), total.item(), count.item()) == (0.0, 0.0, 0.0)


def test_bridge_outputs_follow_the_sum_and_token_count_convention():
    data = make_inputs()
    config = KDConfig(hidden_loss="mse", hidden_layers=[1, 3], hidden_weight=0.25, tokens="all")
    pairs = [(data["student_hidden"], data["teacher_hidden"]), (data["teacher_hidden"], data["student_hidden"] * 2)]
    result = combined_distillation_loss(
        config,
        data["student"],
        data["teacher"],
        data["loss_mask"],
        labels=data["labels"],
        padding_mask=data["padding_mask"],
        hidden_pairs=pairs,
    )
    loss_sum, num_tokens, report = result.bridge_outputs()
    n_real, n_response = data["padding_mask"].sum(), data["loss_mask"].sum()
    assert num_tokens.item() == n_real and num_tokens.dtype == torch.int32
    torch.testing.assert_close(loss_sum, result.loss * n_real, **TIGHT)
    torch.testing.assert_close(report["lm loss"], torch.stack([result.parts["ce"] * n_response, n_response]))
    torch.testing.assert_close(report["kd loss"], torch.stack([result.parts["kd"] * n_real, n_real]))
    torch.testing.assert_close(report["total loss"], torch.stack([result.loss.detach() * n_real, n_real]))
    per_layer = [hidden_state_loss(s, t, "mse").t() for s, t in pairs]
    hidden = (((per_layer[0] + per_layer[1]) / 2) * data["padding_mask"]).sum() / n_real
    torch.testing.assert_close(result.parts["hidden"], hidden, **TIGHT)
    expected = result.parts["ce"] + result.parts["kd"] + 0.25 * hidden
    torch.testing.assert_close(result.loss, expected, **TIGHT)


def test_disabled_config_is_plain_cross_entropy_on_the_loss_mask():
    data = make_inputs()
    config = KDConfig(enabled=False, tokens="all", ce_weight=0.0)
    result = combined_distillation_loss(config, data["student"], None, data["loss_mask"], labels=data["labels"])
    mask = data["loss_mask"]
    ce = (F.cross_entropy(data["student"].transpose(1, 2), data["labels"], reduction="none") * mask).sum() / mask.sum()
    torch.testing.assert_close(result.loss, ce, **TIGHT)
    assert result.parts["kd"] == 0 and result.num_tokens.item() == mask.sum()


@pytest.mark.parametrize("kind", ["mse", "cosine"])
def test_hidden_state_loss_matches_reference(kind):
    data = make_inputs()
    teacher = data["teacher_hidden"].clone().requires_grad_()
    student = data["student_hidden"].clone().requires_grad_()
    value = hidden_state_loss(student, teacher, kind)
    value.sum().backward()
    reference_student = data["student_hidden"].clone().requires_grad_()
    if kind == "mse":
        reference = F.mse_loss(reference_student, data["teacher_hidden"], reduction="none").mean(-1)
    else:
        reference = 1 - F.cosine_similarity(reference_student, data["teacher_hidden"], dim=-1)
    reference.sum().backward()
    torch.testing.assert_close(value, reference.detach(), **TIGHT)
    torch.testing.assert_close(student.grad, reference_student.grad, **TIGHT)
    assert teacher.grad is None and value.shape == (SEQ, BATCH)


# (f) tensor parallelism: TP=1 == TP=2


def _combined_config() -> KDConfig:
    return KDConfig(
        loss="jsd",
        jsd_beta=JSD_BETA,
        temperature=2.0,
        top_k=5,
        kd_weight=0.7,
        hidden_loss="cosine",
        hidden_layers=[0],
        hidden_weight=0.3,
        tokens="all",
    )


def _local_results(tp_group, rank: int, tp: int, sequence_parallel: bool) -> dict:
    """Everything the TP tests compare, on this rank's vocab (and, for hidden states, sequence) shard."""
    data = make_inputs()
    shard = slice(rank * VOCAB // tp, (rank + 1) * VOCAB // tp)
    student, teacher = data["student"][..., shard], data["teacher"][..., shard]
    results = {}
    for kind in KINDS:
        for top_k in TOP_KS:
            results[(kind, top_k)] = value_and_gradient(
                lambda s, kind=kind, top_k=top_k: logit_divergence(
                    s, teacher, kind, temperature=1.5, beta=JSD_BETA, top_k=top_k, tp_group=tp_group
                ),
                student,
                data["weights"],
            )
    results["ce"] = value_and_gradient(
        lambda s: token_cross_entropy(s, data["labels"], tp_group), student, data["weights"]
    )
    fused_logits = student.clone().requires_grad_()
    ce, kd = cross_entropy_and_forward_kl(fused_logits, teacher, data["labels"], 1.5, tp_group)
    (ce * data["weights"] + kd * data["weights"].flip(0)).sum().backward()
    results["fused"] = (torch.stack([ce, kd]).detach(), fused_logits.grad)
    rows = slice(rank * SEQ // tp, (rank + 1) * SEQ // tp) if sequence_parallel else slice(None)
    logits = student.clone().requires_grad_()
    hidden = data["student_hidden"][rows].clone().requires_grad_()
    combined = combined_distillation_loss(
        _combined_config(),
        logits,
        teacher,
        data["loss_mask"],
        labels=data["labels"],
        padding_mask=data["padding_mask"],
        hidden_pairs=[(hidden, data["teacher_hidden"][rows])],
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
    )
    combined.loss.backward()
    results["combined"] = (combined.loss.detach(), logits.grad, hidden.grad, combined.parts)
    return results


def _tp2_worker(rank: int, world_size: int, port: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from tests.support.models import destroy_cpu_parallel, init_cpu_parallel

    init_cpu_parallel(rank=rank, world_size=world_size, port=port, tensor_model_parallel_size=TP)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        results = _local_results(group, rank, TP, sequence_parallel=True)
        data = make_inputs()
        local = data["student"][..., rank * VOCAB // TP : (rank + 1) * VOCAB // TP].float()
        logits, labels = local.transpose(0, 1).contiguous(), data["labels"].t().contiguous()
        megatron_ce = vocab_parallel_cross_entropy(logits, labels, tp_group=group)
        results["megatron_ce"] = megatron_ce.t()
        return results
    finally:
        destroy_cpu_parallel()


@pytest.fixture(scope="module")
def tp_results():
    reference = _local_results(None, 0, 1, sequence_parallel=False)
    return reference, run_on_gloo_ranks(_tp2_worker, TP)


def _gathered_gradient(ranks: list[dict], key) -> torch.Tensor:
    return torch.cat([rank[key][1] for rank in ranks], dim=-1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("top_k", TOP_KS, ids=lambda k: f"top{k}")
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_divergence_and_gradient_equal_tp1(tp_results, kind, top_k):
    reference, ranks = tp_results
    expected_value, expected_gradient = reference[(kind, top_k)]
    assert torch.equal(ranks[0][(kind, top_k)][0], ranks[1][(kind, top_k)][0]), "ranks disagree"
    torch.testing.assert_close(ranks[0][(kind, top_k)][0], expected_value, **TIGHT)
    torch.testing.assert_close(_gathered_gradient(ranks, (kind, top_k)), expected_gradient, **TIGHT)


@pytest.mark.multiprocess
def test_tp2_fused_cross_entropy_and_forward_kl_equal_tp1(tp_results):
    reference, ranks = tp_results
    for rank in ranks:
        torch.testing.assert_close(rank["fused"][0], reference["fused"][0], **TIGHT)
    torch.testing.assert_close(_gathered_gradient(ranks, "fused"), reference["fused"][1], **TIGHT)


@pytest.mark.multiprocess
def test_tp2_cross_entropy_equals_tp1_and_megatron(tp_results):
    reference, ranks = tp_results
    torch.testing.assert_close(ranks[1]["ce"][0], reference["ce"][0], **TIGHT)
    torch.testing.assert_close(_gathered_gradient(ranks, "ce"), reference["ce"][1], **TIGHT)
    torch.testing.assert_close(ranks[0]["megatron_ce"].double(), reference["ce"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
def test_tp2_combined_loss_with_sequence_parallel_hidden_states_equals_tp1(tp_results):
    reference, ranks = tp_results
    loss, logits_gradient, hidden_gradient, parts = reference["combined"]
    for rank in ranks:
        torch.testing.assert_close(rank["combined"][0], loss, **TIGHT)
        for name, value in parts.items():
            torch.testing.assert_close(rank["combined"][3][name], value, **TIGHT)
    torch.testing.assert_close(torch.cat([rank["combined"][1] for rank in ranks], dim=-1), logits_gradient, **TIGHT)
    torch.testing.assert_close(torch.cat([rank["combined"][2] for rank in ranks], dim=0), hidden_gradient, **TIGHT)


# ModelOpt's Megatron KD losses on the same inputs (TP=1 in-process, TP=2 on gloo)


def _modelopt_results(rank: int, tp: int) -> dict:
    """ModelOpt LogitsKLLoss / TopKLogitsKLLoss on [s, b, V/tp] logits, reduced the way Bridge's _mask_loss does."""
    import modelopt.torch.distill.plugins.megatron as modelopt_megatron
    from megatron.core import parallel_state

    from tests.support.models import tiny_gpt_config

    data = make_inputs()
    shard = slice(rank * VOCAB // tp, (rank + 1) * VOCAB // tp)
    config = tiny_gpt_config(tensor_model_parallel_size=tp)
    losses = {
        ("forward_kl", None): modelopt_megatron.LogitsKLLoss(config, temperature=1.5),
        ("reverse_kl", None): modelopt_megatron.LogitsKLLoss(config, temperature=1.5, reverse=True),
        ("forward_kl", 5): modelopt_megatron.TopKLogitsKLLoss(config, temperature=1.5, top_k=5),
    }
    results = {}
    for key, loss_module in losses.items():
        student = data["student"][..., shard].transpose(0, 1).contiguous().requires_grad_()
        per_token, tp_reduce, _ = loss_module(student, data["teacher"][..., shard].transpose(0, 1))
        total = (per_token * data["weights"]).sum()  # per_token is [b, s]
        total.backward()
        value = total.detach().clone()
        if tp_reduce and tp > 1:
            torch.distributed.all_reduce(value, group=parallel_state.get_tensor_model_parallel_group())
        results[key] = (value, student.grad.transpose(0, 1))
    return results


def _modelopt_tp2_worker(rank: int, world_size: int, port: int) -> dict:
    from tests.support.models import destroy_cpu_parallel, init_cpu_parallel

    init_cpu_parallel(rank=rank, world_size=world_size, port=port, tensor_model_parallel_size=TP)
    try:
        return _modelopt_results(rank, TP)
    finally:
        destroy_cpu_parallel()


def _ours(kind, top_k):
    data = make_inputs()
    values, gradient = value_and_gradient(
        lambda s: logit_divergence(s, data["teacher"], kind, temperature=1.5, top_k=top_k),
        data["student"],
        data["weights"],
    )
    return (values * data["weights"]).sum(), gradient


MODELOPT_TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # ModelOpt computes in float32


def test_forward_kl_matches_modelopt_at_tp1():
    pytest.importorskip("modelopt.torch.distill.plugins.megatron")
    for key, (value, gradient) in _modelopt_results(0, 1).items():
        expected_value, expected_gradient = _ours(*key)
        torch.testing.assert_close(value.double(), expected_value, **MODELOPT_TOLERANCE)
        torch.testing.assert_close(gradient.double(), expected_gradient, **MODELOPT_TOLERANCE)


@pytest.mark.multiprocess
def test_forward_kl_matches_modelopt_at_tp2_except_top_k_gradient():
    """ModelOpt's values agree at TP=2; its top-k gradient is TP times too large (all_gather backward sums)."""
    pytest.importorskip("modelopt.torch.distill.plugins.megatron")
    ranks = run_on_gloo_ranks(_modelopt_tp2_worker, TP)
    for key in ranks[0]:
        expected_value, expected_gradient = _ours(*key)
        gradient = torch.cat([rank[key][1] for rank in ranks], dim=-1).double()
        torch.testing.assert_close(ranks[0][key][0].double(), expected_value, **MODELOPT_TOLERANCE)
        factor = TP if key[1] is not None else 1
        torch.testing.assert_close(gradient, factor * expected_gradient, **MODELOPT_TOLERANCE)


# (g) configuration errors name the field


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss": "kl"}, "KDConfig.loss='kl' is invalid: expected one of forward_kl, reverse_kl, jsd"),
        ({"jsd_beta": 0.0}, "KDConfig.jsd_beta=0.0 is invalid: expected a finite number in (0, 1)"),
        ({"jsd_beta": 1.0}, "KDConfig.jsd_beta=1.0 is invalid"),
        ({"temperature": 0.0}, "KDConfig.temperature=0.0 is invalid: expected a finite number > 0"),
        ({"temperature": float("nan")}, "KDConfig.temperature=nan is invalid"),
        ({"kd_weight": -1.0}, "KDConfig.kd_weight=-1.0 is invalid: expected a finite number >= 0"),
        ({"ce_weight": -0.5}, "KDConfig.ce_weight=-0.5 is invalid"),
        ({"hidden_weight": -1}, "KDConfig.hidden_weight=-1 is invalid"),
        ({"top_k": 0}, "KDConfig.top_k=0 is invalid: expected an integer >= 1 (or null)"),
        ({"top_k": 2.5}, "KDConfig.top_k=2.5 is invalid"),
        ({"tokens": "prompt"}, "KDConfig.tokens='prompt' is invalid: expected one of all, response"),
        ({"hidden_loss": "l1"}, "KDConfig.hidden_loss='l1' is invalid: expected one of none, mse, cosine"),
        ({"hidden_loss": "mse"}, "KDConfig.hidden_layers=[] is invalid with hidden_loss='mse'"),
        ({"hidden_layers": [1]}, "KDConfig.hidden_loss='none' is invalid with hidden_weight=0.0"),
        ({"hidden_loss": "mse", "hidden_layers": [1, 1]}, "KDConfig.hidden_layers=[1, 1] is invalid"),
        ({"hidden_loss": "mse", "hidden_layers": [-1]}, "KDConfig.hidden_layers=[-1] is invalid"),
        ({"enabled": 1}, "KDConfig.enabled=1 is invalid: expected true or false"),
        ({"kd_weight": 0.0, "ce_weight": 0.0}, "KDConfig.kd_weight=0 is invalid with ce_weight=0"),
    ],
)
def test_bad_config_values_raise_errors_naming_the_field(overrides, message):
    with pytest.raises(ValueError) as error:
        KDConfig(**overrides)
    assert message in str(error.value)


def test_config_defaults_mix_ce_and_forward_kl_on_response_tokens():
    config = KDConfig()
    assert (config.loss, config.ce_weight, config.kd_weight, config.temperature) == ("forward_kl", 1.0, 1.0, 1.0)
    assert (config.tokens, config.top_k, config.hidden_loss, config.kd_scale) == ("response", None, "none", 1.0)


def test_the_fused_path_works_in_row_chunks_and_leaves_the_teacher_logits_untouched(monkeypatch):
    """Row chunks (as for long sequences and large vocabularies) give the one-chunk result; inputs stay as given."""
    from nemo_noise_plugin.distillation import kd_kernel

    data = make_inputs(4)
    teacher_before = data["teacher"].clone()
    whole = data["student"].clone().requires_grad_()
    ce, kd = cross_entropy_and_forward_kl(whole, data["teacher"], data["labels"], 2.0)
    (ce + kd * data["weights"]).sum().backward()
    monkeypatch.setattr(kd_kernel, "_CHUNK_ELEMENTS", 2 * VOCAB)  # two rows per chunk: 9 chunks of 18 rows
    chunked = data["student"].clone().requires_grad_()
    chunked_ce, chunked_kd = cross_entropy_and_forward_kl(chunked, data["teacher"], data["labels"], 2.0)
    (chunked_ce + chunked_kd * data["weights"]).sum().backward()
    torch.testing.assert_close(chunked_ce, ce, **TIGHT)
    torch.testing.assert_close(chunked_kd, kd, **TIGHT)
    torch.testing.assert_close(chunked.grad, whole.grad, **TIGHT)
    assert torch.equal(data["teacher"], teacher_before)


def test_response_tokens_exclude_padding_that_the_loss_mask_covers():
    """A loss mask of 1 on padding (a data path that masks prompts but not padding) is cut by the padding mask:
    the KD mean and its token count are those of the real response tokens alone, not of the padding's garbage."""
    data = make_inputs()
    response = data["loss_mask"].bool()
    loose = torch.where(data["padding_mask"].bool(), data["loss_mask"], torch.ones_like(data["loss_mask"]))
    assert int(loose.sum()) == int(response.sum()) + 3  # rows 1 and 2 end in 2 and 1 padding positions
    mask = kd_token_mask(loose, "response", data["padding_mask"])
    assert torch.equal(mask, data["loss_mask"])
    student = torch.where(response.unsqueeze(-1), data["student"], torch.full_like(data["student"], 1e4))
    config = KDConfig(ce_weight=0.0, tokens="response")
    result = combined_distillation_loss(config, student, data["teacher"], loose, padding_mask=data["padding_mask"])
    torch.testing.assert_close(result.loss, forward_kl(data["student"], data["teacher"])[response].mean(), **TIGHT)
    assert result.num_tokens.item() == int(response.sum())
