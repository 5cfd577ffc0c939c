"""The noise families: one row per mechanism, pointing to the building blocks every other module looks up.

``NoiseConfig.mechanism`` names a row of ``NOISE_FAMILIES``. The row says which field sets the noise level and
whether larger is quieter, how the noise is sized (per-token scale, length scaling, clipping), and names its building
blocks, each a row of its own table: the unit sampler that draws it (``noise.sampling.UNIT_SAMPLERS``, which also
says whether the fused kernel draws it), the density the privacy audit's attacker scores with
(``noise.densities.NOISE_DENSITIES``) and the ledger that accounts for it (``privacy.ledger.LEDGERS``), plus the
sweep fields and main-job flag that set it. The config's checks, the noise layer, the beam attack, the audit sweep,
the ledger, the robustness report and the main job read the row instead of comparing mechanism names with strings;
metric DP is ``metric_dp`` in every table.

Adding a family is one ``NoiseFamily`` row (``register_noise_family``; new building blocks are rows of their
tables), its field in ``NoiseConfig`` (and the ``NoiseMechanism`` literal, which typing cannot derive) unless it
reuses one, a preset named by the row, its docs and its tests; the tests that take every family read this registry
(``tests/noise/test_toy_family.py`` runs a toy family through the layer, the ledger and the audit). Imported by
``noise/config.py``, so it imports neither the config nor torch at import time: the hooks take the ``NoiseConfig``
as ``config`` and work on the tensors they are given.
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
    "NoiseFamily",
    "TokenNoise",
    "embedding_distance_factor",
    "gaussian_mechanism_sigma",
    "length_factor",
    "noise_family",
    "register_noise_family",
]

Clipping = Literal["never", "optional", "required"]


@dataclass(frozen=True)
class TokenNoise:
    """Each token's noise as a density: ``y = clip(x) + z``, ``z`` of the given density and per-token scale.

    ``density`` names a row of ``noise.densities.NOISE_DENSITIES``; ``scale`` is its scale for each token (the
    standard deviation of ``gaussian``, ``b`` of ``laplace``, ``1/eta`` of ``metric_dp``), times the token's
    embedding RMS when ``relative``; ``x`` is clipped to norm
    ``clip_norm`` first when it is set.
    """

    density: str
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
    unit: str
    """The unit noise that ``token_scale`` multiplies: a row of ``noise.sampling.UNIT_SAMPLERS``."""
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
    attacker_density: str = "gaussian"
    """The density the beam attack and posterior-mean denoising assume: a row of ``noise.densities.NOISE_DENSITIES``
    (``gaussian`` for uniform noise: a smooth stand-in with its variance)."""
    accounting: str | None = None
    """The privacy ledger that accounts for it, a row of ``privacy.ledger.LEDGERS``; None: no formal guarantee."""
    sweep_fields: tuple[str, ...] = ()
    """The ``NoiseConfig`` fields a privacy-audit sweep may vary."""
    cli_flag: str | None = None
    """The main job's flag for ``magnitude_field`` (``--alpha``), or None (set it with ``--noise-config``)."""
    cli_help: str = ""
    cli_default: float | None = None
    """The main job's ``magnitude_field`` when neither a flag nor ``--noise-config`` sets it (None: the config's)."""
    preset: str = ""
    """A shipped noise preset of this family (the example the tests and docs use)."""
    magnitude: Callable[[Any], float] | None = None
    """``config -> `` the base magnitude (``NoiseConfig.magnitude``; 0 means no noise); None: the value of
    ``magnitude_field``."""
    check: Callable[[Any], None] | None = None
    """Extra validation of a config of this family (``NoiseConfig.__post_init__``), raising ``ValueError``."""

    def level(self, config: Any) -> float:
        """``config``'s base magnitude: ``magnitude(config)``, or the value of ``magnitude_field``."""
        return self.magnitude(config) if self.magnitude else float(getattr(config, self.magnitude_field))

    def base_scale(self, config: Any) -> float:
        """The unit's scale before the length factor and the schedule (``distance_multiple`` under
        ``embedding_distance`` scaling)."""
        if self.length_scaled and config.scaling == "embedding_distance":
            return float(config.distance_multiple)
        return self.scale(config) if self.scale else self.level(config)

    def clips(self, config: Any) -> bool:
        """True when ``config``'s embeddings are clipped to ``clip_norm`` before the noise is added."""
        return self.clip != "never" and config.clip_norm is not None

    def token_scale(
        self,
        config: Any,
        lengths: torch.Tensor,
        global_length: int,
        hidden_size: int,
        factor: float | torch.Tensor = 1.0,
    ) -> torch.Tensor:
        """Each token's scale of the unit noise (shape of ``lengths``, float32): ``(base * c) * f``.

        ``lengths`` holds each token's true sequence length, ``global_length`` the padded one, ``factor`` the
        schedule factor ``f``; ``c`` is the length factor of length-scaled families and 1 for the others. Without
        the embedding RMS of relative noise and without the token selection. ``f`` multiplies last, in float32, so a
        host factor and the replayable path's 0-dim device factor (``noise/replayable.py``) give the same bits.
        """
        if not self.length_scaled:
            return lengths.new_full(lengths.shape, self.base_scale(config)) * factor
        from nemo_noise_plugin.noise.sampling import unit_sampler

        unit_std = unit_sampler(self.unit).std
        return self.base_scale(config) * length_factor(config, lengths, global_length, hidden_size, unit_std) * factor

    def density_factor(self) -> float:
        """The attacker density's scale per unit of ``token_scale``: the unit's standard deviation over the density's
        (1 for a density of the unit's own name, e.g. ``metric_dp``); a ``ValueError`` when they do not fit."""
        from nemo_noise_plugin.noise.densities import noise_density
        from nemo_noise_plugin.noise.sampling import unit_sampler

        density, unit = noise_density(self.attacker_density), unit_sampler(self.unit)
        if density.unit_std is None:
            if density.name != unit.name:
                raise ValueError(f"{self.name}: the {density.name} density fits the {density.name} unit only.")
            return 1.0
        if unit.std is None:
            raise ValueError(f"{self.name}: the {unit.name} unit has no per-coordinate spread for {density.name}.")
        return unit.std / density.unit_std

    def attacker_noise(
        self, config: Any, lengths: torch.Tensor, global_length: int, hidden_size: int, factor: float = 1.0
    ) -> TokenNoise:
        """The per-token noise density the privacy audit's attacker assumes: this family's own ``token_scale``
        (arguments as there) in the parameter of ``attacker_density``, so it is the drawn noise's spread."""
        scale = self.token_scale(config, lengths, global_length, hidden_size, factor) * self.density_factor()
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


