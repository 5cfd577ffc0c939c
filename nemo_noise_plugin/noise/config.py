"""The noise configuration: which noise is added to the decoder input, how large, to which tokens, and when."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from nemo_noise_plugin.noise.families import NOISE_FAMILIES, gaussian_mechanism_sigma, noise_family
from nemo_noise_plugin.noise.token_prior import read_token_prior
from nemo_noise_plugin.presets import load_config_yaml_fields, preset_path
from nemo_noise_plugin.validation import (
    SettingError,
    check_bool,
    check_choice,
    check_float32,
    check_int,
    check_number,
)

NoiseMechanism = Literal[
    "uniform", "gaussian", "metric_dp", "gaussian_mechanism", "quantization", "relative", "laplace"
]
"""The rows of ``noise.families.NOISE_FAMILIES``, spelled out for type checkers (a test keeps the two equal)."""
NoiseScaling = Literal["true_length", "padded_length", "absolute", "embedding_distance"]
TokenSelection = Literal["all", "prompt", "response", "spans"]
ScheduleKind = Literal["constant", "linear", "cosine"]
Calibration = Literal["analytic", "classical"]
Projection = Literal["none", "nearest_row", "posterior_mean"]
ProjectionMetric = Literal["l2", "cosine"]

# Views of the shipped families (noise/families.py), kept importable under their names; the checks read the
# registry itself, so a family registered later (``register_noise_family``) is checked like these.
MECHANISMS: tuple[str, ...] = tuple(NOISE_FAMILIES)
PRIVACY_MECHANISMS: tuple[str, ...] = tuple(name for name, f in NOISE_FAMILIES.items() if f.privacy_mechanism)
"""The mechanisms calibrated once (constant schedule, no warm-up)."""
LENGTH_SCALED_MECHANISMS: tuple[str, ...] = tuple(name for name, f in NOISE_FAMILIES.items() if f.length_scaled)
"""The mechanisms that ``scaling`` sizes."""
MAGNITUDE_FIELDS: dict[str, str] = {name: family.magnitude_field for name, family in NOISE_FAMILIES.items()}
"""The field that sets each mechanism's noise level (for metric_dp and gaussian_mechanism, larger is less noise)."""
_NON_NEGATIVE_MAGNITUDES = tuple(f.magnitude_field for f in NOISE_FAMILIES.values() if not f.larger_is_quieter)
SCALINGS: tuple[str, ...] = ("true_length", "padded_length", "absolute", "embedding_distance")
TOKEN_SELECTIONS: tuple[str, ...] = ("all", "prompt", "response", "spans")
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
CALIBRATIONS: tuple[str, ...] = ("analytic", "classical")
PROJECTIONS: tuple[str, ...] = ("none", "nearest_row", "posterior_mean")
PROJECTION_METRICS: tuple[str, ...] = ("l2", "cosine")
_FIELD = "NoiseConfig."


