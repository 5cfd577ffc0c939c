"""The privacy ledger: what a ``NoiseConfig`` guarantees per token and per sequence, with its assumptions.

Used by ``nemo noise ledger`` (as text: ``privacy/ledger_format.py``). Only ``gaussian_mechanism``, and
``metric_dp`` and ``laplace`` with ``clip_norm``, carry a formal (worst-case) guarantee (the families whose row has
an ``accounting``); the ledger of any other configuration says why there is none instead of printing a number. A
metric_dp or laplace config without ``clip_norm`` gets a ledger too (no worst-case epsilon), not an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from nemo_noise_plugin.noise.calibration import gaussian_mechanism_epsilon
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.families import noise_family
from nemo_noise_plugin.privacy import accounting as dp
from nemo_noise_plugin.validation import check_int, check_number


@dataclass(frozen=True)
class Guarantee:
    """One privacy statement: (epsilon, delta)-DP (``delta = 0`` is pure DP), or ``epsilon = None`` for no bound."""

    epsilon: float | None
    delta: float
    how: str
    """How the numbers were obtained (configured, a composition, a zCDP conversion) or why there are none."""


@dataclass(frozen=True)
class PrivacyLedger:
    """What one noise configuration guarantees for a token and for a whole sequence trained on for some epochs.

    Neighbouring inputs differ in one token (per token) or in every token of one sequence (per sequence); each
    sequence is seen ``epochs`` times, each time with fresh noise, so the sequence makes
    ``sequence_length * epochs`` token releases. ``per_token`` and ``per_sequence`` are empty when the
    configuration has no formal guarantee; ``assumptions`` then says why.
    """

    mechanism: str
    enabled: bool
    sequence_length: int
    epochs: int
    assumptions: tuple[str, ...]
    """The scope of the statements and what they assume, as sentences."""
    per_token: tuple[Guarantee, ...] = ()
    per_sequence: tuple[Guarantee, ...] = ()
    clip_norm: float | None = None
    sensitivity: float | None = None
    """L2 sensitivity of one token's embedding under replacement, ``2 * clip_norm``."""
    calibration: str | None = None
    """gaussian_mechanism: ``analytic`` or ``classical``."""
    sigma: float | None = None
    """gaussian_mechanism: the calibrated noise standard deviation ``sigma_dp``."""
    eta: float | None = None
    """metric_dp: the d_chi privacy parameter (epsilon per unit L2 distance)."""
    laplace_scale: float | None = None
    """laplace: the per-coordinate scale ``b`` (epsilon per unit L1 distance ``1/b``)."""
    token_rho: float | None = None
    """gaussian_mechanism: zCDP of one token release, ``(2C)^2 / (2 sigma^2)``."""
    sequence_rho: float | None = None
    """gaussian_mechanism: zCDP of the sequence, ``L * E * token_rho``."""
    hidden_size: int | None = None
    expected_noise_norm: float | None = None
    """``E|z|`` of one token's noise given ``hidden_size``: ``d / eta``, ``sigma sqrt(2) G((d+1)/2) / G(d/2)``, or for
    Laplace noise its RMS norm ``b sqrt(2 d)`` (``E|z|`` is within ``5 / (8 d)`` below it)."""

    @property
    def releases(self) -> int:
        """Token releases per sequence: ``sequence_length * epochs``."""
        return self.sequence_length * self.epochs

    @property
    def has_formal_guarantee(self) -> bool:
        """True when some per-sequence statement has a finite epsilon."""
        return any(guarantee.epsilon is not None for guarantee in self.per_sequence)


