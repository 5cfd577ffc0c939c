"""The shipped instruction set through Megatron-Bridge's finetuning path: answer-only loss, packing, noise geometry."""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.batches import collate
from nemo_noise_plugin.bridge_imports import import_bridge
from nemo_noise_plugin.instructions import (
    instruction_dataset_config,
    instruction_examples,
    write_instruction_files,
)
from nemo_noise_plugin.noise.geometry import LocalLayout, NoiseBatchInputs, token_geometry
from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401  (the session fixture)

EOS, NEWLINE = 2, 198


def test_the_held_out_split_shares_no_question_with_the_training_split():
    training, held_out = instruction_examples("training"), instruction_examples("validation")
    assert (len(training), len(held_out)) == (320, 80)
    questions = {example["messages"][1]["content"] for example in training}
    assert not questions & {example["messages"][1]["content"] for example in held_out}
    assert {example["task"] for example in held_out} == {
        "add", "subtract", "convert", "count", "upper", "first", "next"
    }  # fmt: skip


def test_every_answer_is_exact_for_its_question():
    for example in instruction_examples("training") + instruction_examples("validation"):
        question, answer = example["messages"][1]["content"], example["messages"][2]["content"]
        if example["task"] in ("add", "subtract"):
            assert str(eval(question.removeprefix("What is ").removesuffix("?"))) == answer  # noqa: S307
        elif example["task"] == "upper":
            assert question.split("'")[1].upper() == answer


def test_an_unknown_split_or_a_short_pack_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="split='test' is invalid: expected one of training, validation"):
        instruction_examples("test")
    with pytest.raises(ValueError, match="packed_sequence_size=64 is invalid: .* >= seq_length=128"):
        instruction_dataset_config(str(tmp_path), seq_length=128, packed_sequence_size=64)


def _datasets(root, hf_dir, packed_sequence_size=None):
    tokenizer_config = import_bridge("megatron.bridge.training.tokenizers.config").TokenizerConfig(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf_dir)
    )
    tokenizer = import_bridge("megatron.bridge.training.tokenizers.tokenizer").build_tokenizer(tokenizer_config)
    config = instruction_dataset_config(
        write_instruction_files(root), seq_length=128, packed_sequence_size=packed_sequence_size
    )
    builder = import_bridge("megatron.bridge.data.builders.gpt_sft").GPTSFTDatasetBuilder(config, tokenizer)
    builder.prepare_data()
    return builder.build()[:2], tokenizer


@pytest.fixture(scope="module")
def unpacked(smollm2_hf_dir, tmp_path_factory):  # noqa: F811
    return _datasets(tmp_path_factory.mktemp("unpacked"), smollm2_hf_dir)


@pytest.fixture(scope="module")
def packed(smollm2_hf_dir, tmp_path_factory):  # noqa: F811
    return _datasets(tmp_path_factory.mktemp("packed"), smollm2_hf_dir, packed_sequence_size=256)


@pytest.mark.slow
def test_the_loss_mask_covers_exactly_the_answer_and_its_end_of_turn(unpacked, smollm2_hf_dir):  # noqa: F811
    import transformers

    (_, valid), _ = unpacked
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_hf_dir)
    batch = collate(valid, 1, 8, None, "cpu")[0]
    for row, example in enumerate(instruction_examples("validation")[:8]):
        targets = batch["labels"][row][batch["loss_mask"][row].bool()].tolist()
        answer = hf_tokenizer.encode(example["messages"][2]["content"], add_special_tokens=False)
        assert targets == answer + [EOS, NEWLINE], (targets, answer)
        prompt = hf_tokenizer.decode(batch["tokens"][row][: int(batch["loss_mask"][row].nonzero()[0]) + 1])
        assert prompt.endswith(example["messages"][1]["content"] + "<|im_end|>\n<|im_start|>assistant\n")


def _geometry_per_sequence(batch, packed_params):
    """What the noise layer sees per sequence: {token ids: (true length, response-token count)}."""
    tokens = batch["tokens"]
    inputs = NoiseBatchInputs(loss_mask=batch["loss_mask"], packed_seq_params=packed_params)
    rows, size = tokens.shape[1], tokens.shape[0]
    geometry = token_geometry(
        rows, size, inputs, LocalLayout(), None, need_lengths=True, need_response=True, device=tokens.device
    )
    response = geometry.response & geometry.valid  # the response tokens the noise layer would select
    seen = {}
    if packed_params is None:
        for column in range(size):
            length = int(geometry.lengths[0, column])
            key = tuple(tokens[column, :length].tolist())
            seen[key] = (length, int(response[:, column].sum()))
        return seen
    cu = packed_params.cu_seqlens_q.tolist()
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        key = tuple(tokens[0, start:end].tolist())
        if not key or set(key) == {EOS}:  # the row's padding after its last sequence (or an empty boundary)
            continue
        lengths = geometry.lengths[start:end, 0]
        assert torch.all(lengths == lengths[0])
        seen[key] = (int(lengths[0]), int(response[start:end, 0].sum()))
    return seen


@pytest.mark.slow
def test_packed_and_unpacked_batches_give_the_noise_the_same_lengths_and_response_tokens(unpacked, packed):
    (_, valid), _ = unpacked
    (_, valid_packed), _ = packed
    packed_utils = import_bridge("megatron.bridge.training.utils.packed_seq_utils")
    from_packed = {}
    for batch in collate(valid_packed, len(valid_packed), 1, None, "cpu"):
        assert batch["tokens"].shape[0] == 1 and len(batch["cu_seqlens_q"].flatten()) > 3  # several sequences a row
        from_packed.update(_geometry_per_sequence(batch, packed_utils.get_packed_seq_params(batch)))
    from_unpacked = {}
    for batch in collate(valid, len(valid) // 8, 8, None, "cpu"):
        from_unpacked.update(_geometry_per_sequence(batch, None))
    assert len(from_unpacked) == 80 and from_packed == from_unpacked
    lengths = sorted(length for length, _ in from_unpacked.values())
    assert lengths[0] < lengths[-1]  # true lengths, not the padded width
    assert all(2 <= response <= 8 for _, response in from_unpacked.values())
