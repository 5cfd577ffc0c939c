"""The noise families: one row per mechanism, holding what every other module needs to know about it.

``NoiseConfig.mechanism`` names a row of ``NOISE_FAMILIES``. The row says which field sets the noise level and
whether larger is quieter, how the noise is drawn (the unit distribution and its per-token scale, length scaling,
clipping, the fused kernel), how the privacy audit's attacker models it, which ledger accounts for it, and which
sweep fields and main-job flag set it. The config's checks, the noise layer, the beam attack, the audit sweep, the
ledger, the robustness report and the main job read the row instead of comparing mechanism names with strings.

Adding a family is one ``NoiseFamily`` entry below, its field in ``NoiseConfig`` (and the ``NoiseMechanism``
literal, which typing cannot derive), a preset named by the row, its docs and its tests; the tests that take every
family read this registry. Imported by ``noise/config.py``, so it imports neither the config nor torch: the hooks
take the ``NoiseConfig`` as ``config`` and work on the tensors they are given.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from nemo_noise_plugin.validation import FLOAT32_MAX, SettingError

if TYPE_CHECKING:
    import torch

__all__ = [
    "NOISE_FAMILIES",
    "UNIT_STD",
    "NoiseFamily",
    "TokenNoise",
    "embedding_distance_factor",
    "length_factor",
    "noise_family",
]

UnitDistribution = Literal["uniform", "gaussian", "laplace", "d_chi"]
"""``uniform`` U(-1, 1), ``gaussian`` N(0, 1), ``laplace`` Laplace(0, 1), each i.i.d. per coordinate; ``d_chi`` the
metric-DP unit ``r * g / |g|`` with ``g ~ N(0, I_d)`` and radius ``r ~ Gamma(d, 1)`` (density ``~ exp(-|z|)``)."""
AttackerDensity = Literal["gaussian", "laplace", "d_chi"]
"""The noise density the privacy audit's beam attack scores with: ``gaussian`` ``-|z|^2 / (2 s^2)``, ``laplace``
``-|z|_1 / b``, ``d_chi`` ``-|z| / s`` (``s = 1/eta``)."""
Accounting = Literal["gaussian", "d_chi", "laplace"]
"""The privacy ledger's accounting of a family (``privacy/ledger.py``): the Gaussian mechanism (zCDP and the exact
curve), d_chi privacy (pure DP at ``eta * 2C``), the Laplace mechanism (pure DP at ``2C sqrt(d) / b``)."""
Clipping = Literal["never", "optional", "required"]

UNIT_STD: dict[str, float] = {"uniform": 1.0 / math.sqrt(3.0), "gaussian": 1.0, "laplace": math.sqrt(2.0)}
"""Per-coordinate standard deviation of each per-coordinate unit distribution."""


@dataclass(frozen=True)
class TokenNoise:
    """Each token's noise as a density: ``y = clip(x) + z``, ``z`` of the given density and per-token scale.

    ``scale`` is the standard deviation (``gaussian``), ``b`` (``laplace``) or the radial scale ``1/eta``
    (``d_chi``) of each token, times the token's embedding RMS when ``relative``; ``x`` is clipped to norm
    ``clip_norm`` first when it is set.
    """

    density: AttackerDensity
    scale: torch.Tensor
    relative: bool = False
    clip_norm: float | None = None


@dataclass(frozen=True)
class NoiseFamily:
    """One noise mechanism: its settings, how its noise is drawn and sized, and how the plugin treats it.

    The noise on a selected token ``x`` is ``z = token_scale * unit`` (times ``rms(x)`` when
    ``relative_to_embedding``), added to ``x`` or to ``x`` clipped to ``clip_norm`` (``clips``); the hooks take the
    ``NoiseConfig`` as ``config``.
    """

    name: str
    magnitude_field: str
    """The ``NoiseConfig`` field that sets the noise level (the robustness report's and the main job's axis)."""
    magnitude: Callable[[Any], float]
    """``config -> `` the base magnitude (``NoiseConfig.magnitude``; 0 means no noise)."""
    unit: UnitDistribution
    """The unit noise that ``token_scale`` multiplies."""
    scale: Callable[[Any], float] | None = None
    """``config -> `` the scale of ``unit`` before the length factor and the schedule (None: ``magnitude``); for
    ``gaussian_mechanism`` the calibration of sigma to (epsilon, delta)."""
    length_scaled: bool = False
    """``NoiseConfig.scaling`` applies (NEFTune's ``1/sqrt(L d)``, ``absolute``, ``embedding_distance``)."""
    relative_to_embedding: bool = False
    """The scale is multiplied by each token's embedding RMS."""
    larger_is_quieter: bool = False
    """A larger ``magnitude_field`` means less noise (``eta``, ``epsilon``): sweeps vary its reciprocal."""
    privacy_mechanism: bool = False
    """Calibrated once: needs ``schedule='constant'`` and ``warmup_steps=0``."""
    clip: Clipping = "never"
    """Whether embeddings are clipped to ``clip_norm`` before the noise is added."""
    kernel: bool = True
    """The fused Triton kernel draws it on CUDA (``noise/triton_kernel.py``); False: the torch path everywhere."""
    attacker_density: AttackerDensity = "gaussian"
    """The density the beam attack assumes (``gaussian`` for uniform noise: a smooth stand-in with its variance)."""
    accounting: Accounting | None = None
    """Which privacy ledger accounts for it; None: no formal guarantee."""
    sweep_fields: tuple[str, ...] = ()
    """The ``NoiseConfig`` fields a privacy-audit sweep may vary."""
    cli_flag: str | None = None
    """The main job's flag for ``magnitude_field`` (``--alpha``), or None (set it with ``--noise-config``)."""
    cli_help: str = ""
    preset: str = ""
    """A shipped noise preset of this family (the example the tests and docs use)."""
    check: Callable[[Any], None] | None = None
    """Extra validation of a config of this family (``NoiseConfig.__post_init__``), raising ``ValueError``."""

    def base_scale(self, config: Any) -> float:
        """The unit's scale before the length factor and the schedule (``distance_multiple`` under
        ``embedding_distance`` scaling)."""
        if self.length_scaled and config.scaling == "embedding_distance":
            return float(config.distance_multiple)
        return (self.scale or self.magnitude)(config)

    def clips(self, config: Any) -> bool:
        """True when ``config``'s embeddings are clipped to ``clip_norm`` before the noise is added."""
        return self.clip != "never" and config.clip_norm is not None

    def token_scale(
        self, config: Any, lengths: torch.Tensor, global_length: int, hidden_size: int, factor: float = 1.0
    ) -> torch.Tensor:
        """Each token's scale of the unit noise (shape of ``lengths``, float32): ``f * base * c``.

        ``lengths`` holds each token's true sequence length, ``global_length`` the padded one, ``factor`` the
        schedule factor ``f``; ``c`` is the length factor of length-scaled families and 1 for the others. Without
        the embedding RMS of relative noise and without the token selection.
        """
        if not self.length_scaled:
            return lengths.new_full(lengths.shape, factor * self.base_scale(config))
        unit_std = UNIT_STD[self.unit]
        return factor * self.base_scale(config) * length_factor(config, lengths, global_length, hidden_size, unit_std)

    def attacker_noise(
        self, config: Any, lengths: torch.Tensor, global_length: int, hidden_size: int, factor: float = 1.0
    ) -> TokenNoise:
        """The per-token noise density the privacy audit's attacker assumes: this family's own ``token_scale``
        (arguments as there) in the parameter of ``attacker_density``, so it is the drawn noise's spread."""
        scale = self.token_scale(config, lengths, global_length, hidden_size, factor)
        if self.attacker_density == "gaussian":
            scale = scale * UNIT_STD[self.unit]
        elif self.attacker_density == "laplace":
            scale = scale * (UNIT_STD[self.unit] / UNIT_STD["laplace"])
        elif self.unit != "d_chi":
            raise ValueError(f"{self.name}: attacker density d_chi needs the d_chi unit, not {self.unit!r}.")
        clip_norm = float(config.clip_norm) if self.clips(config) else None
        return TokenNoise(self.attacker_density, scale, self.relative_to_embedding, clip_norm)


def embedding_distance_factor(config: Any, hidden_size: int, unit_std: float) -> float:
    """``embedding_distance`` scaling: ``c = D / (sqrt(d) * unit_std)`` with ``D`` the median nearest-neighbour
    distance, so that ``distance_multiple * c * unit`` has RMS norm ``distance_multiple * D``."""
    if config.embedding_distance is None:
        raise ValueError(
            "NoiseConfig.embedding_distance=None is invalid with scaling='embedding_distance': expected the "
            "vocabulary's median nearest-neighbour distance > 0; measure it once from the model's embedding table "
            "with nemo_noise_plugin.privacy.embedding_distance.calibrate_noise_to_embeddings(config, table)."
        )
    return float(config.embedding_distance) / (math.sqrt(hidden_size) * unit_std)


def length_factor(
    config: Any, lengths: torch.Tensor, global_length: int, hidden_size: int, unit_std: float
) -> torch.Tensor:
    """The length factor ``c`` per token (shape of ``lengths``): NEFTune's ``1/sqrt(L d)`` with the true
    (``true_length``) or padded (``padded_length``) ``L``, 1 (``absolute``), or the ``embedding_distance`` factor."""
    if config.scaling == "embedding_distance":
        return lengths.new_full(lengths.shape, embedding_distance_factor(config, hidden_size, unit_std))
    if config.scaling == "absolute":
        return lengths.new_ones(lengths.shape)
    if config.scaling == "padded_length":
        return lengths.new_full(lengths.shape, 1.0 / math.sqrt(global_length * hidden_size))
    return (lengths.clamp_min(1.0) * hidden_size).rsqrt()


def _check_gaussian_mechanism(config: Any) -> None:
    if config.epsilon is None:
        raise SettingError(
            "NoiseConfig.epsilon",
            None,
            "the per-token privacy budget epsilon > 0 that calibrates sigma",
            context=" with mechanism='gaussian_mechanism'",
        )
    if config.calibration == "classical" and config.epsilon >= 1.0:
        raise SettingError(
            "NoiseConfig.epsilon",
            config.epsilon,
            "epsilon < 1, or calibration='analytic' for larger epsilon",
            context=" with calibration='classical'",
            why=": the classical Gaussian mechanism holds only for epsilon < 1 (Dwork & Roth, Theorem A.1)",
        )
    try:  # calibrated once here, so a budget no finite sigma meets is refused before any model is built
        sigma = config.dp_sigma
    except ArithmeticError:  # the calibration's own failure, an overflow or a division by zero
        sigma = math.nan
    if not (math.isfinite(sigma) and 0 < sigma <= FLOAT32_MAX):
        raise SettingError(
            "NoiseConfig.epsilon",
            config.epsilon,
            "epsilon and clip_norm between 1e-10 and 1e10",
            context=f" with mechanism='gaussian_mechanism', clip_norm={config.clip_norm!r} and delta={config.delta!r}",
            why=f": no noise level sigma > 0 calibrates to it that is finite in float32 (<= {FLOAT32_MAX:g}; "
            f"sigma scales with clip_norm / epsilon; calibrated: {sigma!r})",
        )


NOISE_FAMILIES: dict[str, NoiseFamily] = {
    family.name: family
    for family in (
        NoiseFamily(
            name="uniform",
            magnitude_field="alpha",
            magnitude=lambda config: float(config.alpha),
            unit="uniform",
            length_scaled=True,
            sweep_fields=("alpha", "distance_multiple"),
            cli_flag="alpha",
            cli_help="NEFTune alpha of uniform noise (default 10)",
            preset="neftune_alpha5",
        ),
        NoiseFamily(
            name="gaussian",
            magnitude_field="sigma",
            magnitude=lambda config: float(config.sigma),
            unit="gaussian",
            length_scaled=True,
            sweep_fields=("sigma", "distance_multiple"),
            cli_flag="sigma",
            cli_help="gaussian noise multiplier",
            preset="gaussian",
        ),
        NoiseFamily(
            name="metric_dp",
            magnitude_field="eta",
            magnitude=lambda config: 1.0 / float(config.eta),
            unit="d_chi",
            larger_is_quieter=True,
            privacy_mechanism=True,
            clip="optional",
            kernel=False,  # a per-token normalisation and a Gamma radius: a reduction over the hidden dimension
            attacker_density="d_chi",
            accounting="d_chi",
            sweep_fields=("eta",),
            preset="metric_dp",
        ),
        NoiseFamily(
            name="gaussian_mechanism",
            magnitude_field="epsilon",
            magnitude=lambda config: config.dp_sigma,
            unit="gaussian",
            larger_is_quieter=True,
            privacy_mechanism=True,
            clip="required",
            accounting="gaussian",
            sweep_fields=("epsilon",),
            preset="dp_gaussian_mechanism",
            check=_check_gaussian_mechanism,
        ),
        NoiseFamily(
            name="quantization",
            magnitude_field="quantization_step",
            magnitude=lambda config: float(config.quantization_step),
            scale=lambda config: float(config.quantization_step) / 2,
            unit="uniform",
            sweep_fields=("quantization_step",),
            preset="quantization",
        ),
        NoiseFamily(
            name="relative",
            magnitude_field="relative_scale",
            magnitude=lambda config: float(config.relative_scale),
            unit="gaussian",
            relative_to_embedding=True,
            sweep_fields=("relative_scale",),
            preset="relative",
        ),
        NoiseFamily(
            name="laplace",
            magnitude_field="laplace_scale",
            magnitude=lambda config: float(config.laplace_scale),
            unit="laplace",
            privacy_mechanism=True,
            clip="optional",
            attacker_density="laplace",
            accounting="laplace",
            sweep_fields=("laplace_scale",),
            cli_flag="laplace_scale",
            cli_help="per-coordinate scale b of laplace noise",
            preset="laplace",
        ),
    )
}
"""Every noise family by name, in the order of ``NoiseConfig``'s ``NoiseMechanism`` literal."""


def noise_family(mechanism: str) -> NoiseFamily:
    """The row of ``mechanism`` (a ``NoiseConfig.mechanism``); a ``ValueError`` listing the families otherwise."""
    try:
        return NOISE_FAMILIES[mechanism]
    except (KeyError, TypeError):
        raise ValueError(f"mechanism={mechanism!r} is invalid: expected one of {', '.join(NOISE_FAMILIES)}.") from None
