"""The language-model-prior beam attack (the BeamClean idea): the token sequence that best explains the noised
embeddings under the noise's likelihood plus a language model's log-probabilities."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.families import noise_family
from nemo_noise_plugin.noise.schedule import schedule_factor
from nemo_noise_plugin.privacy.audit.checks import check_search_args, check_table, shape_of
from nemo_noise_plugin.privacy.audit.noised import real_tokens
from nemo_noise_plugin.privacy.audit.search import DEFAULT_QUERY_CHUNK, DEFAULT_VOCAB_CHUNK, Scoring, search
from nemo_noise_plugin.validation import check_int, check_number

__all__ = ["LmLogProbs", "lm_beam_attack", "noise_likelihood"]

LmLogProbs = Callable[[torch.Tensor], torch.Tensor]
"""``lm_log_probs(prefix_ids [rows, t]) -> [rows, V]``: log-probabilities of the next token after each prefix."""
_MIN_SCALE = 1e-12  # noise scale used for tokens the configuration leaves (almost) noise-free


def noise_likelihood(
    config: NoiseConfig,
    noised: torch.Tensor,
    iteration: int = 0,
    loss_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
) -> Scoring:
    """The beam attack's noise log-likelihood for ``[b, s, h]`` observations (see ``lm_beam_attack``).

    Its per-token scale is the mechanism family's ``attacker_noise`` (``noise/families.py``): the same
    ``token_scale`` the noise layer draws with, from the same sequence lengths, so the attacker's noise model is
    the drawn noise's for every mechanism and scaling; its density is the family's ``attacker_density``.
    ``Scoring.scale`` is ``[b * s]``.
    """
    batch, seq, hidden = noised.shape
    if not config.is_active_configuration:
        return Scoring("gaussian", scale=torch.full((batch * seq,), _MIN_SCALE, device=noised.device))
    _, lengths = real_tokens(config, noised, loss_mask, padding_mask)
    model = noise_family(config.mechanism).attacker_noise(
        config, lengths, seq, hidden, schedule_factor(config, iteration)
    )
    scale = model.scale.reshape(-1).clamp_min(_MIN_SCALE)
    return Scoring(model.density, clip_norm=model.clip_norm, scale=scale, relative=model.relative)


@torch.no_grad()
def lm_beam_attack(
    noised: torch.Tensor,
    table: torch.Tensor,
    noise_config: NoiseConfig,
    lm_log_probs: LmLogProbs,
    *,
    iteration: int = 0,
    loss_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    candidates: int = 8,
    beam_width: int = 4,
    lm_weight: float = 1.0,
    sequence_chunk: int = 64,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
) -> torch.Tensor:
    """The ``[b, s]`` token sequences that best explain ``noised`` (``[b, s, h]``) under noise and a language model.

    Per position the ``candidates`` tokens of highest noise log-likelihood are kept; a beam of ``beam_width``
    sequences then runs left to right, scoring ``sum_t loglik_t + lm_weight * log p_LM(token_t | tokens_<t)``
    (the first token by its likelihood alone) with ``lm_log_probs(prefix_ids [rows, t]) -> [rows, >= V]``.
    Sequences go to the LM ``sequence_chunk`` at a time (``sequence_chunk * beam_width`` rows per call).

    Noise log-likelihood of candidate ``e`` for observation ``y`` (per-token constants dropped), from
    ``noise_config``, ``iteration`` (schedule factor ``f``) and the masks (sequence lengths, as in training):

    - gaussian: ``-|y - e|^2 / (2 s^2)``, ``s = f sigma c`` with the scaling's length factor ``c`` (NEFTune's
      ``1/sqrt(L d)``, 1, or the ``embedding_distance`` factor, with ``distance_multiple`` for sigma);
    - uniform (NEFTune) and quantization: the same Gaussian form with the noise's standard deviation,
      ``s = f alpha c / sqrt(3)`` and ``s = f D / (2 sqrt(3))`` (a smooth stand-in for the box-shaped density);
    - gaussian_mechanism: ``-|y - clip(e)|^2 / (2 sigma_dp^2)``;
    - metric_dp: ``-eta |y - clip(e)|``, the exact density of its unit (clipped when ``clip_norm`` is set);
    - relative: the Gaussian log-likelihood with std ``f rho rms(e)``,
      ``-|y - e|^2 / (2 (f rho rms(e))^2) - d log rms(e)``.

    Every position is scored as noised; an unnoised token (padding, special, unselected) equals its own row and
    is explained best by it. A configuration without noise uses a vanishing scale (nearest neighbour).
    """
    check_table("table", table)
    if not callable(lm_log_probs):
        raise ValueError(f"lm_log_probs={lm_log_probs!r} is invalid: expected a callable prefix_ids -> log-probs.")
    if not isinstance(noised, torch.Tensor) or noised.dim() != 3 or noised.size(-1) != table.size(1):
        raise ValueError(
            f"noised has shape {shape_of(noised)}: expected [b, s, h] with h = the table's hidden size {table.size(1)}."
        )
    batch, seq, hidden = noised.shape
    check_search_args(
        noised.reshape(-1, hidden), table, top_k=candidates, vocab_chunk=vocab_chunk, query_chunk=query_chunk
    )
    check_int("iteration", iteration, minimum=0)
    check_int("beam_width", beam_width, minimum=1)
    check_int("sequence_chunk", sequence_chunk, minimum=1)
    check_number("lm_weight", lm_weight, minimum=0.0)
    scoring = noise_likelihood(noise_config, noised, iteration, loss_mask, padding_mask)
    scores, ids = search(
        noised.reshape(-1, hidden), table, scoring, top_k=candidates, vocab_chunk=vocab_chunk, query_chunk=query_chunk
    )
    scores, ids = scores.view(batch, seq, -1).double(), ids.view(batch, seq, -1)
    parts = [
        _beam_search(
            scores[first : first + sequence_chunk],
            ids[first : first + sequence_chunk],
            lm_log_probs,
            beam_width=beam_width,
            lm_weight=float(lm_weight),
            vocab_size=table.size(0),
        )
        for first in range(0, batch, sequence_chunk)
    ]
    return torch.cat(parts) if parts else ids[..., 0]


def _beam_search(
    noise_scores: torch.Tensor,
    candidates: torch.Tensor,
    lm_log_probs: LmLogProbs,
    *,
    beam_width: int,
    lm_weight: float,
    vocab_size: int,
) -> torch.Tensor:
    """Best ``[b, s]`` sequences from per-position candidates ``[b, s, K]`` and their noise log-likelihoods."""
    batch, seq, width = candidates.shape
    beams = candidates[:, 0, :beam_width].unsqueeze(-1)  # [b, B, t]
    totals = noise_scores[:, 0, :beam_width]  # [b, B]
    for position in range(1, seq):
        live = beams.size(1)
        prior = _lm_scores(lm_log_probs, beams, vocab_size)
        step = candidates[:, position]
        step_prior = prior.gather(2, step.unsqueeze(1).expand(-1, live, -1))  # [b, B, K]
        expanded = totals.unsqueeze(2) + noise_scores[:, position].unsqueeze(1) + lm_weight * step_prior
        totals, flat = expanded.flatten(1).sort(dim=1, descending=True, stable=True)
        totals, flat = totals[:, :beam_width], flat[:, :beam_width]
        parent, choice = flat // width, flat % width
        history = beams.gather(1, parent.unsqueeze(-1).expand(-1, -1, position))
        beams = torch.cat([history, step.gather(1, choice).unsqueeze(-1)], dim=2)
    return beams[:, 0]


def _lm_scores(lm_log_probs: LmLogProbs, beams: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[b, B, V]`` float64 next-token log-probabilities after each beam's prefix."""
    batch, live, length = beams.shape
    rows = batch * live
    log_probs = lm_log_probs(beams.reshape(rows, length))
    if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2 or log_probs.size(0) != rows:
        raise ValueError(
            f"lm_log_probs returned shape {shape_of(log_probs)} for {rows} prefixes: "
            f"expected [{rows}, V >= {vocab_size}]."
        )
    if log_probs.size(1) < vocab_size:
        raise ValueError(
            f"lm_log_probs returned {log_probs.size(1)} columns: expected at least the table's {vocab_size} tokens."
        )
    return log_probs.to(device=beams.device, dtype=torch.float64).view(batch, live, -1)
