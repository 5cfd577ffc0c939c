"""The posterior-mean denoiser's token prior from a chat JSONL: how often each token occurs inside private spans.

``NoiseConfig.projection_prior`` (``noise/token_prior.py``) weighs the table rows by a prior; for a task whose noised
tokens are its private spans (``tokens='spans'``), the natural prior is the spans' own vocabulary: count the tokens
that ``private_token_mask`` marks in every example of the training split, with the tokenizer the model is trained
with. The counts come from the training data, never from the input being served; the file is public side
information of whoever serves the model, so the denoiser stays post-processing of the release::

    from nemo_noise_plugin.data.span_token_prior import write_span_token_prior

    write_span_token_prior("training.jsonl", tokenizer, "prior.json")   # then projection_prior: prior.json
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from nemo_noise_plugin.data.private_spans import private_token_mask, read_private_spans, rendered_chat_ids
from nemo_noise_plugin.noise.token_prior import write_token_prior
from nemo_noise_plugin.validation import SettingError

__all__ = ["span_token_counts", "write_span_token_prior"]


def span_token_counts(examples: Iterable[Mapping[str, Any]], tokenizer: Any, *, name: str = "examples") -> Counter:
    """``{token id: count}`` of the private-span tokens of chat ``examples`` (``messages`` and ``private_spans``)
    rendered by ``tokenizer``'s chat template; an example's bad spans are a ``SettingError`` naming it."""
    counts: Counter = Counter()
    for index, example in enumerate(examples):
        where = f"{name} example {index}"
        messages = example.get("messages") if isinstance(example, Mapping) else None
        if not isinstance(messages, list):
            raise SettingError("messages", messages, "a list of chat messages", context=f" in {where}")
        spans = read_private_spans(example, messages, where)
        if not spans:
            continue
        mask = private_token_mask(tokenizer, messages, spans, where)
        ids = rendered_chat_ids(tokenizer, messages)
        counts.update(token for token, private in zip(ids, mask.tolist(), strict=True) if private)
    return counts


def write_span_token_prior(
    jsonl: str | os.PathLike[str],
    tokenizer: Any,
    output: str | os.PathLike[str],
    *,
    weighting: str = "frequency",
) -> Path:
    """Count the private-span tokens of the chat JSONL ``jsonl`` (``span_token_counts``) and write them as the
    token-prior file ``output`` over ``len(tokenizer)`` ids; ``weighting`` as ``noise.token_prior``. Returns
    ``output``'s path. Refused, naming the file, when it marks no private span."""
    path = Path(jsonl)
    lines = path.read_text().splitlines()
    examples = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                examples.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise SettingError("data", str(path), "a JSONL file of chat examples",
                                   why=f": line {number} is not JSON ({error.msg})") from None  # fmt: skip
    counts = span_token_counts(examples, tokenizer, name=str(path))
    if not counts:
        raise SettingError("data", str(path), "a chat JSONL with private spans (the prior counts their tokens)",
                           why=": no example marks a private span")  # fmt: skip
    source = f"private-span tokens of {path.name} ({len(examples)} examples), tokenizer {tokenizer.name_or_path}"
    return write_token_prior(output, counts, vocab_size=len(tokenizer), weighting=weighting, source=source)