def gaussian_mechanism_sigma(config: Any) -> float:
    """The Gaussian mechanism's sigma calibrated to ``config``'s (epsilon, delta) at sensitivity ``2C``."""
    from nemo_noise_plugin.noise.calibration import analytic_gaussian_sigma, classical_gaussian_sigma

    calibrate = analytic_gaussian_sigma if config.calibration == "analytic" else classical_gaussian_sigma
    return calibrate(float(config.epsilon), float(config.delta), float(config.sensitivity))


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


def _length_scaled(name: str, field: str, preset: str, cli_help: str, cli_default: float | None = None) -> NoiseFamily:
    """A NEFTune-style family: unit noise of its own name sized by ``scaling``, its level a main-job flag."""
    return NoiseFamily(
        name=name,
        magnitude_field=field,
        unit=name,
        length_scaled=True,
        sweep_fields=(field, "distance_multiple"),
        cli_flag=field,
        cli_help=cli_help,
        cli_default=cli_default,
        preset=preset,
    )


NOISE_FAMILIES: dict[str, NoiseFamily] = {
    family.name: family
    for family in (
        _length_scaled("uniform", "alpha", "neftune_alpha5", "NEFTune alpha of uniform noise (default 10)", 10.0),
        _length_scaled("gaussian", "sigma", "gaussian", "gaussian noise multiplier"),
        NoiseFamily(
            name="metric_dp",
            magnitude_field="eta",
            magnitude=lambda config: 1.0 / float(config.eta),
            unit="metric_dp",
            larger_is_quieter=True,
            privacy_mechanism=True,
            clip="optional",
            attacker_density="metric_dp",
            accounting="metric_dp",
            sweep_fields=("eta",),
            preset="metric_dp",
        ),
        NoiseFamily(
            name="gaussian_mechanism",
            magnitude_field="epsilon",
            magnitude=gaussian_mechanism_sigma,
            unit="gaussian",
            larger_is_quieter=True,
            privacy_mechanism=True,
            clip="required",
            accounting="gaussian_mechanism",
            sweep_fields=("epsilon",),
            preset="dp_gaussian_mechanism",
            check=_check_gaussian_mechanism,
        ),
        NoiseFamily(
            name="quantization",
            magnitude_field="quantization_step",
            scale=lambda config: float(config.quantization_step) / 2,
            unit="uniform",
            sweep_fields=("quantization_step",),
            preset="quantization",
        ),
        NoiseFamily(
            name="relative",
            magnitude_field="relative_scale",
            unit="gaussian",
            relative_to_embedding=True,
            sweep_fields=("relative_scale",),
            preset="relative",
        ),
        NoiseFamily(
            name="laplace",
            magnitude_field="laplace_scale",
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


def register_noise_family(family: NoiseFamily) -> NoiseFamily:
    """Add ``family`` to ``NOISE_FAMILIES`` after checking that its unit sampler and attacker density are rows of
    their tables and fit each other (``NoiseFamily.density_factor``); a ``ValueError`` naming what is missing.

    Its ``magnitude_field`` and ``sweep_fields`` must be ``NoiseConfig`` fields; its ``accounting``, when set, a row
    of ``privacy.ledger.LEDGERS`` by the time a ledger is asked for. Returns ``family``.
    """
    if family.name in NOISE_FAMILIES:
        raise ValueError(f"noise family {family.name!r} is already registered.")
    family.density_factor()  # both rows exist and fit
    NOISE_FAMILIES[family.name] = family
    return family
