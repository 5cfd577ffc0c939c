"""A prior over the table rows for the posterior-mean denoiser: which tokens a release is likely to come from.

``NoiseConfig.projection_prior`` names a token-prior file. ``projection='posterior_mean'`` then weighs each table row
by ``prior(v) * p(y | e_v)`` instead of ``p(y | e_v)`` alone (``noise/denoise.py``), so a release is explained by the
tokens the task actually uses rather than by any of the table's rows. The prior is public side information of
whoever serves the model (for the shipped tasks: token counts of the training split's private spans,
``data.span_token_prior``), applied to the release after the mechanism: post-processing, so the mechanism's DP
guarantee and the ledger's numbers are unchanged.

The file is JSON::

    {"format": "nemo-noise-token-prior/1", "vocab_size": 49152, "weighting": "frequency",
     "counts": [[token_id, count], ...], "source": "what the counts were taken from"}

``weighting`` is ``frequency`` (``prior(v)`` proportional to ``count(v)``) or ``support`` (uniform over the tokens
with a count); a token without a count has prior 0, i.e. the denoiser never explains a release by it. A table with
more rows than ``vocab_size`` (Megatron pads the vocabulary) gives the padding rows prior 0.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from nemo_noise_plugin.validation import SettingError

__all__ = ["PRIOR_FORMAT", "PRIOR_WEIGHTINGS", "TokenPrior", "read_token_prior", "write_token_prior"]

PRIOR_FORMAT = "nemo-noise-token-prior/1"
PRIOR_WEIGHTINGS = ("frequency", "support")
_SETTING = "NoiseConfig.projection_prior"


@dataclass(frozen=True)
class TokenPrior:
    """A checked token prior: ``counts`` (``{token id: count > 0}``) over a vocabulary of ``vocab_size`` ids."""

    vocab_size: int
    counts: Mapping[int, int]
    weighting: str
    source: str = ""

    def log_prior(self, rows: int, *, start: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
        """``[rows]`` float32 log-prior of the table rows ``start .. start + rows`` (a vocabulary shard's global
        ids), normalised over the whole vocabulary; ``-inf`` for a row without a count."""
        import torch  # here, not at the top: NoiseConfig reads prior files, and listing recipes loads no torch

        total = sum(self.counts.values()) if self.weighting == "frequency" else len(self.counts)
        out = torch.full((rows,), -math.inf, dtype=torch.float32)
        for token, count in self.counts.items():
            if start <= token < start + rows:
                out[token - start] = math.log((count if self.weighting == "frequency" else 1) / total)
        return out.to(device) if device is not None else out


def write_token_prior(
    path: str | os.PathLike[str],
    counts: Mapping[int, int],
    *,
    vocab_size: int,
    weighting: str = "frequency",
    source: str = "",
) -> Path:
    """Write ``counts`` as a token-prior file at ``path`` (written to a temporary name, then renamed into place);
    ``SettingError`` before anything is written when they do not make a prior."""
    pairs = sorted([int(token), int(count)] for token, count in counts.items())
    document = dict(format=PRIOR_FORMAT, vocab_size=vocab_size, weighting=weighting, source=source, counts=pairs)
    _checked(document, str(path))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")  # concurrent writers never share one
    partial.write_text(json.dumps(document) + "\n")
    os.replace(partial, target)
    return target


def read_token_prior(path: str | os.PathLike[str]) -> TokenPrior:
    """The checked token prior in the file at ``path``; ``SettingError`` naming ``NoiseConfig.projection_prior``
    when the file is missing, not JSON or not a token prior. Read once per path and modification time."""
    resolved = Path(path).expanduser()
    try:
        stamp = resolved.stat().st_mtime_ns
    except OSError as error:
        raise SettingError(_SETTING, str(path), "a token-prior JSON file (data.span_token_prior writes one)",
                           why=f": it cannot be read ({error.strerror})") from None  # fmt: skip
    return _read(str(resolved), stamp)


@functools.lru_cache(maxsize=8)
def _read(path: str, _stamp: int) -> TokenPrior:
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SettingError(_SETTING, path, "a token-prior JSON file (data.span_token_prior writes one)",
                           why=f": it is not JSON ({error})") from None  # fmt: skip
    return _checked(document, path)


def _checked(document: object, path: str) -> TokenPrior:
    def refuse(why: str) -> SettingError:
        return SettingError(_SETTING, path, f"a token-prior file ({PRIOR_FORMAT}: vocab_size, weighting, counts)",
                            why=": " + why)  # fmt: skip

    if not isinstance(document, dict) or document.get("format") != PRIOR_FORMAT:
        raise refuse(f"its 'format' is not {PRIOR_FORMAT!r}")
    vocab_size, weighting = document.get("vocab_size"), document.get("weighting")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise refuse(f"vocab_size={vocab_size!r} is not an integer >= 1")
    if weighting not in PRIOR_WEIGHTINGS:
        raise refuse(f"weighting={weighting!r} is not one of {', '.join(PRIOR_WEIGHTINGS)}")
    counts: dict[int, int] = {}
    pairs = document.get("counts")
    for pair in pairs if isinstance(pairs, list) else [None]:
        if not (isinstance(pair, list) and len(pair) == 2 and all(_is_int(x) for x in pair)):
            raise refuse(f"counts must be a list of [token_id, count] integer pairs, not {pair!r}")
        token, count = pair
        if not 0 <= token < vocab_size or count < 1 or token in counts:
            raise refuse(f"the pair {pair} needs 0 <= token_id < vocab_size={vocab_size}, count >= 1, each id once")
        counts[token] = count
    if not counts:
        raise refuse("it counts no token (every release would have prior 0)")
    return TokenPrior(vocab_size, counts, weighting, str(document.get("source", "")))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