SCOPE = (
    "Scope: the guarantee covers the noised embeddings handed to the rest of the network (the released "
    "representation), not the trained weights: the training loss still sees the clean labels, so the weights, the "
    "checkpoints and anything computed from them are not covered."
)
EMBEDDING_MAP = (
    "Each release clips the embedding to {norm}norm C before adding noise, so any two tokens' clipped embeddings are "
    "at {distance} <= {bound} whatever the (trained, data-dependent) embedding table; composition over epochs treats "
    "each epoch's embedding map as given."
)
"""Formatted with the norm, the distance and its bound of one ledger: ``L2 distance <= 2C`` for the L2 ledgers."""
RANDOMNESS = (
    "The noise is Philox pseudo-randomness keyed by NoiseConfig.seed: the guarantee assumes the seed stays secret "
    "(whoever knows it can regenerate and subtract the noise), and the analysis assumes exact real-valued noise, "
    "not its floating-point sampling (Mironov 2012)."
)
UNCLIPPED = (
    "No formal privacy guarantee: mechanism={mechanism!r} does not clip the embeddings, so the L2 sensitivity of a "
    "token's embedding is unbounded and no (epsilon, delta) follows; use gaussian_mechanism, or metric_dp or laplace "
    "with clip_norm, for a guarantee."
)
DISABLED = "No formal privacy guarantee: the noise is disabled (enabled=false); embeddings are released in the clear."


def privacy_ledger(
    config: NoiseConfig,
    *,
    sequence_length: int,
    epochs: int = 1,
    delta: float | None = None,
    hidden_size: int | None = None,
) -> PrivacyLedger:
    """The privacy ledger of ``config`` for sequences of ``sequence_length`` tokens trained on for ``epochs`` epochs.

    ``delta`` is the per-sequence delta of the Gaussian mechanism's conversions (default: ``config.delta``);
    ``hidden_size`` adds the expected noise norm of a privacy mechanism, and is required by a clipped ``laplace``
    config, whose epsilon depends on it. ``config`` is trusted as its construction (or its run's gate) checked it.

    Args:
        config: the noise settings of the run.
        sequence_length: tokens per sequence (the per-sequence guarantee composes over them).
        epochs: passes over each sequence.
        delta: per-sequence delta for the conversions; None: ``config.delta``.
        hidden_size: the model's hidden size ``d``.

    Returns:
        The ledger: per-token and per-sequence guarantees, or why the config gives none.

    Example::

        ledger = privacy_ledger(load_noise_config("dp_gaussian_mechanism"), sequence_length=512, hidden_size=576)
        print(format_ledger(ledger))  # privacy.ledger_format
    """
    _check_count("sequence_length", sequence_length)
    _check_count("epochs", epochs)
    if hidden_size is not None:
        _check_count("hidden_size", hidden_size)
    if delta is not None:
        check_number("privacy_ledger: delta", delta, minimum=0.0, maximum=1.0, inclusive=False, optional=True)
    base = PrivacyLedger(
        mechanism=config.mechanism,
        enabled=config.enabled,
        sequence_length=sequence_length,
        epochs=epochs,
        assumptions=(),
        clip_norm=None if config.clip_norm is None else float(config.clip_norm),
        sensitivity=config.sensitivity,
        hidden_size=hidden_size,
    )
    if not config.enabled:
        return replace(base, assumptions=(DISABLED,))
    accounting = noise_family(config.mechanism).accounting
    if accounting is None:
        return replace(base, assumptions=(UNCLIPPED.format(mechanism=config.mechanism),))
    if accounting not in LEDGERS:
        raise ValueError(
            f"{config.mechanism}: accounting={accounting!r} has no ledger: expected one of {', '.join(LEDGERS)}."
        )
    return LEDGERS[accounting](config, base, float(config.delta) if delta is None else float(delta))


