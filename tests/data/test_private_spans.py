"""Private spans through Bridge's chat SFT data path: JSONL offsets -> token positions -> ``private_mask``; bad span
data is a clear error naming the example and the span, raised when the dataset is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_noise_plugin.data.private_spans import PrivateSpan, private_token_mask, read_private_spans
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import SettingError
from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401  (the session fixture)

SYSTEM = {"role": "system", "content": "You are a bank clerk."}
ACCOUNT = {
    "messages": [
        SYSTEM,
        {"role": "user", "content": "My account is 4921-0031. What is the fee for a transfer?"},
        {"role": "assistant", "content": "2 EUR"},
    ],
    "private_spans": [{"message": 1, "start": 14, "end": 23}],  # "4921-0031"
}
NAME_AND_ADDRESS = {
    "messages": [
        SYSTEM,
        {"role": "user", "content": "I am Ada Lovelace of 12 Baker Street. Hi!"},
        {"role": "assistant", "content": "Hello"},
    ],
    "private_spans": [{"message": 1, "start": 21, "end": 36}, {"message": 1, "start": 5, "end": 17}],
}
NO_SPANS = {
    "messages": [SYSTEM, {"role": "user", "content": "No secrets here."}, {"role": "assistant", "content": "Ok"}]
}


def _write(root: Path, examples: list[dict], splits=("training", "validation")) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for split in splits:
        (root / f"{split}.jsonl").write_text("".join(json.dumps(example) + "\n" for example in examples))
    return root


def _bridge_tokenizer(hf_dir: Path):
    config = import_bridge("megatron.bridge.training.tokenizers.config").TokenizerConfig(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf_dir)
    )
    return import_bridge("megatron.bridge.training.tokenizers.tokenizer").build_tokenizer(config)


def _datasets(root: Path, tokenizer):
    """The splits exactly as Bridge's loop builds them: its provider registry, looked up by the config's type."""
    from nemo_noise_plugin.data.span_dataset import PrivateSpanSFTDatasetConfig

    config = PrivateSpanSFTDatasetConfig(
        seq_length=64, dataset_root=str(root), do_test=False, dataloader_type="single", num_workers=0
    )
    provider = import_bridge("megatron.bridge.data.utils").get_dataset_provider(config)
    return provider([0, 0, 0], config, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_hf_dir):  # noqa: F811
    return _bridge_tokenizer(smollm2_hf_dir)


@pytest.fixture(scope="module")
def span_batch(smollm2_tokenizer, tmp_path_factory):
    train, valid, test = _datasets(
        _write(tmp_path_factory.mktemp("spans"), [ACCOUNT, NAME_AND_ADDRESS, NO_SPANS]), smollm2_tokenizer
    )
    assert test is None and len(train) == len(valid) == 3
    return train.collate_fn([train[index] for index in range(3)])


def test_the_batch_marks_exactly_the_tokens_of_each_span(span_batch, smollm2_hf_dir):  # noqa: F811
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_hf_dir)
    marked = [span_batch["private_mask"][row].nonzero().view(-1).tolist() for row in range(3)]
    assert marked == [list(range(18, 27)), [16, 17, 18, 19, 22, 23, 24, 25], []]
    pieces = [[tokenizer.decode([t]) for t in span_batch["tokens"][row][marked[row]].tolist()] for row in range(2)]
    assert pieces[0] == ["4", "9", "2", "1", "-", "0", "0", "3", "1"]  # SmolLM2 splits digits
    assert pieces[1] == [" Ada", " Lo", "vel", "ace", "1", "2", " Baker", " Street"]  # whole tokens: " Ada"
    assert span_batch["private_mask"].dtype == torch.bool
    assert span_batch["private_mask"].shape == span_batch["tokens"].shape


def test_no_private_token_is_a_chat_marker_system_or_answer_token(span_batch):
    private = span_batch["private_mask"]
    assert not (private & (span_batch["loss_mask"] != 0)).any()  # the loss (answer) positions stay clean
    assert not torch.isin(span_batch["tokens"][private], torch.tensor([0, 1, 2])).any()  # no <|im_start|> etc.


def test_the_private_mask_follows_tokens_through_truncation(smollm2_tokenizer, tmp_path):
    """A span past ``seq_length`` is cut with the tokens: the mask is as wide as ``tokens``, never longer."""
    long_user = "x " * 60 + "my PIN is 1234."
    example = {
        "messages": [SYSTEM, {"role": "user", "content": long_user}, {"role": "assistant", "content": "ok"}],
        "private_spans": [
            {"message": 1, "start": 0, "end": 4},
            {"message": 1, "start": len(long_user) - 5, "end": len(long_user) - 1},
        ],
    }
    train, _, _ = _datasets(_write(tmp_path, [example]), smollm2_tokenizer)
    batch = train.collate_fn([train[0]])
    assert batch["private_mask"].shape == batch["tokens"].shape == (1, 64)
    item = train[0]
    full = item["private_mask"][:-1]
    assert full.numel() > 64 and bool(full[64:].any())  # the PIN's tokens lie past the cut
    assert torch.equal(batch["private_mask"][0], full[:64]) and bool(full[:64].any())


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ([{"message": 1, "start": 3, "end": 99}], r"offsets out of range of the message"),
        ([{"message": 1, "start": -1, "end": 4}], r"0 <= start < end <= 56"),
        ([{"message": 1, "start": 7, "end": 7}], r"a non-empty span, start < end"),
        ([{"message": 1, "start": 2, "end": 9}, {"message": 1, "start": 8, "end": 12}], r"do not overlap"),
        ([{"message": 0, "start": 0, "end": 3}], r"message 0 is the 'system' message"),
        ([{"message": 2, "start": 0, "end": 1}], r"message 2 is the 'assistant' message"),
        ([{"message": 5, "start": 0, "end": 1}], r"a message index in \[0, 3\) \(unknown message\)"),
        ([{"message": 1, "start": 0}], r"\{'message': i, 'start': a, 'end': b\}"),
        ([{"message": 1, "start": 0.5, "end": 3}], r"integers"),
        ({"message": 1, "start": 0, "end": 3}, r"private_spans=.* a list of"),
    ],
)
def test_bad_span_data_is_a_clear_error_naming_the_example_and_the_span(spans, message):
    example = {**ACCOUNT, "private_spans": spans}
    with pytest.raises(SettingError, match=message) as raised:
        read_private_spans(example, example["messages"], "training.jsonl line 4 (example 3)")
    assert "in training.jsonl line 4 (example 3)" in str(raised.value)
    assert str(raised.value).startswith("private_spans")


def test_overlapping_spans_name_both_spans():
    example = {
        **ACCOUNT,
        "private_spans": [{"message": 1, "start": 8, "end": 12}, {"message": 1, "start": 2, "end": 9}],
    }
    with pytest.raises(SettingError) as raised:
        read_private_spans(example, example["messages"], "x.jsonl line 1 (example 0)")
    assert str(raised.value).startswith("private_spans[0]={'message': 1, 'start': 8, 'end': 12} is invalid")
    assert "private_spans[1] = {'message': 1, 'start': 2, 'end': 9} ends at 9" in str(raised.value)


def test_spans_of_different_messages_may_share_offsets():
    messages = [SYSTEM, {"role": "user", "content": "abcdef"}, {"role": "assistant", "content": "x"}]
    messages.insert(2, {"role": "user", "content": "ghijkl"})
    example = {
        "messages": messages,
        "private_spans": [{"message": 2, "start": 0, "end": 3}, {"message": 1, "start": 0, "end": 3}],
    }
    assert read_private_spans(example, messages, "x") == (PrivateSpan(1, 0, 3), PrivateSpan(2, 0, 3))


def _merging_tokenizer():
    """A real fast tokenizer whose vocabulary merges the last content letter with the template's closing ']'."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {char: index for index, char in enumerate(sorted(set("[]:usersystemassistant namehixyz")))}
    vocab["e]"], vocab["<eos>"] = len(vocab), len(vocab) + 1
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[("e", "]")])), eos_token="<eos>", pad_token="<eos>"
    )
    fast.chat_template = "{% for m in messages %}{{ '[' + m['role'] + ':' + m['content'] + ']' }}{% endfor %}"
    return fast


