"""Private spans of chat examples: their JSONL format, their checks, and the tokens they cover (``tokens='spans'``).

An SFT chat example (``{"messages": [...]}``, one JSON object a line) marks the text that ``NoiseConfig.tokens=
'spans'`` noises in a top-level ``private_spans`` list::

    {"messages": [{"role": "system", "content": "You are a bank clerk."},
                  {"role": "user", "content": "My account is 4921-0031. What is the fee for a transfer?"},
                  {"role": "assistant", "content": "2 EUR"}],
     "private_spans": [{"message": 1, "start": 14, "end": 23}]}

``message`` indexes ``messages``; ``start`` and ``end`` are character offsets into that message's ``content``, end
exclusive (``content[start:end]`` is the private text, here ``"4921-0031"``). Spans may sit in user messages only:
the system prompt, the chat markers and the answer stay clean. Spans of one message may not overlap or be empty.

``read_private_spans`` checks an example's spans against its messages (no tokenizer needed);
``private_token_mask`` maps them to the tokens of the rendered chat template through a fast HF tokenizer's offsets
(``return_offsets_mapping``): a token is private when its characters overlap a span, and every private token must
lie inside its message's content (a token that merges span text with a chat marker is an error). Errors are
``SettingError``s naming the example (file, line, index) and the span. Used by ``data.span_dataset``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nemo_noise_plugin.validation import SettingError

__all__ = [
    "PRIVATE_SPANS_FIELD",
    "SPAN_ROLES",
    "PrivateSpan",
    "private_token_mask",
    "read_private_spans",
    "rendered_chat_ids",
]

PRIVATE_SPANS_FIELD = "private_spans"
"""The top-level JSONL field holding an example's private spans."""
SPAN_ROLES: tuple[str, ...] = ("user",)
"""The message roles a private span may sit in (system prompts and answers stay clean)."""
_SPAN_FORMAT = "{'message': i, 'start': a, 'end': b} (character offsets into messages[i]['content'], end exclusive)"
_SENTINEL = "\u2063private-span-sentinel\u2063"


@dataclass(frozen=True)
class PrivateSpan:
    """One private span: characters ``[start, end)`` of message ``message``'s content."""

    message: int
    start: int
    end: int


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_private_spans(example: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], where: str):
    """The checked ``PrivateSpan``s of ``example`` (empty without a ``private_spans`` field), in message order.

    Args:
        example: the JSONL example (its ``private_spans`` field is read).
        messages: its chat messages (``role``, ``content``), as the chat template receives them.
        where: the example's name in errors, e.g. ``"training.jsonl line 3 (example 2)"``.

    Raises:
        SettingError: naming ``where`` and the span, for a span that is not of the format, names an unknown
            message, sits in a message whose role is not in ``SPAN_ROLES``, is empty, runs past its message's
            content, or overlaps another span.
    """
    raw = example.get(PRIVATE_SPANS_FIELD)
    if raw is None:
        return ()
    context = f" in {where}"
    if not isinstance(raw, list):
        raise SettingError(PRIVATE_SPANS_FIELD, raw, f"a list of {_SPAN_FORMAT}", context=context)
    spans = []
    for index, item in enumerate(raw):
        name = f"{PRIVATE_SPANS_FIELD}[{index}]"
        if not isinstance(item, Mapping) or set(item) != {"message", "start", "end"}:
            raise SettingError(name, item, _SPAN_FORMAT, context=context)
        message, start, end = item["message"], item["start"], item["end"]
        if not all(_is_int(value) for value in (message, start, end)):
            raise SettingError(name, dict(item), f"integers: {_SPAN_FORMAT}", context=context)
        if not 0 <= message < len(messages):
            raise SettingError(
                name, dict(item), f"a message index in [0, {len(messages)})", context=context, why=" (unknown message)"
            )
        role = messages[message].get("role")
        if role not in SPAN_ROLES:
            raise SettingError(
                name,
                dict(item),
                f"a span in a message of role {' or '.join(SPAN_ROLES)}",
                context=context,
                why=f" (message {message} is the {role!r} message: the system prompt, the chat markers and the "
                "answer stay clean)",
            )
        content = messages[message].get("content")
        length = len(content) if isinstance(content, str) else 0
        if start >= end:
            raise SettingError(
                name,
                dict(item),
                "a non-empty span, start < end",
                context=context,
                why=" (an empty span noises nothing)",
            )
        if start < 0 or end > length:
            raise SettingError(
                name,
                dict(item),
                f"0 <= start < end <= {length}, the length of message {message}'s content",
                context=context,
                why=" (offsets out of range of the message)",
            )
        spans.append((PrivateSpan(message, start, end), index))
    spans.sort(key=lambda pair: (pair[0].message, pair[0].start))
    for (before, first), (after, second) in zip(spans, spans[1:], strict=False):
        if before.message == after.message and after.start < before.end:
            raise SettingError(
                f"{PRIVATE_SPANS_FIELD}[{second}]",
                vars(after),
                f"spans that do not overlap: private_spans[{first}] = {vars(before)} ends at {before.end}",
                context=context,
            )
    return tuple(span for span, _ in spans)


