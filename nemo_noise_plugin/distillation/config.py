"""The distillation configuration: which divergence ties the noisy student to the clean teacher, on which tokens.

Read by ``distillation.losses.combined_distillation_loss``; declared as a Bridge-style dataclass so Hydra overrides,
YAML and ``to_cfg_dict`` see every setting as a field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from nemo_noise_plugin.presets import load_config_yaml_fields, preset_path
from nemo_noise_plugin.validation import (
    SettingError,
    check_bool,
    check_choice,
    check_int,
    check_number,
)

KDLossKind = Literal["forward_kl", "reverse_kl", "jsd"]
KDTokens = Literal["all", "response"]
HiddenLossKind = Literal["none", "mse", "cosine"]

KD_LOSSES: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd")
KD_TOKEN_SELECTIONS: tuple[str, ...] = ("all", "response")
HIDDEN_LOSSES: tuple[str, ...] = ("none", "mse", "cosine")
_FIELD = "KDConfig."
MIN_TEMPERATURE = 1 / 80
"""The smallest ``temperature``: below it, logits one unit apart are more than 80 apart after division by T, near
float32's smallest normal number (e^-87.3), so the softened softmax is one-hot and, scaled by T^2, the KD term
vanishes: the run would train on cross-entropy alone."""
MAX_TEMPERATURE = 1e6
"""The largest ``temperature``: above it, logits one unit apart differ by less than 1e-6 after division by T, a few
steps of float32's resolution (1.2e-7), so both softened distributions are uniform to float32 and the KD term is
rounding error."""


@dataclass
class KDConfig:
    """Knowledge-distillation settings for a noisy student and a frozen clean teacher, validated on construction.

    The training loss is ``ce_weight * CE + kd_weight * s * KD + hidden_weight * H`` where each term is a mean over
    its tokens, ``KD`` is the chosen divergence of the temperature-softened distributions, ``H`` the hidden-state
    loss averaged over ``hidden_layers``, and ``s = temperature**2`` when ``scale_by_temperature_squared`` and
    ``ce_weight > 0`` (Hinton et al. 2015: keeps the KD gradient on the CE scale as ``T`` grows), else ``s = 1``.

    The defaults (CE 1 + forward KL 1 at ``T = 1`` on response tokens) are the usual noise-robustness recipe: the
    task loss keeps the student on the data while the KL pulls its noisy-input predictions onto the clean
    teacher's. ``enabled=False`` reduces the loss to plain CE (the teacher need not run).
    """

    enabled: bool = True
    """Off switch: False trains on the cross-entropy alone."""
    loss: KDLossKind = "forward_kl"
    """``forward_kl`` KL(teacher||student), ``reverse_kl`` KL(student||teacher) or ``jsd`` (generalised JSD)."""
    jsd_beta: float = 0.5
    """``jsd`` only: ``beta * KL(T||M) + (1-beta) * KL(S||M)``, ``M = beta*T + (1-beta)*S`` (TRL's convention)."""
    temperature: float = 1.0
    """Softmax temperature applied to both student and teacher logits."""
    kd_weight: float = 1.0
    """Weight of the logit divergence."""
    ce_weight: float = 1.0
    """Weight of the student's cross-entropy on the labels (over the loss mask)."""
    scale_by_temperature_squared: bool = True
    """Multiply the divergence by ``temperature**2`` when it is mixed with cross-entropy (``ce_weight > 0``)."""
    top_k: int | None = None
    """Distil only the teacher's top-k tokens: both distributions renormalised over that set (None: full vocab)."""
    tokens: KDTokens = "response"
    """Distil ``response`` tokens (loss-mask positions) or ``all`` non-padding positions (needs a padding mask)."""
    hidden_loss: HiddenLossKind = "none"
    """Match layer outputs too: ``none``, ``mse`` (mean over hidden of the squared error) or ``cosine`` (1 - cos)."""
    hidden_layers: list[int] = field(default_factory=list)
    """0-based indices of the decoder layers whose outputs are matched (required with a hidden loss)."""
    hidden_weight: float = 0.0
    """Weight of the hidden-state loss (averaged over ``hidden_layers``)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field as it is now; ``SettingError`` (a ``ValueError``) naming the field, the value and what
        is allowed.

        Runs on construction and once more at ``NoisyDistillationProvider.finalize`` (which Bridge's
        ``ConfigContainer.validate`` calls), because an assignment after construction (``config.temperature = 0``)
        does not run ``__post_init__``; code past the gate trusts the config. Normalises ``hidden_layers`` to a list.
        """
        self._check()

    def _check(self) -> None:
        check_choice(_FIELD + "loss", self.loss, KD_LOSSES)
        check_choice(_FIELD + "tokens", self.tokens, KD_TOKEN_SELECTIONS)
        check_choice(_FIELD + "hidden_loss", self.hidden_loss, HIDDEN_LOSSES)
        for name in ("enabled", "scale_by_temperature_squared"):
            check_bool(_FIELD + name, getattr(self, name))
        check_number(_FIELD + "jsd_beta", self.jsd_beta, minimum=0.0, maximum=1.0, inclusive=False)
        check_number(_FIELD + "temperature", self.temperature, minimum=0.0, inclusive=False)
        check_number(
            _FIELD + "temperature",
            self.temperature,
            minimum=MIN_TEMPERATURE,
            maximum=MAX_TEMPERATURE,
            why=f": below {MIN_TEMPERATURE:g} the softened softmax is one-hot in float32 and, scaled by T^2, the KD "
            f"term vanishes (CE alone would train); above {MAX_TEMPERATURE:g} both distributions are uniform to "
            "float32",
        )
        for name in ("kd_weight", "ce_weight", "hidden_weight"):
            check_number(_FIELD + name, getattr(self, name), minimum=0.0)
        if self.top_k is not None:
            check_int(_FIELD + "top_k", self.top_k, minimum=1, optional=True)
        self._check_hidden()
        if self.enabled and self.ce_weight == 0 and self.kd_weight == 0 and self.hidden_weight == 0:
            raise SettingError(
                _FIELD + "kd_weight",
                0,
                "at least one positive weight (or enabled=false)",
                context=" with ce_weight=0 and hidden_weight=0",
            )

    def _check_hidden(self) -> None:
        layers = self.hidden_layers
        valid = isinstance(layers, (list, tuple)) and all(
            not isinstance(index, bool) and isinstance(index, int) and index >= 0 for index in layers
        )
        if not valid or len(set(layers)) != len(layers):
            raise SettingError(_FIELD + "hidden_layers", layers, "a list of distinct layer indices >= 0")
        self.hidden_layers = list(layers)
        if self.hidden_loss == "none" and (self.hidden_weight > 0 or self.hidden_layers):
            raise SettingError(
                _FIELD + "hidden_loss",
                "none",
                "hidden_loss 'mse' or 'cosine' (or weight 0 and no layers)",
                context=f" with hidden_weight={self.hidden_weight!r} and hidden_layers={self.hidden_layers!r}",
            )
        if self.hidden_loss != "none" and not self.hidden_layers:
            raise SettingError(
                _FIELD + "hidden_layers",
                [],
                "at least one layer index",
                context=f" with hidden_loss={self.hidden_loss!r}",
            )

    @property
    def kd_scale(self) -> float:
        """The factor on the divergence: ``kd_weight``, times ``temperature**2`` when mixed with cross-entropy."""
        squared = self.temperature**2 if self.scale_by_temperature_squared and self.ce_weight > 0 else 1.0
        return self.kd_weight * squared


def load_kd_config(name_or_path: str | os.PathLike[str], **overrides: Any) -> KDConfig:
    """A ``KDConfig`` from a preset name (``forward_kl_t2``; ``presets.available_presets("kd")``) or a YAML file of
    its fields, then ``overrides``; validated like every ``KDConfig``."""
    return load_config_yaml_fields(KDConfig, preset_path("kd", name_or_path), **overrides)