@dataclass
class NoiseConfig:
    """Embedding-noise settings, validated on construction.

    Noise ``z`` is added to each selected token's embedding ``x`` (``d`` = hidden size, ``f(t)`` = schedule factor):

    - ``uniform`` (NEFTune): ``z = f(t) * alpha * c * U(-1, 1)^d``;
    - ``gaussian``: ``z = f(t) * sigma * c * N(0, I_d)``;
      with ``c = 1 / sqrt(L * d)`` and ``L`` the sequence's true length (``true_length``, the NEFTune paper's code),
      the padded length (``padded_length``, HF transformers) or ``c = 1`` (``absolute``); with
      ``embedding_distance`` the per-token noise norm is sized from the embedding table instead (RMS norm
      ``f(t) * distance_multiple * embedding_distance``; alpha/sigma are not used);
    - ``metric_dp`` (d_chi privacy): ``z = r * g / |g|``, ``g ~ N(0, I_d)``, ``r ~ Gamma(shape=d, scale=1/eta)``,
      so ``E|z| = d / eta``; embeddings are first clipped to norm ``clip_norm`` when it is set;
    - ``gaussian_mechanism``: clip ``x`` to norm ``C = clip_norm``, add ``N(0, sigma_dp^2 I_d)`` with ``sigma_dp``
      calibrated to ``(epsilon, delta)`` at sensitivity ``2C`` (replace one token), ``analytic`` or ``classical``;
    - ``quantization`` (a quantisation proxy): ``z = f(t) * U(-D/2, D/2)^d``, ``D = quantization_step``;
    - ``relative``: ``z = f(t) * rho * rms(x) * N(0, I_d)``, ``rho = relative_scale``, so the noise RMS is
      ``rho`` times the token's embedding RMS;
    - ``laplace``: ``z = Laplace(0, b)^d``, i.i.d. per coordinate, ``b = laplace_scale`` (standard deviation
      ``b sqrt(2)``); embeddings are first clipped to norm ``clip_norm`` when it is set, which makes each token
      release ``2 C sqrt(d) / b``-DP (pure; the L1 distance of two clipped embeddings is at most ``2 C sqrt(d)``).

    What each mechanism is (its field, unit noise, scaling, clipping, kernel, attacker model, ledger) is its row of
    ``noise.families.NOISE_FAMILIES``.

    Padding tokens and ``special_token_ids`` are never noised; ``tokens`` selects all tokens, the prompt, the
    response (tokens whose prediction carries loss) or the marked private spans (``spans``: the batch's
    ``private_mask``, e.g. from ``data.private_spans``; everything else stays clean). The privacy mechanisms keep a
    constant schedule.
    """

    enabled: bool = True
    """Off switch: False leaves the model exactly as a plain GPT model."""
    mechanism: NoiseMechanism = "uniform"
    """One of uniform, gaussian, metric_dp, gaussian_mechanism, quantization, relative, laplace (class docstring)."""
    alpha: float = 5.0
    """NEFTune alpha, the magnitude of ``uniform`` noise (the paper uses 5, 10 or 15)."""
    sigma: float = 1.0
    """Standard-deviation multiplier of ``gaussian`` noise."""
    scaling: NoiseScaling = "true_length"
    """``true_length``, ``padded_length``, ``absolute`` or ``embedding_distance``; used by uniform and gaussian."""
    distance_multiple: float = 1.0
    """embedding_distance scaling: the per-token noise norm as a multiple of ``embedding_distance``."""
    embedding_distance: float | None = None
    """embedding_distance scaling: the vocabulary's median nearest-neighbour distance, measured once from the model's
    embedding table (``privacy.embedding_distance.calibrate_noise_to_embeddings``)."""
    eta: float = 100.0
    """metric_dp privacy parameter: larger is less noise (``E|z| = d / eta``), per-token epsilon ``eta * 2C``."""
    clip_norm: float | None = None
    """Per-token embedding norm bound ``C``; required by gaussian_mechanism, optional for metric_dp and laplace."""
    epsilon: float | None = None
    """gaussian_mechanism per-token epsilon that sets ``sigma_dp``."""
    delta: float = 1e-5
    """gaussian_mechanism per-token delta."""
    calibration: Calibration = "analytic"
    """How gaussian_mechanism turns (epsilon, delta) into sigma: ``analytic`` (Balle & Wang 2018) or ``classical``."""
    quantization_step: float = 0.01
    """quantization: the step ``D`` of the uniform quantisation proxy ``U(-D/2, D/2)``."""
    relative_scale: float = 0.1
    """relative: ``rho``, the noise RMS as a fraction of each token's embedding RMS."""
    laplace_scale: float = 0.01
    """laplace: ``b``, the per-coordinate scale of the Laplace noise (standard deviation ``b sqrt(2)``)."""
    tokens: TokenSelection = "all"
    """Which tokens get noise: ``all``, ``prompt``, ``response`` or ``spans`` (the batch's ``private_mask``)."""
    special_token_ids: list[int] = field(default_factory=list)
    """Token ids that are never noised (e.g. BOS, EOS, chat-template markers)."""
    schedule: ScheduleKind = "constant"
    """Scale schedule after warm-up: ``constant``, ``linear`` or ``cosine`` decay to ``min_factor``."""
    warmup_steps: int = 0
    """Iterations over which the scale ramps linearly from 0 to 1."""
    decay_steps: int = 0
    """Iterations (after warm-up) over which ``linear``/``cosine`` decay the scale from 1 to ``min_factor``."""
    min_factor: float = 0.0
    """Scale factor at the end of the decay, in [0, 1]."""
    training_only: bool = True
    """Add noise only while the model is in training mode (``model.train()``); False noises in eval too."""
    seed: int = 1234
    """Philox key of the noise (independent of Megatron's RNG); the same seed gives the same noise at any layout."""
    fast_math: bool = False
    """GPU only, Gaussian and Laplace units (gaussian, gaussian_mechanism, laplace): the Triton kernel takes the
    logarithm from the hardware ``lg2.approx`` and contracts its multiply-adds, about a third fewer instructions in
    a kernel bound by instruction issue (benchmarks/SFT_THROUGHPUT.md). The same Philox words and transforms;
    values differ from the exact kernel's by up to a few 1e-4 of the noise scale (where the Box-Muller radius is
    near 0), so the noise bits differ: a checkpoint resumes only with the setting it was saved with. Uniform noise
    and the CPU path are the same either way."""
    projection: Projection = "none"
    """``nearest_row``: each noised token's embedding is then replaced by the embedding-table row nearest to it
    (``noise/projection.py``). Post-processing of the noised embedding: any DP guarantee of the mechanism is
    unchanged. Any mechanism; it does something only while noise is added. ``posterior_mean``: replaced by the
    mean of the table rows weighted by the mechanism's noise density at the release (uniform prior, or
    ``projection_prior``'s; ``noise/denoise.py``); only mechanisms with one fixed density (``_check_projection``)."""
    projection_metric: ProjectionMetric = "l2"
    """What ``nearest_row`` means: ``l2`` (distance to the rows as the mechanism noises them, clipped where it clips)
    or ``cosine`` (the most similar direction)."""
    projection_prior: str | None = None
    """``posterior_mean`` only: a token-prior file (``noise/token_prior.py``; ``data.span_token_prior`` writes one from
    a chat JSONL's private spans) whose prior over the rows replaces the uniform one, e.g. the task's vocabulary.
    Post-processing with public side information: the DP guarantee is unchanged. Read when the config is checked."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field as it is now; ``SettingError`` (a ``ValueError``) naming the field, the value and what
        is allowed.

        Runs on construction and once more at the gate where the config starts work (a provider's ``finalize``,
        which Bridge's ``ConfigContainer.validate`` calls; ``make_noisy`` for a model built without Bridge), because
        an assignment after construction (``config.alpha = -1``) does not run ``__post_init__``; code past the gate
        trusts the config. Normalises ``special_token_ids`` to a list.
        """
        self._check()

    def _check(self) -> None:
        check_choice(_FIELD + "mechanism", self.mechanism, tuple(NOISE_FAMILIES))
        check_choice(_FIELD + "scaling", self.scaling, SCALINGS)
        check_choice(_FIELD + "tokens", self.tokens, TOKEN_SELECTIONS)
        check_choice(_FIELD + "schedule", self.schedule, SCHEDULES)
        check_choice(_FIELD + "calibration", self.calibration, CALIBRATIONS)
        check_choice(_FIELD + "projection", self.projection, PROJECTIONS)
        check_choice(_FIELD + "projection_metric", self.projection_metric, PROJECTION_METRICS)
        for name in ("enabled", "training_only", "fast_math"):
            check_bool(_FIELD + name, getattr(self, name))
        for name in _NON_NEGATIVE_MAGNITUDES:
            check_number(_FIELD + name, getattr(self, name), minimum=0.0)
            check_float32(_FIELD + name, getattr(self, name))
        check_number(_FIELD + "eta", self.eta, minimum=0.0, inclusive=False)
        check_float32(_FIELD + "eta", self.eta, what="eta")
        check_number(_FIELD + "delta", self.delta, minimum=0.0, maximum=1.0, inclusive=False)
        check_number(_FIELD + "min_factor", self.min_factor, minimum=0.0, maximum=1.0)
        self._check_embedding_distance()
        if self.clip_norm is not None:
            check_number(_FIELD + "clip_norm", self.clip_norm, minimum=0.0, inclusive=False, optional=True)
            check_float32(_FIELD + "clip_norm", self.clip_norm, what="the clipped embedding norm")
        if self.epsilon is not None:
            check_number(_FIELD + "epsilon", self.epsilon, minimum=0.0, inclusive=False, optional=True)
            check_float32(_FIELD + "epsilon", self.epsilon, what="epsilon")
        check_int(_FIELD + "seed", self.seed, maximum=2**32 - 1)
        check_int(_FIELD + "warmup_steps", self.warmup_steps)
        check_int(_FIELD + "decay_steps", self.decay_steps)
        if not isinstance(self.special_token_ids, (list, tuple)):
            raise SettingError(
                _FIELD + "special_token_ids", self.special_token_ids, "a list of integer token ids >= 0, e.g. [0, 2]"
            )
        self.special_token_ids = list(self.special_token_ids)
        for token_id in self.special_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < 2**63:
                raise SettingError(
                    _FIELD + "special_token_ids",
                    self.special_token_ids,
                    "a list of integer token ids >= 0 (and < 2**63: token ids are int64 tensors)",
                )
        self._check_schedule()
        self._check_privacy_mechanism()
        self._check_projection()
        self._check_unused_magnitudes()

    def _check_projection(self) -> None:
        """posterior_mean weighs the rows by the noise density: it needs one with a single scale per run; a prior
        file only with it, and one that reads as a token prior."""
        family = noise_family(self.mechanism)
        if self.projection_prior is not None:
            if not isinstance(self.projection_prior, (str, os.PathLike)) or not os.fspath(self.projection_prior):
                raise SettingError(_FIELD + "projection_prior", self.projection_prior, "a token-prior file or None")
            self.projection_prior = os.fspath(self.projection_prior)
            if self.projection != "posterior_mean":
                raise SettingError(
                    _FIELD + "projection_prior",
                    self.projection_prior,
                    "None",
                    context=f" with projection={self.projection!r}",
                    why=": only projection='posterior_mean' weighs the rows by a prior",
                )
            read_token_prior(self.projection_prior)
        if self.projection != "posterior_mean":
            return
        if family.unit != family.attacker_density:
            why = f": {self.mechanism} noise ({family.unit} per coordinate) has no density the posterior weighs with"
        elif family.relative_to_embedding:
            why = f": {self.mechanism} noise is scaled by each token's own RMS, not one density for every row"
        elif family.length_scaled and self.scaling in ("true_length", "padded_length"):
            why = f": scaling={self.scaling!r} sizes the noise per sequence length, not one density for every token"
        elif self.schedule != "constant" or self.warmup_steps:
            why = ": a schedule or warm-up changes the noise scale between iterations"
        else:
            return
        raise SettingError(
            _FIELD + "projection",
            self.projection,
            "a mechanism with one fixed noise density (gaussian_mechanism, metric_dp, laplace, or gaussian with "
            "scaling='absolute' or 'embedding_distance' and a constant schedule without warm-up), or "
            "projection='nearest_row'",
            context=f" with mechanism={self.mechanism!r}",
            why=why,
        )

    def _check_unused_magnitudes(self) -> None:
        """Another family's magnitude field moved off its default (``alpha: 10`` with ``mechanism: gaussian``) would be
        dropped without a word: refused, naming the field this mechanism's level is set by."""
        own = noise_family(self.mechanism).magnitude_field
        for name, default in unused_magnitude_defaults(self.mechanism).items():
            if getattr(self, name) != default:
                raise SettingError(
                    _FIELD + name,
                    getattr(self, name),
                    f"its default {default!r}, or the mechanism that {name} sets",
                    context=f" with mechanism={self.mechanism!r}",
                    why=f": {self.mechanism} noise does not use it (its level is {own}), so it would be ignored",
                )

    def _check_schedule(self) -> None:
        if self.schedule != "constant" and self.decay_steps == 0:
            raise SettingError(
                _FIELD + "decay_steps",
                0,
                "decay_steps >= 1 (or schedule='constant')",
                context=f" with schedule={self.schedule!r}",
            )
        if noise_family(self.mechanism).privacy_mechanism and (self.schedule != "constant" or self.warmup_steps):
            scheduled = self.schedule != "constant"
            raise SettingError(
                _FIELD + ("schedule" if scheduled else "warmup_steps"),
                self.schedule if scheduled else self.warmup_steps,
                "schedule='constant' and warmup_steps=0",
                context=(f" with warmup_steps={self.warmup_steps} and" if scheduled else " with")
                + f" mechanism={self.mechanism!r}",
                why=" (a privacy mechanism is calibrated once)",
            )

    def _check_embedding_distance(self) -> None:
        check_number(_FIELD + "distance_multiple", self.distance_multiple, minimum=0.0)
        check_float32(_FIELD + "distance_multiple", self.distance_multiple)
        if self.embedding_distance is not None:
            check_number(
                _FIELD + "embedding_distance", self.embedding_distance, minimum=0.0, inclusive=False, optional=True
            )
            check_float32(_FIELD + "embedding_distance", self.embedding_distance)
        if self.scaling == "embedding_distance" and not noise_family(self.mechanism).length_scaled:
            raise SettingError(
                _FIELD + "scaling",
                "embedding_distance",
                f"mechanism in {', '.join(LENGTH_SCALED_MECHANISMS)} (the others size their noise themselves)",
                context=f" with mechanism={self.mechanism!r}",
            )

    def _check_privacy_mechanism(self) -> None:
        family = noise_family(self.mechanism)
        if family.clip == "required" and self.clip_norm is None:
            raise SettingError(
                _FIELD + "clip_norm",
                None,
                "the per-token norm bound C > 0 (embeddings are clipped to it; the sensitivity is 2C)",
                context=f" with mechanism={self.mechanism!r}",
            )
        if family.check is not None:
            family.check(self)

    @property
    def sensitivity(self) -> float | None:
        """L2 sensitivity of one token's embedding under replacement (``2 * clip_norm``), None without a clip."""
        return None if self.clip_norm is None else 2.0 * float(self.clip_norm)

    @property
    def dp_sigma(self) -> float:
        """gaussian_mechanism: the noise standard deviation calibrated to (epsilon, delta) at sensitivity ``2C``."""
        if noise_family(self.mechanism).magnitude is not gaussian_mechanism_sigma:
            raise ValueError(f"dp_sigma is defined for mechanism='gaussian_mechanism', not {self.mechanism!r}.")
        return gaussian_mechanism_sigma(self)

    @property
    def magnitude(self) -> float:
        """The mechanism's base magnitude: alpha, sigma, 1/eta, sigma_dp, quantization_step, relative_scale or
        laplace_scale (distance_multiple for uniform and gaussian under ``embedding_distance`` scaling)."""
        family = noise_family(self.mechanism)
        if self.scaling == "embedding_distance" and family.length_scaled:
            return float(self.distance_multiple)
        return family.level(self)

    @property
    def silent_field(self) -> str | None:
        """The magnitude field that turns an enabled noise into none (``alpha`` at 0), or None when the settings add
        noise or are disabled outright: a run with it trains a plain model while saying it adds noise."""
        if not self.enabled or self.magnitude > 0:
            return None
        family = noise_family(self.mechanism)
        return (
            "distance_multiple"
            if self.scaling == "embedding_distance" and family.length_scaled
            else family.magnitude_field
        )

    @property
    def is_active_configuration(self) -> bool:
        """True when the settings add a non-zero noise at all (enabled and a positive magnitude)."""
        return self.enabled and self.magnitude > 0