def _content_offset(tokenizer: Any, messages: Sequence[Mapping[str, Any]], index: int, rendered: str, where: str):
    """Character position of message ``index``'s content in ``rendered`` (the template rendered with a sentinel in
    its place, so a content that also occurs in a chat marker or an earlier message is found where it is)."""
    probe = [dict(message) for message in messages]
    probe[index]["content"] = _SENTINEL
    position = _render(tokenizer, probe).find(_SENTINEL)
    content = messages[index]["content"]
    if position < 0 or rendered[position : position + len(content)] != content:
        raise SettingError(
            f"messages[{index}]",
            content,
            "a content that the chat template renders verbatim (private spans are offsets into it)",
            context=f" in {where}",
        )
    return position


def rendered_chat_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
    """The token ids of ``messages`` rendered by the chat template, as ``private_token_mask``'s mask indexes them."""
    return list(_encode(tokenizer, _render(tokenizer, messages, **template_kwargs))["input_ids"])


def _encode(tokenizer: Any, rendered: str) -> Any:
    return tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=False, **template_kwargs)


def private_token_mask(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    spans: Sequence[PrivateSpan],
    where: str,
    *,
    input_ids: Sequence[int] | None = None,
    **template_kwargs: Any,
) -> torch.Tensor:
    """``[n]`` bool mask over the tokens of the rendered chat template: True for tokens inside a private span.

    Args:
        tokenizer: a fast Hugging Face tokenizer with a chat template (``return_offsets_mapping``).
        messages: the example's chat messages.
        spans: its checked spans (``read_private_spans``).
        where: the example's name in errors.
        input_ids: the tokens the training data path made of the example; the mask must describe exactly these.
        **template_kwargs: extra chat-template arguments (``tools``), as the data path passes them.

    Raises:
        SettingError: when the rendered template's tokens differ from ``input_ids``, a message's content is not
            rendered verbatim, or a span's tokens reach outside its message's content (a chat marker).
    """
    rendered = _render(tokenizer, messages, **template_kwargs)
    encoded = _encode(tokenizer, rendered)
    ids, offsets = list(encoded["input_ids"]), [tuple(pair) for pair in encoded["offset_mapping"]]
    if input_ids is not None and [int(token) for token in input_ids] != ids:
        raise SettingError(
            "tokenizer",
            type(tokenizer).__name__,
            "a tokenizer whose encoding of the rendered chat template equals the data path's tokens (so character "
            "offsets map to them)",
            context=f" for the private spans of {where}",
        )
    mask = torch.zeros(len(ids), dtype=torch.bool)
    starts: dict[int, int] = {}
    for span in spans:
        if span.message not in starts:
            starts[span.message] = _content_offset(tokenizer, messages, span.message, rendered, where)
        first = starts[span.message]
        content_end = first + len(messages[span.message]["content"])
        low, high = first + span.start, first + span.end
        covered = [
            token for token, (begin, finish) in enumerate(offsets) if finish > begin and begin < high and finish > low
        ]
        for token in covered:
            begin, finish = offsets[token]
            if begin < first or finish > content_end:
                raise SettingError(
                    "private span",
                    vars(span),
                    f"a span whose tokens lie inside message {span.message}'s content: token {token} "
                    f"({rendered[begin:finish]!r}) reaches a chat marker",
                    context=f" in {where}",
                )
        mask[covered] = True
    return mask
