"""The robustness report: how much a model's loss and predictions move when its embeddings are noised.

For each noise scale the model is evaluated on the same held-out batches with the noise on (in eval mode, keyed by
the batch index so every model and scale sees comparable draws): the loss, and KL(clean || noisy), the divergence
between the model's own predictions without and with noise, averaged over loss tokens. A robust model keeps both
low as the scale grows. ``RobustnessReport`` is a Megatron-Bridge callback that measures it on held-out batches at
the start and at the end of training (Bridge's loop or the CPU loop) and writes the table, JSON and PNG; the
distillation benchmark uses ``robustness_curve`` directly.

When the report has a control (the same training without noise, ``no noise``), it also says at every level whether
the noise-trained model (``after``) beats it, with a paired interval over the batches (``robustness_statistics``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nemo_noise_plugin.distillation.teacher import build_clean_teacher
from nemo_noise_plugin.jobs.batches import collate, recipe_datasets
from nemo_noise_plugin.jobs.cpu.parallel import causal_attention_mask
from nemo_noise_plugin.jobs.reports.artifacts import RunReport
from nemo_noise_plugin.jobs.reports.provenance import describe_report, level_field, run_title
from nemo_noise_plugin.jobs.reports.robustness_statistics import (
    CONFIDENCE,
    CONTROL,
    TRAINED,
    LevelComparison,
    RobustnessPoint,
    compare_to_control,
    format_comparison,
    interval_name,
    summarize_comparison,
)
from nemo_noise_plugin.model.make_noisy import make_noisy
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.families import noise_family
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

REPORT_MULTIPLES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
"""Noise levels the report sweeps, as multiples of the level the model was trained with (0: no noise)."""
HELD_OUT_BATCHES = 16
"""Held-out micro-batches per curve: the samples of the comparison's interval."""


def scale_field(noise: NoiseConfig) -> str:
    """The noise level a sweep varies: the field that sets the level (``provenance.level_field``: the mechanism's
    magnitude field, ``distance_multiple`` under ``embedding_distance`` scaling; ``1/eta``, ``1/epsilon`` for the
    privacy mechanisms, whose fields grow as the noise shrinks), so every sweep's axis grows with the noise."""
    family = noise_family(noise.mechanism)
    field = level_field(noise)
    return f"1/{field}" if family.larger_is_quieter else field


def trained_scale(noise: NoiseConfig) -> float:
    """The noise level of ``noise`` on the ``scale_field`` axis (the field's default when noise is off or zero)."""
    family = noise_family(noise.mechanism)
    field = level_field(noise)
    value = getattr(noise, field) if noise.enabled else None
    if not value:
        value = getattr(NoiseConfig(), field) or 1.0
    return 1.0 / value if family.larger_is_quieter else float(value)


def sweep_scales(noise: NoiseConfig, multiples: Sequence[float] = REPORT_MULTIPLES) -> list[float]:
    """The ``scale_field`` values of a sweep around the trained level: ``multiples`` of ``trained_scale``."""
    return [trained_scale(noise) * multiple for multiple in multiples]


def noise_at_scale(noise: NoiseConfig, scale: float, seed: int = 777) -> NoiseConfig:
    """``noise`` at level ``scale`` on its ``scale_field`` axis (0: off), on in eval mode, with a fixed seed."""
    family = noise_family(noise.mechanism)
    field = level_field(noise)
    common = dict(training_only=False, seed=seed, schedule="constant", warmup_steps=0)
    if scale == 0:
        return dataclasses.replace(noise, enabled=False, **common)
    value = 1.0 / scale if family.larger_is_quieter else float(scale)
    return dataclasses.replace(noise, **{field: value}, enabled=True, **common)