def unused_magnitude_defaults(mechanism: str) -> dict[str, Any]:
    """The other families' magnitude fields and their defaults: what a config of ``mechanism`` must leave them at
    (``dataclasses.replace(config, mechanism=m, **unused_magnitude_defaults(m))`` switches a config's family)."""
    own = noise_family(mechanism).magnitude_field
    defaults = {f.name: f.default for f in fields(NoiseConfig)}
    magnitudes = dict.fromkeys(family.magnitude_field for family in NOISE_FAMILIES.values())
    return {name: defaults[name] for name in magnitudes if name != own}


def load_noise_config(name_or_path: str | os.PathLike[str], **overrides: Any) -> NoiseConfig:
    """A ``NoiseConfig`` from a preset name (``neftune_alpha5``; ``presets.available_presets("noise")``) or a YAML
    file of its fields, then ``overrides``; validated like every ``NoiseConfig``.

    Args:
        name_or_path: a preset of ``configs/noise`` (shipped in the wheel) or the path of a YAML file.
        **overrides: ``NoiseConfig`` fields set after the file's (``seed=7``, ``alpha=10.0``).

    Returns:
        The validated ``NoiseConfig``.

    Example::

        config = load_noise_config("neftune_alpha5", seed=7)
        private = load_noise_config("private_prompt_gaussian_mechanism", epsilon=20.0)
    """
    return load_config_yaml_fields(NoiseConfig, preset_path("noise", name_or_path), **overrides)


