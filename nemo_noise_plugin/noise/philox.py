"""Philox4x32-10, the counter-based generator behind the layout-invariant noise, in plain torch.

The noise for one element is a pure function of ``(seed, iteration, global sample index, global token position,
hidden index)``: those are the Philox key and counter, so no generator state exists that a parallel layout, a
microbatch split, a recompute or a resume could shift. This module is the reference (CPU and any device); the
fused GPU kernel (``noise/triton_kernel.py``) computes the same 32-bit words with Triton's ``tl.philox``.

Counter contract (shared with the kernel):

- key ``(k0, k1) = (seed, iteration)``, both taken modulo 2**32 (either may be a 0-dim int64 tensor, as the
  replayable path's iteration is: ``noise/replayable.py``);
- counter ``(c0, c1, c2, c3) = (hidden // 4, token position, sample index, stream)``, each modulo 2**32;
- word ``i`` of the four outputs belongs to hidden index ``4 * (hidden // 4) + i``;
- ``stream`` separates independent draws for the same element (``STREAM_*`` below).

The algorithm is Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11), as in Random123 and Triton,
checked against Random123's known-answer vectors in the tests.
"""

from __future__ import annotations

import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

STREAM_NOISE = 0
"""The stream of the noise values themselves (uniform words, or Box-Muller inputs for Gaussian noise)."""
STREAM_RADIUS = 1
"""The stream of the exponential variates that sum to the metric-DP Gamma radius."""

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` for a 32-bit constant ``a`` and int64 tensor ``b`` in [0, 2**32)."""
    a_lo, a_hi = a & _MASK16, a >> 16
    b_lo, b_hi = b & _MASK16, b >> 16
    lo_lo = a_lo * b_lo
    lo_hi = a_lo * b_hi
    hi_lo = a_hi * b_lo
    middle = (lo_lo >> 16) + (lo_hi & _MASK16) + (hi_lo & _MASK16)
    low = ((middle & _MASK16) << 16) | (lo_lo & _MASK16)
    high = a_hi * b_hi + (lo_hi >> 16) + (hi_lo >> 16) + (middle >> 16)
    return high, low


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[int | torch.Tensor, int | torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 of broadcastable int64 counter words (values in [0, 2**32)) under a key of two ints or 0-dim
    int64 tensors (taken modulo 2**32); returns four int64 words."""
    c0, c1, c2, c3 = (torch.as_tensor(word, dtype=torch.int64) & _MASK32 for word in counter)
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for _ in range(PHILOX_ROUNDS):
        high0, low0 = _mulhilo32(PHILOX_M0, c0)
        high1, low1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = high1 ^ c1 ^ k0, low1, high0 ^ c3 ^ k1, low0
        k0, k1 = (k0 + PHILOX_W0) & _MASK32, (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def words_to_symmetric_uniform(words: torch.Tensor) -> torch.Tensor:
    """Map 32-bit words to float32 U(-1, 1): the odd multiples of 2**-24, symmetric around 0, exactly."""
    top24 = (words >> 8).to(torch.float32)
    return (top24 * 2.0 + (1.0 - 16777216.0)) * (2.0**-24)


def words_to_open_uniform(words: torch.Tensor) -> torch.Tensor:
    """Map 32-bit words to float32 U(0, 1), never 0 or 1: the odd multiples of 2**-24 in (0, 1), exactly."""
    top23 = (words >> 9).to(torch.float32)
    return (top23 * 2.0 + 1.0) * (2.0**-24)


def element_words(
    seed: int,
    iteration: int | torch.Tensor,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
    hidden_size: int,
    stream: int,
) -> torch.Tensor:
    """One 32-bit Philox word per element of a ``[tokens, hidden_size]`` block.

    ``sample_index`` and ``token_position`` are ``[tokens]`` int64 tensors (the global indices of each row);
    the result is ``[tokens, hidden_size]`` int64 holding values in [0, 2**32).
    """
    blocks = (hidden_size + 3) // 4  # the stream word is filled on the device: a host-made tensor would sync
    device = token_position.device
    block_index = torch.arange(blocks, dtype=torch.int64, device=device).view(1, blocks)
    words = philox4x32(
        (
            block_index,
            token_position.view(-1, 1),
            sample_index.view(-1, 1),
            torch.full((1, 1), stream, dtype=torch.int64, device=device),
        ),
        (seed, iteration),
    )
    return torch.stack(words, dim=-1).reshape(token_position.numel(), blocks * 4)[:, :hidden_size]