def _gaussian_mechanism_ledger(config: NoiseConfig, base: PrivacyLedger, sequence_delta: float) -> PrivacyLedger:
    sensitivity = float(config.sensitivity)
    sigma = config.dp_sigma
    token_rho = dp.gaussian_zcdp_rho(sigma, sensitivity)
    sequence_rho = dp.compose_zcdp([token_rho]) * base.releases  # L * E equal releases: their sum, without a list
    # L * E Gaussian releases of sensitivity 2C each are one Gaussian release of sensitivity 2C * sqrt(L * E).
    try:
        exact = gaussian_mechanism_epsilon(sigma, sequence_delta, sensitivity * math.sqrt(base.releases))
    except ArithmeticError:  # the calibration finds no epsilon below 1e300
        raise ValueError(
            f"privacy_ledger: NoiseConfig.epsilon={config.epsilon!r} is invalid for sequences of "
            f"{base.sequence_length} tokens over {base.epochs} epoch(s): their composed epsilon exceeds double "
            "precision (1e300); expected a smaller epsilon (or fewer tokens and epochs)."
        ) from None
    noise_norm = None
    if base.hidden_size is not None:
        d = base.hidden_size
        noise_norm = sigma * math.sqrt(2.0) * math.exp(math.lgamma((d + 1) / 2) - math.lgamma(d / 2))
    configured = f"as configured ({config.calibration} calibration)"
    return replace(
        base,
        calibration=config.calibration,
        sigma=sigma,
        token_rho=token_rho,
        sequence_rho=sequence_rho,
        per_token=(Guarantee(float(config.epsilon), float(config.delta), configured),),
        per_sequence=(
            Guarantee(exact, sequence_delta, "exact: one Gaussian mechanism of sensitivity 2C sqrt(L E)"),
            Guarantee(
                dp.zcdp_to_dp_epsilon(sequence_rho, sequence_delta, "optimal"),
                sequence_delta,
                "zCDP -> DP, Canonne, Kamath & Steinke 2020",
            ),
            Guarantee(
                dp.zcdp_to_dp_epsilon(sequence_rho, sequence_delta, "bun_steinke"),
                sequence_delta,
                "zCDP -> DP, Bun & Steinke 2016",
            ),
        ),
        expected_noise_norm=noise_norm,
        assumptions=(SCOPE, _map(), RANDOMNESS, *_coverage(config)),
    )


def _metric_dp_ledger(config: NoiseConfig, base: PrivacyLedger, sequence_delta: float) -> PrivacyLedger:
    eta = float(config.eta)
    noise_norm = None if base.hidden_size is None else base.hidden_size / eta
    d_chi = (
        "d_chi privacy: for any two embeddings x, x' the output densities differ by at most a factor "
        f"exp(eta |x-x'|), eta = {eta:g} per unit L2 distance."
    )
    base = replace(base, eta=eta, expected_noise_norm=noise_norm)
    if config.clip_norm is None:
        return _unbounded(config, base, "eta |x-x'|", "|x-x'|", "distance", d_chi)
    token_epsilon = dp.metric_dp_epsilon(eta, float(config.clip_norm))
    sequence_epsilon = dp.compose_pure_dp([token_epsilon]) * base.releases  # L * E equal releases: their sum
    return replace(
        base,
        per_token=(Guarantee(token_epsilon, 0.0, "pure DP: eta * 2C"),),
        per_sequence=(Guarantee(sequence_epsilon, 0.0, "pure DP composition: L E eta 2C"),),
        assumptions=(SCOPE, d_chi, _map(), RANDOMNESS, *_coverage(config)),
    )


def _laplace_ledger(config: NoiseConfig, base: PrivacyLedger, sequence_delta: float) -> PrivacyLedger:
    scale = float(config.laplace_scale)
    noise_norm = None if base.hidden_size is None else scale * math.sqrt(2.0 * base.hidden_size)
    base = replace(base, laplace_scale=scale, expected_noise_norm=noise_norm)
    l1 = (
        "Laplace mechanism: per-coordinate Laplace(0, b) noise makes the output densities of any two embeddings x, "
        f"x' differ by at most a factor exp(|x-x'|_1 / b), b = {scale:g}."
    )
    if config.clip_norm is None:
        return _unbounded(config, base, "|x-x'|_1 / b", "|x-x'|_1", "L1 distance", l1)
    if base.hidden_size is None:
        raise ValueError(
            f"privacy_ledger: hidden_size=None is invalid with mechanism='laplace' and clip_norm={config.clip_norm!r}: "
            "expected the hidden size d, e.g. hidden_size=4096 (the per-token epsilon 2C sqrt(d) / b depends on it)."
        )
    token_epsilon = dp.laplace_epsilon(scale, float(config.clip_norm), base.hidden_size)
    sequence_epsilon = dp.compose_pure_dp([token_epsilon]) * base.releases  # L * E equal releases: their sum
    return replace(
        base,
        per_token=(Guarantee(token_epsilon, 0.0, "pure DP: 2C sqrt(d) / b"),),
        per_sequence=(Guarantee(sequence_epsilon, 0.0, "pure DP composition: L E 2C sqrt(d) / b"),),
        assumptions=(SCOPE, l1, _map("L2 ", "L1 distance", "2C sqrt(d)"), RANDOMNESS, *_coverage(config)),
    )


