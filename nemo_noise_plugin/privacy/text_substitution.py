"""Text-level substitution, the SANTEXT-style baseline (Yue et al. 2021): protected tokens replaced by sampled tokens.

Instead of noising an embedding, the server is sent another *token*: each protected token ``x`` is replaced by a
token ``y`` drawn from the whole vocabulary with the exponential mechanism on embedding distance,

    P(y | x) = exp(-eps * d(x, y) / (2 * Delta)) / sum_z exp(-eps * d(x, z) / (2 * Delta)),

``d`` the Euclidean distance between rows of the embedding table (clipped to norm ``clip_norm`` = C when given) and
``Delta`` the bound on ``d`` over the table: ``2 C`` with clipping (the L2 sensitivity the Gaussian mechanism of the
grid uses), else twice the largest row norm (by the triangle inequality no two rows are farther apart).

**Guarantee.** For any two tokens ``x, x'`` and any output ``y``, ``P(y | x) / P(y | x') <= exp(eps * d(x, x') /
Delta)`` (the numerator changes by at most ``exp(eps d(x,x') / (2 Delta))``, the normaliser by at most as much): the
mechanism is ``(eps / Delta) * d``-private (metric local DP, d_X-privacy), and since ``d <= Delta`` on the table, it
is pure ``eps``-local-DP per token: replacing one token by any other changes the output distribution by at most a
factor ``e^eps``. That is the per-token unit of the grid's Gaussian mechanism, which gives ``(eps, delta)``-DP per
token for a replaced token at L2 sensitivity ``2 C``; so "the same per-token eps" means: the same ``eps``, the same
clipped table, ``Delta = 2 C`` here and sensitivity ``2 C`` there, with ``delta = 0`` here (a stronger guarantee at
equal eps). A span or prompt of ``k`` protected tokens composes to ``k * eps`` (basic composition, as the ledger
counts). Unprotected tokens are sent unchanged and carry no guarantee. Sampling uses the table only, never the
context, so the output is post-processable by anything (a model, an attack) without changing the guarantee.

**Cost.** Distances are computed in chunks of ``chunk_tokens`` protected tokens, so the extra memory is about
``chunk_tokens * V`` float64 values (128 x 49,152 = 50 MB); one uniform number per protected token is drawn from the
generator up front and turned into a token by inverse-CDF lookup, so the result does not depend on the chunk size.
"""

from __future__ import annotations

import math

import torch

from nemo_noise_plugin.validation import SettingError, check_int, check_number

__all__ = ["substitute_tokens", "substitution_probabilities", "substitution_sensitivity"]

DEFAULT_CHUNK_TOKENS = 128


def _clipped(table: torch.Tensor, clip_norm: float | None) -> torch.Tensor:
    rows = table.detach().to(torch.float64)
    if clip_norm is None:
        return rows
    norms = rows.norm(dim=1, keepdim=True)
    return rows * torch.clamp(clip_norm / norms.clamp_min(1e-300), max=1.0)


def _check_table(table: object, clip_norm: object) -> None:
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.is_floating_point() or table.numel() == 0:
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise SettingError("table", shape, "a non-empty floating-point [V, d] embedding table")
    if clip_norm is not None:
        check_number("clip_norm", clip_norm, minimum=0.0, maximum=math.inf, inclusive=False, why=" (or None)")


def substitution_sensitivity(table: torch.Tensor, clip_norm: float | None = None) -> float:
    """``Delta``, the bound on the distance between any two rows: ``2 * clip_norm``, else twice the largest row norm.

    >>> substitution_sensitivity(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
    10.0
    """
    _check_table(table, clip_norm)
    if clip_norm is not None:
        return 2.0 * float(clip_norm)
    return 2.0 * float(table.detach().to(torch.float64).norm(dim=1).max())


def _check_eps(eps: object) -> float:
    if isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps == math.inf:
        return math.inf
    check_number("eps", eps, minimum=0.0, why=": eps per protected token (0 = uniform, inf = unchanged)")
    return float(eps)


def _probabilities(rows: torch.Tensor, ids: torch.Tensor, eps: float, delta: float) -> torch.Tensor:
    """``[len(ids), V]`` float64 probabilities of the exponential mechanism for the tokens ``ids``."""
    distances = torch.cdist(rows[ids], rows, compute_mode="donot_use_mm_for_euclid_dist")  # exact, row by row
    return torch.softmax(-eps * distances / (2.0 * delta), dim=1)


