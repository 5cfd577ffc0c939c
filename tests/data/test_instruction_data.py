"""The shipped instruction set: its splits, its answers, and its path through Megatron-Bridge's finetuning data path
(answer-only loss, packing, noise geometry)."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from nemo_noise_plugin.data.instruction_set import (
    INSTRUCTION_SPLITS,
    INSTRUCTION_TASKS,
    LONG_ANSWER_TASKS,
    instruction_dataset_config,
    instruction_examples,
    instruction_files,
    write_instruction_files,
)
from nemo_noise_plugin.jobs.batches import collate
from nemo_noise_plugin.noise.geometry import LocalLayout, NoiseBatchInputs, token_geometry
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401  (the session fixture)

EOS, NEWLINE = 2, 198
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_instruction_data.py"
SIZES = {"training": 4400, "validation": 440, "test": 440}
PER_TASK = {"training": 400, "validation": 40, "test": 40}


def _chats(split):
    return [(e["task"], e["messages"][1]["content"], e["messages"][2]["content"]) for e in instruction_examples(split)]


def _listed(items):
    return ", ".join(str(item) for item in items)


def _items(text):
    return text.split(", ")


_UNITS = {  # (from, to) -> factor, written out again here rather than read from the script
    ("hours", "minutes"): 60,
    ("minutes", "seconds"): 60,
    ("days", "hours"): 24,
    ("weeks", "days"): 7,
    ("kilometres", "metres"): 1000,
    ("metres", "centimetres"): 100,
    ("kilograms", "grams"): 1000,
    ("litres", "millilitres"): 1000,
}
SOLVERS = {  # task -> (the question's pattern, the answer computed from the pattern's groups)
    "add": (r"What is (\d+) \+ (\d+)\?", lambda a, b: str(int(a) + int(b))),
    "subtract": (r"What is (\d+) - (\d+)\?", lambda a, b: str(int(a) - int(b))),
    "convert": (r"How many (\w+) are in (\d+) (\w+)\?", lambda to, n, unit: str(int(n) * _UNITS[unit, to])),
    "count": (r"How many letters are in the word '([a-z]+)'\?", lambda word: str(len(word))),
    "upper": (r"Write the word '([a-z]+)' in capital letters\.", lambda word: word.upper()),
    "first": (r"What is the first letter of the word '([a-z]+)'\?", lambda word: word[:1]),
    "next": (r"What number comes after (\d+)\?", lambda n: str(int(n) + 1)),
    "spell": (r"Spell the word '([a-z]+)' letter by letter\.", lambda word: "-".join(word)),
    "reverse": (r"Reverse the order of these (?:words|numbers): ([a-z0-9, ]+)", lambda x: _listed(_items(x)[::-1])),
    "sort": (r"Sort these numbers from smallest to largest: ([\d, ]+)", lambda x: _listed(sorted(map(int, _items(x))))),
    "range": (r"Count from (\d+) to (\d+)\.", lambda a, b: _listed(range(int(a), int(b) + 1))),
}  # fmt: skip


def test_the_script_writes_the_shipped_files_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], check=True, capture_output=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["test.jsonl", "training.jsonl", "validation.jsonl"]
    for split, shipped in instruction_files().items():
        assert (tmp_path / f"{split}.jsonl").read_bytes() == shipped.read_bytes(), split


def test_the_three_splits_hold_4400_440_and_440_examples_in_well_under_2_mb():
    assert INSTRUCTION_SPLITS == ("training", "validation", "test")
    assert {split: len(instruction_examples(split)) for split in INSTRUCTION_SPLITS} == SIZES
    assert sum(path.stat().st_size for path in instruction_files().values()) < 1_500_000


def test_every_task_has_the_same_share_of_every_split():
    assert len(INSTRUCTION_TASKS) == 11 and set(LONG_ANSWER_TASKS) < set(INSTRUCTION_TASKS)
    for split in INSTRUCTION_SPLITS:
        assert Counter(task for task, _, _ in _chats(split)) == dict.fromkeys(INSTRUCTION_TASKS, PER_TASK[split])


def test_no_question_appears_twice_in_or_across_the_splits():
    questions = {split: [question for _, question, _ in _chats(split)] for split in INSTRUCTION_SPLITS}
    every = [question for split in INSTRUCTION_SPLITS for question in questions[split]]
    assert len(set(every)) == len(every) == sum(SIZES.values())
    assert not set(questions["test"]) & (set(questions["training"]) | set(questions["validation"]))
    assert not set(questions["validation"]) & set(questions["training"])
    pairs = [(question, answer) for split in INSTRUCTION_SPLITS for _, question, answer in _chats(split)]
    assert len(set(pairs)) == len(pairs)


def test_every_example_is_one_system_user_assistant_chat():
    for split in INSTRUCTION_SPLITS:
        for example in instruction_examples(split):
            assert [m["role"] for m in example["messages"]] == ["system", "user", "assistant"]
            assert example["messages"][0]["content"] == "Reply with the exact answer only."


@pytest.mark.parametrize("task", list(INSTRUCTION_TASKS))
def test_every_answer_is_the_one_computed_from_its_question(task):
    pattern, solve = SOLVERS[task]
    checked = 0
    for split in INSTRUCTION_SPLITS:
        for name, question, answer in _chats(split):
            if name == task:
                match = re.fullmatch(pattern, question)
                assert match, question
                assert answer == solve(*match.groups()), (question, answer)
                checked += 1
    assert checked == sum(PER_TASK.values())


def test_long_answer_tasks_answer_tens_of_characters_and_short_ones_one_word():
    lengths = {task: [] for task in INSTRUCTION_TASKS}
    for split in INSTRUCTION_SPLITS:
        for task, _, answer in _chats(split):
            lengths[task].append(len(answer))
    for task in LONG_ANSWER_TASKS:
        assert statistics.mean(lengths[task]) >= 12 and max(lengths[task]) >= 20, task
    assert statistics.mean(n for task in LONG_ANSWER_TASKS for n in lengths[task]) >= 25
    assert max(n for task in INSTRUCTION_TASKS if task not in LONG_ANSWER_TASKS for n in lengths[task]) <= 12


def test_the_copies_for_bridge_include_the_test_split(tmp_path):
    root = Path(write_instruction_files(tmp_path / "data"))
    for split, shipped in instruction_files().items():
        assert (root / f"{split}.jsonl").read_bytes() == shipped.read_bytes()


def test_an_unknown_split_or_a_short_pack_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="split='train' is invalid: expected one of training, validation, test"):
        instruction_examples("train")
    with pytest.raises(ValueError, match="packed_sequence_size=64 is invalid: .* >= seq_length=128"):
        instruction_dataset_config(str(tmp_path), seq_length=128, packed_sequence_size=64)


@pytest.mark.slow
def test_every_chat_fits_the_recipes_128_tokens_with_answers_of_at_most_60(smollm2_hf_dir):  # noqa: F811
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_hf_dir)
    answers, chats = {task: [] for task in INSTRUCTION_TASKS}, []
    for split in INSTRUCTION_SPLITS:
        for example in instruction_examples(split):
            answer = example["messages"][2]["content"]
            answers[example["task"]].append(len(tokenizer.encode(answer, add_special_tokens=False)))
            chats.append(len(tokenizer.apply_chat_template(example["messages"], tokenize=True, return_dict=False)))
    assert max(chats) <= 120
    assert max(n for counts in answers.values() for n in counts) <= 60
    assert min(statistics.mean(answers[task]) for task in LONG_ANSWER_TASKS) >= 10
    assert statistics.mean(n for task in LONG_ANSWER_TASKS for n in answers[task]) >= 20


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
    return builder.build(), Path(root)


@pytest.fixture(scope="module")
def unpacked(smollm2_hf_dir, tmp_path_factory):  # noqa: F811
    return _datasets(tmp_path_factory.mktemp("unpacked"), smollm2_hf_dir)


@pytest.fixture(scope="module")
def packed(smollm2_hf_dir, tmp_path_factory):  # noqa: F811
    return _datasets(tmp_path_factory.mktemp("packed"), smollm2_hf_dir, packed_sequence_size=256)


@pytest.mark.slow
def test_the_recipes_datasets_are_the_training_and_validation_splits_and_no_test(unpacked, packed):
    for (train, valid, test), root in (unpacked, packed):
        assert test is None and len(valid) < len(train)
        assert [path.name for path in root.rglob("*test*")] == ["test.jsonl"]  # no index, no packed file: never read
    (train, valid, _), _ = unpacked
    assert (len(train), len(valid)) == (4400, 440)


@pytest.mark.slow
def test_the_loss_mask_covers_exactly_the_answer_and_its_end_of_turn(unpacked, smollm2_hf_dir):  # noqa: F811
    import transformers

    (_, valid, _), _ = unpacked
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
    (_, valid, _), _ = unpacked
    (_, valid_packed, _), _ = packed
    packed_utils = import_bridge("megatron.bridge.training.utils.packed_seq_utils")
    from_packed = {}
    assert len(valid_packed) < len(valid) // 2  # several sequences a row
    for batch in collate(valid_packed, len(valid_packed), 1, None, "cpu"):
        assert batch["tokens"].shape[0] == 1
        from_packed.update(_geometry_per_sequence(batch, packed_utils.get_packed_seq_params(batch)))
    from_unpacked = {}
    for batch in collate(valid, len(valid) // 8, 8, None, "cpu"):
        from_unpacked.update(_geometry_per_sequence(batch, None))
    assert len(from_unpacked) == 440 and from_packed == from_unpacked
    lengths = sorted(length for length, _ in from_unpacked.values())
    assert lengths[0] < lengths[-1] <= 120  # true lengths, not the padded width; no chat cut at seq_length
    responses = sorted(response for _, response in from_unpacked.values())
    assert responses[0] == 2 and 40 <= responses[-1] <= 61, responses  # a one-token answer to a long one, + end of turn
