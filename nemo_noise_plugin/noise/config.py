"""The noise configuration: which noise is added to the decoder input, how large, and when."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

NoiseMechanism = Literal["uniform", "gaussian"]
NoiseScaling = Literal["true_length", "padded_length", "absolute"]

MECHANISMS: tuple[str, ...] = ("uniform", "gaussian")
SCALINGS: tuple[str, ...] = ("true_length", "padded_length", "absolute")


@dataclass
class NoiseConfig:
    """Embedding-noise settings, validated on construction.

    The noise added to each decoder-input element is ``c * m * u`` where ``u`` is standard noise of the
    mechanism (``uniform``: U(-1, 1), NEFTune; ``gaussian``: N(0, 1)), ``m`` its magnitude (``alpha`` for
    uniform, ``sigma`` for gaussian) and ``c`` the scaling factor: ``1 / sqrt(L * d)`` with ``d`` the hidden size
    and ``L`` the sequence length (``true_length``: each sequence's own length from the loss or padding mask, as
    in the NEFTune paper's code; ``padded_length``: the padded global sequence length, as in HF transformers), or
    ``1`` (``absolute``).
    """

    enabled: bool = True
    """Off switch: False leaves the model exactly as a plain GPT model."""
    mechanism: NoiseMechanism = "uniform"
    """``uniform`` (NEFTune) or ``gaussian``."""
    alpha: float = 5.0
    """NEFTune alpha, the magnitude of ``uniform`` noise (the paper uses 5, 10 or 15)."""
    sigma: float = 1.0
    """Standard-deviation multiplier of ``gaussian`` noise."""
    scaling: NoiseScaling = "true_length"
    """``true_length``, ``padded_length`` or ``absolute``; see the class docstring."""
    training_only: bool = True
    """Add noise only while the model is in training mode (``model.train()``); False noises in eval too."""
    seed: int = 1234
    """Seed of the noise random stream, independent of Megatron's model-parallel RNG."""

    def __post_init__(self) -> None:
        _check_choice("mechanism", self.mechanism, MECHANISMS)
        _check_choice("scaling", self.scaling, SCALINGS)
        _check_bool("enabled", self.enabled)
        _check_bool("training_only", self.training_only)
        _check_non_negative("alpha", self.alpha)
        _check_non_negative("sigma", self.sigma)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"NoiseConfig.seed={self.seed!r} is invalid: expected an integer >= 0.")

    @property
    def magnitude(self) -> float:
        """The magnitude of the configured mechanism: ``alpha`` for uniform, ``sigma`` for gaussian."""
        return self.alpha if self.mechanism == "uniform" else self.sigma

    @property
    def is_active_configuration(self) -> bool:
        """True when the settings add a non-zero noise at all (enabled and a positive magnitude)."""
        return self.enabled and self.magnitude > 0


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"NoiseConfig.{name}={value!r} is invalid: expected one of {', '.join(allowed)}.")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"NoiseConfig.{name}={value!r} is invalid: expected true or false.")


def _check_non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"NoiseConfig.{name}={value!r} is invalid: expected a finite number >= 0.")


def load_noise_config(path: str | os.PathLike[str], **overrides: Any) -> NoiseConfig:
    """Read a ``NoiseConfig`` from a YAML file of its fields (e.g. ``configs/noise/*.yaml``), then apply overrides."""
    import yaml

    with open(path) as handle:
        values = yaml.safe_load(handle) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of NoiseConfig fields, got {type(values).__name__}.")
    allowed = [field.name for field in dataclasses.fields(NoiseConfig)]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ValueError(f"{path}: unknown NoiseConfig field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}.")
    values.update(overrides)
    return NoiseConfig(**values)