def parse_noise_arguments(
    arguments: Sequence[str],
    settings: Collection[str],
    *,
    required: Sequence[str] | Callable[[dict[str, Any]], Sequence[str]],
    example: str,
    text_keys: Collection[str] = (),
) -> dict[str, Any]:
    """``key=value`` ``arguments`` of a command whose keys are its own ``settings`` or ``NoiseConfig`` fields.

    Raises ``ValueError`` naming any unknown key (with what is allowed) or any missing ``required`` one (keys, or a
    function of the parsed values giving them) with ``example``, a working argument list; ``text_keys`` stay strings
    (``yaml_files.parse_key_values``)."""
    from nemo_noise_plugin.yaml_files import parse_key_values

    values = parse_key_values(arguments, text_keys=text_keys)
    names = [entry.name for entry in fields(NoiseConfig)]
    unknown = sorted(key for key in values if key not in settings and key not in names)
    if unknown:
        raise ValueError(
            f"unknown argument(s) {', '.join(unknown)}: expected {', '.join(settings)} or a NoiseConfig field "
            f"({', '.join(names)})."
        )
    missing = [key for key in (required(values) if callable(required) else required) if key not in values]
    if missing:
        raise ValueError(f"missing argument(s) {', '.join(missing)}: e.g. {example}.")
    return values