def robustness_curve(
    model: nn.Module,
    batches: Sequence[dict[str, torch.Tensor]],
    noise: NoiseConfig,
    scales: Sequence[float],
    logits_of: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
) -> list[RobustnessPoint]:
    """Loss and KL(clean || noisy) of ``model`` at each scale (``logits_of(model, batch)`` -> ``[b, s, V]``).

    Batches hold ``labels`` and ``loss_mask`` ``[b, s]``. The model (wrapped or not) is not modified: it is
    evaluated through frozen copies (``build_clean_teacher``), clean and noisy. Scale 0 is the clean copy itself
    (KL exactly 0): a second copy with the noise off computes the same function, but CPU matrix kernels may round a
    copy at another address differently (about 1e-9 nats on the hybrid model in CI).
    """
    clean = build_clean_teacher(model)  # a frozen, noise-free copy that shares groups and config
    clean.eval()
    points = []
    with torch.no_grad():
        clean_log_probs = [logits_of(clean, batch).float().log_softmax(-1) for batch in batches]
        tokens = sum(batch["loss_mask"].sum() for batch in batches)
        for scale in scales:
            noisy = None if scale == 0 else make_noisy(build_clean_teacher(clean), noise_at_scale(noise, scale))
            loss = kl = 0.0
            batch_loss, batch_kl = [], []
            for index, (reference, batch) in enumerate(zip(clean_log_probs, batches, strict=True)):
                log_probs = reference if noisy is None else _noisy_log_probs(noisy, batch, index, logits_of)
                mask = batch["loss_mask"]
                picked = log_probs.gather(-1, batch["labels"].long().unsqueeze(-1)).squeeze(-1)
                one_loss = -(picked * mask).sum()
                one_kl = ((reference.exp() * (reference - log_probs)).sum(-1) * mask).sum()
                loss, kl = loss + one_loss, kl + one_kl
                batch_tokens = mask.sum().clamp(min=1)
                batch_loss.append(float(one_loss / batch_tokens))
                batch_kl.append(float(one_kl / batch_tokens))
            points.append(
                RobustnessPoint(
                    float(scale), float(loss / tokens), float(kl / tokens), tuple(batch_loss), tuple(batch_kl)
                )
            )
    return points


def _noisy_log_probs(
    noisy: nn.Module,
    batch: dict[str, torch.Tensor],
    index: int,
    logits_of: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
) -> torch.Tensor:
    """Log-probabilities of ``noisy`` (eval mode) on ``batch``, its noise keyed by the batch ``index``."""
    noisy.eval()
    noisy.noise_clock.start_iteration(index)
    with noisy.noise_batch_inputs(batch["loss_mask"]):
        return logits_of(noisy, batch).float().log_softmax(-1)


def format_report(curves: dict[str, list[RobustnessPoint]], scale_name: str) -> str:
    """A plain-text table: one row per scale, loss and KL columns per model."""
    names = list(curves)
    header = f"{scale_name:>10}" + "".join(f"{name + ' loss':>18}{name + ' KL':>16}" for name in names)
    rows = [header]
    for index, point in enumerate(curves[names[0]]):
        cells = "".join(f"{curves[n][index].loss:>18.4f}{curves[n][index].kl:>16.5f}" for n in names)
        rows.append(f"{point.scale:>10g}" + cells)
    return "\n".join(rows)