def test_a_span_whose_token_reaches_a_chat_marker_is_an_error():
    tokenizer = _merging_tokenizer()
    messages = [{"role": "user", "content": "hi name"}, {"role": "assistant", "content": "hi"}]
    inside = private_token_mask(tokenizer, messages, [PrivateSpan(0, 3, 5)], "x")
    assert inside.nonzero().view(-1).tolist() == [9, 10]  # "n", "a"
    with pytest.raises(SettingError, match=r"token 12 \('e\]'\) reaches a chat marker") as raised:
        private_token_mask(tokenizer, messages, [PrivateSpan(0, 3, 7)], "chat.jsonl line 2 (example 1)")
    assert "in chat.jsonl line 2 (example 1)" in str(raised.value)


def test_bad_span_data_fails_when_the_dataset_is_read_naming_file_and_line(smollm2_tokenizer, tmp_path):
    bad = {**NAME_AND_ADDRESS, "private_spans": [{"message": 0, "start": 0, "end": 3}]}
    root = _write(tmp_path, [ACCOUNT, NO_SPANS, bad])
    with pytest.raises(SettingError, match=r"message 0 is the 'system' message") as raised:
        _datasets(root, smollm2_tokenizer)
    assert f"in {root / 'training.jsonl'} line 3 (example 2)" in str(raised.value)


def test_spans_with_offline_packing_are_refused(tmp_path):
    from nemo_noise_plugin.data.span_dataset import PrivateSpanSFTDatasetConfig

    packing = import_bridge("megatron.bridge.data.packing.config").PackedSequenceSpecs(packed_sequence_size=128)
    config = PrivateSpanSFTDatasetConfig(
        seq_length=64, dataset_root=str(tmp_path), enable_offline_packing=True, offline_packing_specs=packing
    )
    with pytest.raises(SettingError, match=r"PrivateSpanSFTDatasetConfig.enable_offline_packing=True is invalid"):
        config.validate()