def substitution_probabilities(
    table: torch.Tensor, token_ids: torch.Tensor, eps: float, *, clip_norm: float | None = None
) -> torch.Tensor:
    """``P(y | x)`` for each token of ``token_ids`` (1-D) over the vocabulary: ``[len(token_ids), V]``, float64.

    The attacker's likelihood of each output given each input; ``substitute_tokens`` samples from it.
    """
    _check_table(table, clip_norm)
    eps = _check_eps(eps)
    if eps == math.inf:
        raise SettingError("eps", eps, "a finite number >= 0 for probabilities (inf: the token is sent unchanged)")
    ids = torch.as_tensor(token_ids).reshape(-1).to(torch.long)
    rows = _clipped(table, clip_norm)
    return _probabilities(rows, ids.to(rows.device), eps, substitution_sensitivity(table, clip_norm))


def substitute_tokens(
    table: torch.Tensor,
    token_ids: torch.Tensor,
    protected: torch.Tensor,
    eps: float,
    *,
    clip_norm: float | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """``token_ids`` with every ``protected`` position replaced by a token sampled with the exponential mechanism.

    Args:
        table: the model's input embedding table ``[V, d]`` (the whole vocabulary).
        token_ids: integer ids in ``[0, V)``, any shape.
        protected: bool mask of ``token_ids``'s shape; only these positions are resampled.
        eps: per-token epsilon (``>= 0``; 0 samples uniformly, ``math.inf`` returns the input unchanged).
        clip_norm: clip every row to this L2 norm first (the grid's C); ``Delta = 2 * clip_norm``.
        seed / generator: exactly one: an int seeding a CPU generator, or a CPU ``torch.Generator``.
        chunk_tokens: protected tokens per distance chunk (memory ``chunk_tokens * V`` float64).

    Returns:
        A new tensor of ``token_ids``'s shape, dtype and device.

    >>> table = torch.eye(4)
    >>> ids, mask = torch.tensor([0, 1, 2, 3]), torch.tensor([True, False, True, False])
    >>> substitute_tokens(table, ids, mask, eps=math.inf, seed=0).tolist()
    [0, 1, 2, 3]
    >>> out = substitute_tokens(table, ids, mask, eps=0.0, seed=0)
    >>> out[~mask].tolist()
    [1, 3]
    """
    _check_table(table, clip_norm)
    eps = _check_eps(eps)
    check_int("chunk_tokens", chunk_tokens, minimum=1)
    if (seed is None) == (generator is None):
        raise SettingError("seed", seed, "exactly one of seed (an int) and generator (a CPU torch.Generator)")
    if seed is not None:
        check_int("seed", seed, minimum=0)
        generator = torch.Generator(device="cpu").manual_seed(seed)
    elif not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise SettingError("generator", generator, "a CPU torch.Generator")
    if not isinstance(token_ids, torch.Tensor) or token_ids.is_floating_point() or token_ids.is_complex():
        raise SettingError("token_ids", getattr(token_ids, "dtype", type(token_ids).__name__), "an integer tensor")
    if not isinstance(protected, torch.Tensor) or protected.dtype != torch.bool or protected.shape != token_ids.shape:
        shape = tuple(protected.shape) if isinstance(protected, torch.Tensor) else type(protected).__name__
        raise SettingError("protected", shape, f"a bool tensor of token_ids's shape {tuple(token_ids.shape)}")
    vocab = table.shape[0]
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
        bad = int(token_ids.min()) if int(token_ids.min()) < 0 else int(token_ids.max())
        raise SettingError("token_ids", bad, f"ids in [0, {vocab}) (the table's rows)")
    result = token_ids.clone()
    if eps == math.inf or not bool(protected.any()):
        return result
    flat = result.reshape(-1)
    positions = protected.reshape(-1).nonzero().squeeze(1)
    uniforms = torch.rand(positions.numel(), generator=generator, dtype=torch.float64)  # one per token, up front
    rows = _clipped(table, clip_norm)
    delta = substitution_sensitivity(table, clip_norm)
    for start in range(0, positions.numel(), chunk_tokens):
        chunk = positions[start : start + chunk_tokens]
        ids = flat[chunk].to(device=rows.device, dtype=torch.long)
        cumulative = torch.cumsum(_probabilities(rows, ids, eps, delta), dim=1)
        u = (uniforms[start : start + chunk_tokens].to(rows.device) * cumulative[:, -1]).unsqueeze(1)
        picked = torch.searchsorted(cumulative, u, right=True).squeeze(1).clamp_(max=vocab - 1)
        flat[chunk] = picked.to(device=flat.device, dtype=flat.dtype)
    return result