def plot_report(curves: dict[str, list[RobustnessPoint]], scale_name: str, path: str, title: str = "") -> bool:
    """Write the loss and KL curves as a PNG titled ``title``; returns False (and writes nothing) without matplotlib."""
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
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def logits_of(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits ``[b, s, V]`` of a model chunk for a batch (no labels)."""
    return module(batch["tokens"], batch["position_ids"], batch["attention_mask"])


def report_json(
    curves: dict[str, list[RobustnessPoint]], comparisons: Sequence[LevelComparison] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """``robustness.json``: each curve as a list of points with their per-batch values; with ``comparisons``, each
    point of the noise-trained curve also holds ``vs_control``: its ``LevelComparison`` against the control."""
    data = {name: [dataclasses.asdict(point) for point in points] for name, points in curves.items()}
    if comparisons is not None:
        interval = interval_name(CONFIDENCE, comparisons[0].batches if comparisons else 0)
        for point, comparison in zip(data[TRAINED], comparisons, strict=True):
            point["vs_control"] = {"control": CONTROL, "interval": interval, **dataclasses.asdict(comparison)}
            del point["vs_control"]["scale"]
    return data


def write_report(
    curves: dict[str, list[RobustnessPoint]],
    scale_name: str,
    report: RunReport,
    title: str = "",
    config: Any = None,
) -> Path:
    """Print the robustness table and write it as ``robustness.json`` and ``robustness.png`` into ``report``.

    With a control curve (``no noise``) beside the noise-trained one (``after``), also the comparison per level
    (``compare_to_control``): printed, summarised in words, and in the JSON as each ``after`` point's ``vs_control``.
    ``config`` (the run's resolved ``ConfigContainer``) first gives the report its provenance (``describe_report``);
    the JSON holds the run's ``provenance`` when the report has it (``RunReport.describe``); without a ``title`` the
    title is ``run_title`` of it. Both files appear together (``RunReport.finish``) or not at all; returns the
    report's folder.
    """
    if config is not None:
        describe_report(report, config)
    if not title and report.provenance is not None:
        title = run_title(report.provenance)
    print(f"\nrobustness report{f' ({title})' if title else ''}: held-out loss and KL(clean || noisy) in nats/token")
    print(f"against {scale_name}, the noise level, around the level of training")
    print(format_report(curves, scale_name))
    comparisons = None
    if TRAINED in curves and CONTROL in curves:
        comparisons = compare_to_control(curves[TRAINED], curves[CONTROL])
        interval = interval_name(CONFIDENCE, comparisons[0].batches)
        print(f"\nnoise training ({TRAINED}) - control ({CONTROL}) per held-out batch: mean [{interval}]")
        print("(lower is better for both; no difference: the interval includes 0)")
        print(format_comparison(comparisons, scale_name))
        print(summarize_comparison(comparisons))
    report.write_json("robustness.json", report_json(curves, comparisons))
    can_plot = importlib.util.find_spec("matplotlib") is not None
    if can_plot:
        report.write("robustness.png", lambda path: plot_report(curves, scale_name, str(path), title))
    folder = report.finish()
    plot = f"; plot: {folder / 'robustness.png'}" if can_plot else " (install matplotlib for the plot)"
    print(f"report: {folder / 'robustness.json'}{plot}")
    return folder


def held_out_batches(state: Any, count: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of the run's validation split (Bridge's ``GlobalState``: ``context.state``), from the
    datasets as Bridge's loop has them (``recipe_datasets``), one example per row also when the run packs its
    finetuning data (the model is evaluated without packed-sequence parameters); an explicit causal mask on the CPU.
    """
    config = state.cfg
    _, valid, _ = recipe_datasets(state, 0, count * config.train.micro_batch_size, unpacked=True)
    mask = causal_attention_mask(config.model.seq_length) if device.type == "cpu" else None
    return collate(valid, count, config.train.micro_batch_size, mask, device)


_BEFORE_KEY = "robustness_before"
"""Where the 'before' curve is kept in the callbacks' ``user_state``, which checkpoints of the CPU loop save."""


class RobustnessReport(import_bridge("megatron.bridge.training.callbacks").Callback):
    """Bridge callback: the robustness curve of the first model chunk at the start and at the end of training.

    It measures ``HELD_OUT_BATCHES`` validation micro-batches (the class attribute ``BATCHES``).

    At the end (rank 0) it prints the table and writes ``robustness.{json,png}`` into ``report`` (a ``RunReport``:
    ``<run dir>/reports/<run id>/``, both files or none), with the ``references`` curves (e.g. the same training
    without noise) beside its own. With ``report=None`` it only measures the end curve (``curves["after"]``), for a
    reference run. A run that stops before its last iteration writes no report. The JSON holds the run's
    ``provenance`` (``RunReport.describe`` of the run's config); without a ``title`` the figure's title is
    ``jobs.reports.provenance.run_title`` of it (``noise off`` for a run without noise).
    """

    BATCHES = HELD_OUT_BATCHES
    """Held-out micro-batches per curve; a subclass may measure more or fewer."""

    def __init__(
        self,
        noise: NoiseConfig,
        report: RunReport | None,
        title: str = "",
        references: dict[str, list[RobustnessPoint]] | None = None,
    ) -> None:
        self.noise, self.report, self.title = noise, report, title
        self.references = dict(references or {})
        self.curves: dict[str, list[RobustnessPoint]] = {}
        self.folder: Path | None = None
        """The written report's folder, once training has ended."""
        self.batches: list[dict[str, torch.Tensor]] | None = None

    def _curve(self, context: Any) -> list[RobustnessPoint]:
        from megatron.core.utils import unwrap_model

        model = unwrap_model(context.model[0])
        if self.batches is None:
            device = next(model.parameters()).device
            self.batches = held_out_batches(context.state, self.BATCHES, device)
        return robustness_curve(model, self.batches, self.noise, sweep_scales(self.noise), logits_of)

    def on_train_start(self, context: Any) -> None:
        if self.report is None:
            return
        step = context.state.train_state.step
        saved = context.user_state.get(_BEFORE_KEY) if step else None
        if saved is not None:  # the CPU loop's checkpoints keep the callbacks' user_state
            self.curves["before"] = saved
            print(f"resumed at iteration {step}: the report's 'before' is the one measured at iteration 0")
            return
        self.curves["before"] = context.user_state[_BEFORE_KEY] = self._curve(context)
        if step:
            print(f"resumed: the report's 'before' is the model at iteration {step}")

    def on_train_end(self, context: Any) -> None:
        self.curves["after"] = self._curve(context)
        if self.report is None:
            return
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            curves = {"before": self.curves["before"], **self.references, "after": self.curves["after"]}
            self.folder = write_report(curves, scale_field(self.noise), self.report, self.title, context.state.cfg)
