"""The robustness report: how much a model's loss and predictions move when its embeddings are noised.

For each noise scale the model is evaluated on the same held-out batches with the noise on (in eval mode, keyed by
the batch index so every model and scale sees comparable draws): the loss, and KL(clean || noisy), the divergence
between the model's own predictions without and with noise, averaged over loss tokens. A robust model keeps both
low as the scale grows. Used by the main job (before/after training) and the distillation benchmark.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nemo_noise_plugin.distillation.teacher import build_clean_teacher
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noisy_gpt import make_noisy

_SCALE_FIELDS = {
    "uniform": "alpha",
    "gaussian": "sigma",
    "quantization": "quantization_step",
    "relative": "relative_scale",
}


@dataclass(frozen=True)
class RobustnessPoint:
    """Held-out loss and KL(clean || noisy), in nats per loss token, at one noise scale."""

    scale: float
    loss: float
    kl: float


def scale_field(noise: NoiseConfig) -> str:
    """The setting a robustness sweep varies: the mechanism's magnitude (NEFTune alpha for privacy mechanisms)."""
    return _SCALE_FIELDS.get(noise.mechanism, "alpha")


def noise_at_scale(noise: NoiseConfig, scale: float, seed: int = 777) -> NoiseConfig:
    """``noise`` with its magnitude set to ``scale``, on in eval mode, with a fixed evaluation seed."""
    mechanism = noise.mechanism if noise.mechanism in _SCALE_FIELDS else "uniform"
    base = dataclasses.replace(noise, mechanism=mechanism) if mechanism != noise.mechanism else noise
    return dataclasses.replace(
        base,
        **{scale_field(base): float(scale)},
        enabled=True,
        training_only=False,
        seed=seed,
        schedule="constant",
        warmup_steps=0,
    )


def robustness_curve(
    model: nn.Module,
    batches: Sequence[dict[str, torch.Tensor]],
    noise: NoiseConfig,
    scales: Sequence[float],
    logits_of: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
) -> list[RobustnessPoint]:
    """Loss and KL(clean || noisy) of ``model`` at each scale (``logits_of(model, batch)`` -> ``[b, s, V]``).

    Batches hold ``labels`` and ``loss_mask`` ``[b, s]``. The model (wrapped or not) is not modified: it is
    evaluated through frozen copies (``build_clean_teacher``), clean and noisy.
    """
    clean = build_clean_teacher(model)  # a frozen, noise-free copy that shares groups and config
    clean.eval()
    points = []
    with torch.no_grad():
        clean_log_probs = [logits_of(clean, batch).float().log_softmax(-1) for batch in batches]
        tokens = sum(batch["loss_mask"].sum() for batch in batches)
        for scale in scales:
            noisy = make_noisy(build_clean_teacher(clean), noise_at_scale(noise, scale))
            noisy.eval()
            loss = kl = 0.0
            for index, (reference, batch) in enumerate(zip(clean_log_probs, batches, strict=True)):
                noisy.noise_clock.start_iteration(index)
                with noisy.noise_batch_inputs(batch["loss_mask"]):
                    log_probs = logits_of(noisy, batch).float().log_softmax(-1)
                mask = batch["loss_mask"]
                picked = log_probs.gather(-1, batch["labels"].long().unsqueeze(-1)).squeeze(-1)
                loss += -(picked * mask).sum()
                kl += ((reference.exp() * (reference - log_probs)).sum(-1) * mask).sum()
            points.append(RobustnessPoint(float(scale), float(loss / tokens), float(kl / tokens)))
    return points


def format_report(curves: dict[str, list[RobustnessPoint]], scale_name: str) -> str:
    """A plain-text table: one row per scale, loss and KL columns per model."""
    names = list(curves)
    header = f"{scale_name:>10}" + "".join(f"{name + ' loss':>18}{name + ' KL':>16}" for name in names)
    rows = [header]
    for index, point in enumerate(curves[names[0]]):
        cells = "".join(f"{curves[n][index].loss:>18.4f}{curves[n][index].kl:>16.5f}" for n in names)
        rows.append(f"{point.scale:>10g}" + cells)
    return "\n".join(rows)


def plot_report(curves: dict[str, list[RobustnessPoint]], scale_name: str, path: str) -> bool:
    """Write the loss and KL curves as a PNG; returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (loss_axis, kl_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for name, points in curves.items():
        scales = [point.scale for point in points]
        loss_axis.plot(scales, [point.loss for point in points], marker="o", label=name)
        kl_axis.plot(scales, [point.kl for point in points], marker="o", label=name)
    loss_axis.set(xlabel=scale_name, ylabel="held-out loss (nats/token)", title="Loss under embedding noise")
    kl_axis.set(xlabel=scale_name, ylabel="KL(clean || noisy) (nats/token)", title="Prediction shift under noise")
    for axis in (loss_axis, kl_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
