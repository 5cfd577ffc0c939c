"""The token prior of a chat JSONL's private spans (``data.span_token_prior``): what it counts, its file, bad input.

Counted with a real fast tokenizer (``tests.support.chat_sft``'s ChatML BPE) on the shipped ``sentiment`` family's
training rows: every counted token is one ``private_token_mask`` marks, every marked token is counted, tokens of the
instruction and the chat template are not, and the file reads back as the prior ``NoiseConfig.projection_prior``
takes.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import transformers

from nemo_noise_plugin.data.private_spans import private_token_mask, read_private_spans, rendered_chat_ids
from nemo_noise_plugin.data.span_token_prior import span_token_counts, write_span_token_prior
from nemo_noise_plugin.data.tasks.shipped import task_examples
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.validation import SettingError
from tests.support.chat_sft import write_chat_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return transformers.AutoTokenizer.from_pretrained(write_chat_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def rows():
    return task_examples("sentiment", "training")[:40]


def test_the_counts_are_the_marked_tokens_and_only_those(tokenizer, rows):
    counts = span_token_counts(rows, tokenizer)
    marked, unmarked = Counter(), Counter()
    for index, row in enumerate(rows):
        spans = read_private_spans(row, row["messages"], f"row {index}")
        mask = private_token_mask(tokenizer, row["messages"], spans, f"row {index}").tolist()
        for token, private in zip(rendered_chat_ids(tokenizer, row["messages"]), mask, strict=True):
            (marked if private else unmarked)[token] += 1
    assert counts == marked and sum(counts.values()) > 40 * 10
    template = set(tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))
    assert not template & set(counts)  # chat markers are never private
    assert set(unmarked) - set(counts)  # the instruction's own tokens stay out of the prior
    no_spans = [dict(row, private_spans=[]) for row in rows[:3]]
    assert span_token_counts(no_spans, tokenizer) == Counter()


def test_the_written_prior_is_the_one_the_denoiser_reads(tokenizer, rows, tmp_path):
    data = tmp_path / "training.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = write_span_token_prior(data, tokenizer, tmp_path / "prior.json", weighting="support")
    config = NoiseConfig(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=50.0, tokens="spans",
                         projection="posterior_mean", projection_prior=str(path))  # fmt: skip
    from nemo_noise_plugin.noise.token_prior import read_token_prior

    prior = read_token_prior(config.projection_prior)
    assert prior.vocab_size == len(tokenizer) and prior.weighting == "support"
    assert dict(prior.counts) == dict(span_token_counts(rows, tokenizer))
    assert "training.jsonl (40 examples)" in prior.source


def test_bad_data_is_refused_naming_the_file_and_line(tokenizer, rows, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(SettingError, match=r"data='.*chat\.jsonl' is invalid: .*line 2 is not JSON"):
        write_span_token_prior(data, tokenizer, tmp_path / "prior.json")
    data.write_text(json.dumps(dict(rows[0], private_spans=[])) + "\n")
    with pytest.raises(SettingError, match=r"no example marks a private span"):
        write_span_token_prior(data, tokenizer, tmp_path / "prior.json")
    data.write_text(json.dumps(dict(rows[0], private_spans=[{"message": 1, "start": 5, "end": 2}])) + "\n")
    with pytest.raises(SettingError, match=r"chat\.jsonl example 0"):
        write_span_token_prior(data, tokenizer, tmp_path / "prior.json")
    assert not (tmp_path / "prior.json").exists()
