"""Noise that overflows the model's numbers: refused when the model is built, and stopped if it happens anyway.

The norm layers square the noised embeddings and sum the squares over the hidden dimension (RMSNorm, LayerNorm), so
a token whose noise norm is past the square root of the dtype's largest number (``1.8e19`` in float32 and bf16,
``256`` in float16) is inf there, and the loss NaN: ``alpha=1e30`` or a metric-DP ``eta=1e-20`` trained on NaN
without a word. ``check_noise_fits`` bounds each family's per-token noise norm from its row of
``noise.families.NOISE_FAMILIES`` (the largest per-token scale over sequence lengths, times the unit sampler's
typical norm in ``hidden_size`` dimensions, with a margin of 2) and refuses a setting past it, naming the magnitude
field; the model mixin calls it when the noise layer is attached (``make_noisy`` and every provider build). Relative
noise scales with each token's own embedding and is not bounded here.

``check_noised_finite`` is the run-time guard for what no bound foresees: once per iteration (microbatch 0) the
noise layer checks the largest magnitude of the noised embeddings (one reduction), and a non-finite one raises the
same ``SettingError`` naming the setting instead of training on NaN. Reading that answer on the host waits for the
GPU, which a training step must not do (the host would stop queueing kernels ahead); ``DeferredFiniteCheck``, the
training model's guard, copies the answer into pinned host memory without waiting and reads it once the GPU has
passed that point (at the next iteration's check), raising the same error naming the iteration it happened at. On
the CPU, and for the audit and serving calls that use the layer once, the check is immediate.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nemo_noise_plugin.noise.families import noise_family
from nemo_noise_plugin.noise.sampling import unit_sampler
from nemo_noise_plugin.validation import SettingError

__all__ = [
    "DeferredFiniteCheck",
    "check_noise_fits",
    "check_noised_finite",
    "noise_norm_bound",
    "noise_overflowed",
    "noise_setting",
    "overflow_error",
]

_MARGIN = 2.0
"""A noise norm up to twice its typical value (the norm of ``d`` i.i.d. units concentrates far closer)."""


def noise_setting(config: Any) -> tuple[str, Any]:
    """The field that sets ``config``'s noise level and its value (``distance_multiple`` under ``embedding_distance``
    scaling, else the family's magnitude field)."""
    family = noise_family(config.mechanism)
    name = "distance_multiple" if family.length_scaled and config.scaling == "embedding_distance" else None
    name = name or family.magnitude_field
    return name, getattr(config, name)


def noise_norm_bound(config: Any, hidden_size: int) -> float | None:
    """About the largest per-token noise norm ``config`` draws in ``hidden_size`` dimensions (None: relative noise,
    which scales with the embedding; 0: no noise)."""
    family = noise_family(config.mechanism)
    if family.relative_to_embedding:
        return None
    try:
        base = float(family.base_scale(config))
        if family.length_scaled:
            if config.scaling == "embedding_distance":
                if config.embedding_distance is None:
                    return None
                return _MARGIN * base * float(config.embedding_distance)  # the RMS norm it is sized to
            if config.scaling in ("true_length", "padded_length"):
                base /= math.sqrt(hidden_size)  # the largest 1/sqrt(L d): a sequence of one token
    except (ArithmeticError, ValueError):
        return math.inf
    return _MARGIN * base * unit_sampler(family.unit).norm(hidden_size)


def _dtype_limit(dtype: torch.dtype | None) -> tuple[str, float]:
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
    return str(dtype).removeprefix("torch."), math.sqrt(torch.finfo(dtype).max)


def check_noise_fits(config: Any, hidden_size: int, dtype: torch.dtype | None = None) -> None:
    """``SettingError`` naming the noise level when ``config``'s per-token noise norm could pass the square root of
    ``dtype``'s largest number (float32 when unknown), where the norm layers' squares are inf."""
    if not config.enabled:
        return
    bound = noise_norm_bound(config, hidden_size)
    name, limit = _dtype_limit(dtype)
    if bound is None or bound <= limit:
        return
    field, value = noise_setting(config)
    raise SettingError(
        f"NoiseConfig.{field}",
        value,
        f"a noise level whose per-token noise norm stays below {limit:.3g} (this one reaches about {bound:.3g})",
        context=f" with mechanism={config.mechanism!r}, hidden_size={hidden_size} and {name}",
        why=": the norm layers square the noised embeddings, so a larger noise is inf there and the loss NaN",
    )