def _map(norm: str = "", distance: str = "L2 distance", bound: str = "2C") -> str:
    return EMBEDDING_MAP.format(norm=norm, distance=distance, bound=bound)


def _unbounded(
    config: NoiseConfig, base: PrivacyLedger, epsilon: str, term: str, distance: str, statement: str
) -> PrivacyLedger:
    """The ledger of a pure-DP mechanism run without ``clip_norm``: ``epsilon`` grows with ``term``, the ``distance``
    between two embeddings, which has no bound."""
    unbounded = Guarantee(None, 0.0, f"epsilon = {epsilon}, and {term} has no bound without clip_norm")
    no_bound = (
        f"No worst-case epsilon: {config.mechanism} without clip_norm leaves the {distance} between two tokens' "
        "embeddings unbounded; set clip_norm for a pure epsilon-DP guarantee."
    )
    return replace(
        base,
        per_token=(unbounded,),
        per_sequence=(unbounded,),
        assumptions=(no_bound, statement, SCOPE, RANDOMNESS, *_coverage(config)),
    )


Ledger = Callable[[NoiseConfig, PrivacyLedger, float], PrivacyLedger]
"""``(config, base, sequence_delta) -> ledger``: one accounting's ledger, from the config, the part every ledger
shares (``base``: mechanism, lengths, clip) and the per-sequence delta of the conversions."""
LEDGERS: dict[str, Ledger] = {
    "gaussian_mechanism": _gaussian_mechanism_ledger,
    "metric_dp": _metric_dp_ledger,
    "laplace": _laplace_ledger,
}
"""The ledger of each accounting by name (``NoiseFamily.accounting`` names a row); a family with a new accounting
adds its row here."""


def _coverage(config: NoiseConfig) -> tuple[str, ...]:
    """Which tokens the noise actually covers; a token released without noise has no protection."""
    lines = []
    if config.tokens != "all":
        part = "private-span" if config.tokens == "spans" else config.tokens
        lines.append(
            f"Only the {part} tokens are noised (tokens={config.tokens!r}): the guarantee covers changes to "
            "those tokens; the other tokens' embeddings are released in the clear."
        )
    if config.special_token_ids:
        lines.append(
            f"special_token_ids {config.special_token_ids} are never noised: their embeddings are released in the "
            "clear (they carry no private content only if they are fixed template tokens)."
        )
    lines.append("Padding tokens are never noised; L counts the noised tokens of one sequence.")
    if config.projection != "none":
        target = "its nearest table row" if config.projection == "nearest_row" else "the posterior mean of the rows"
        if config.projection_prior is not None:
            target += f" under the token prior {config.projection_prior} (public side information, not the input)"
        lines.append(
            f"projection={config.projection!r} replaces each noised embedding by {target}: "
            "post-processing of the release, so the guarantee is unchanged."
        )
    if config.training_only:
        lines.append(
            "Noise is added in training mode only (training_only=true): embeddings computed in evaluation or "
            "inference are clean and not covered."
        )
    else:
        lines.append("training_only=false: evaluation passes are further noised releases that E does not count.")
    return tuple(lines)


MAX_COUNT = 2**53
"""The largest ``sequence_length``, ``epochs`` and ``hidden_size``: the accounting computes in double precision,
which holds every integer up to 2**53 exactly."""


def _check_count(name: str, value: object) -> None:
    check_int(
        f"privacy_ledger: {name}",
        value,
        minimum=1,
        maximum=MAX_COUNT,
        why=" (2**53, the integers double precision holds exactly)",
    )