def _all_finite(values: torch.Tensor) -> torch.Tensor:
    """0-d bool: no inf or NaN in ``values`` (one min-max reduction, NaN propagating; no copy of ``values``)."""
    low, high = torch.aminmax(values.detach())
    return torch.isfinite(low) & torch.isfinite(high)


def noise_overflowed(noised: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """0-d bool on ``noised``'s device: ``noised`` holds inf or NaN although ``clean`` does not (one reduction each;
    ``clean`` may be the embedding table the noised rows were looked up from)."""
    return ~_all_finite(noised) & _all_finite(clean)


def overflow_error(config: Any, iteration: int) -> SettingError:
    """The ``SettingError`` that stops a run whose noised embeddings overflowed at ``iteration``, naming the level."""
    field, value = noise_setting(config)
    return SettingError(
        f"NoiseConfig.{field}",
        value,
        "a noise level whose noised embeddings stay finite",
        context=f" with mechanism={config.mechanism!r}",
        why=f": at iteration {iteration} they hold inf or NaN; training stopped",
    )


def check_noised_finite(config: Any, noised: torch.Tensor, clean: torch.Tensor, iteration: int) -> None:
    """``SettingError`` naming the noise level when ``noised`` holds inf or NaN although ``clean`` does not (one
    reduction each, read on the host at once: a GPU sync; call once per iteration)."""
    if bool(noise_overflowed(noised, clean)):
        raise overflow_error(config, iteration)


class DeferredFiniteCheck:
    """``check_noised_finite`` without a host sync on the GPU: the answer is read one check later.

    ``check`` first raises for any earlier iteration whose answer has arrived (``torch.cuda.Event.query``, which never
    waits), then queues this iteration's: the reduction, a non-blocking copy into pinned host memory and an event.
    By the next iteration's check the GPU has long passed the event, so a run stops one iteration after the overflow,
    naming the iteration it happened at. CPU tensors are checked at once. A copy (``copy.deepcopy``: the distillation
    teacher, the schedule plan) starts with nothing queued; CUDA events do not copy.
    """

    def __init__(self) -> None:
        self._queued: list[tuple[int, torch.Tensor, Any]] = []

    def __deepcopy__(self, memo: dict) -> DeferredFiniteCheck:
        return DeferredFiniteCheck()

    def __getstate__(self) -> dict:
        return {"_queued": []}

    def check(self, config: Any, noised: torch.Tensor, clean: torch.Tensor, iteration: int) -> None:
        """Raise for an arrived answer that overflowed, then queue (GPU) or run (CPU) this iteration's check."""
        self.raise_arrived(config)
        if not noised.is_cuda:
            check_noised_finite(config, noised, clean, iteration)
            return
        answer = torch.empty((), dtype=torch.bool, pin_memory=True)
        answer.copy_(noise_overflowed(noised, clean), non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        self._queued.append((iteration, answer, arrived))

    def raise_arrived(self, config: Any) -> None:
        """``SettingError`` for the first queued iteration whose answer has arrived and overflowed; the arrived
        answers leave the queue. Never waits for the GPU."""
        waiting = []
        overflowed_at = None
        for iteration, answer, arrived in self._queued:
            if not arrived.query():
                waiting.append((iteration, answer, arrived))
            elif bool(answer) and overflowed_at is None:
                overflowed_at = iteration
        self._queued = waiting
        if overflowed_at is not None:
            raise overflow_error(config, overflowed_at)

    @property
    def queued_iterations(self) -> list[int]:
        """The iterations whose answers have not been read yet."""
        return [iteration for iteration, _, _ in self._queued]
