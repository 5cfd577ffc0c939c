"""The noise-grid driver's scoring (``benchmarks/noise_grid.py``) on the CPU: a tiny GPT with a tiny chat tokenizer in
place of SmolLM2, everything else real (Bridge's state, tokenizer, dataset provider and finetuning pipeline, the
plugin's noise layer and attacks)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import noise_grid
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from tests.support.attention_variables import clean_attention_variables
from tests.support.chat_sft import tiny_chat_sft_config, write_chat_tokenizer


@pytest.fixture(autouse=True)
def clean_attention_settings():
    with clean_attention_variables():
        yield


@pytest.fixture(scope="module")
def bridge_state(tmp_path_factory, megatron_cpu):
    """Bridge's ``GlobalState`` and a model chunk after the tokenizer and data steps of Bridge's ``setup()``."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    # Megatron pins the attention backend process-wide (NVTE_* variables) when it builds a model: build this one
    # from a clean slate (a module fixture is set up before the function-scoped clean_attention_settings runs)
    with clean_attention_variables():
        root = tmp_path_factory.mktemp("grid")
        tokenizer_dir = write_chat_tokenizer(root / "tokenizer")
        config = tiny_chat_sft_config(root / "run", tokenizer_dir, lr=1e-4, packed_sequence_size=None)
        provider = config.model
        provider.bf16, provider.params_dtype, provider.pipeline_dtype = False, torch.float32, torch.float32
        config.optimizer.bf16 = False
        config.train.micro_batch_size = 8
        state = import_bridge("megatron.bridge.training.state").GlobalState()
        state.cfg = config
        tokenizer = import_bridge("megatron.bridge.training.tokenizers.tokenizer").build_tokenizer(config.tokenizer)
        config.dataset.finalize()
        provider.finalize()
        provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        torch.manual_seed(3)
        (model,) = provider.provide_distributed_model(
            use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
        )
        dataset_provider = import_bridge("megatron.bridge.data.utils").get_dataset_provider(config.dataset)
        dataset_provider([16, 8, 0], config.dataset, tokenizer=tokenizer)
        state._tokenizer = tokenizer
        yield state, model


def test_the_grid_runs_plain_models_first_and_keeps_variants_whole():
    cells = noise_grid.cells_for(["frontier", "neftune"], [1, 2, 3])
    names = [cell.name for cell in cells]
    assert names[:3] == ["plain_s1", "plain_s2", "plain_s3"]
    levels, without_kd = len(noise_grid.FRONTIER_LEVELS), len(noise_grid.WITHOUT_KD_CELLS)
    assert len(cells) == 3 * (1 + 4 + 2 * levels - without_kd)
    assert not any(cell.kd and cell.variant.removesuffix("_kd") in noise_grid.WITHOUT_KD_CELLS for cell in cells)
    assert len(set(names)) == len(names)
    for first in range(0, len(cells), 3):  # every variant's three seeds are consecutive
        assert len({cell.variant for cell in cells[first : first + 3]}) == 1
    kd = [cell for cell in cells if cell.kd]
    assert kd and all(cell.teacher == f"plain_s{cell.seed}" for cell in kd)
    assert cells[0].save and not any(cell.save for cell in cells[3:])


def test_each_seed_gets_its_own_data_order_over_the_same_chats(tmp_path):
    from nemo_noise_plugin.data.instruction_set import write_instruction_files

    orders = {}
    for seed in (1, 2, 1):
        folder = write_instruction_files(tmp_path / f"data{seed}")
        (tmp_path / f"data{seed}" / "training.jsonl.idx.npy").write_bytes(b"stale index")
        noise_grid.shuffle_training_file(folder, seed)
        lines = (tmp_path / f"data{seed}" / "training.jsonl").read_text().splitlines()
        assert not (tmp_path / f"data{seed}" / "training.jsonl.idx.npy").exists()
        orders.setdefault(seed, lines)
        assert lines == orders[seed], "the same seed gives the same order"
    assert orders[1] != orders[2] and sorted(orders[1]) == sorted(orders[2])


def test_rouge_l_copies_and_repetition():
    assert noise_grid.rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert noise_grid.rouge_l([1, 2, 3, 4], [1, 2, 4]) == pytest.approx(2 * 3 / 7)
    training = {10: {tuple(range(10))}}
    assert noise_grid.copies_a_training_answer(list(range(10)), training)
    near = [*range(9), 42, 9]  # one token inserted: LCS 10 of 11 and 10 -> F1 0.952
    assert noise_grid.copies_a_training_answer(near, {10: {tuple(range(10))}})
    assert not noise_grid.copies_a_training_answer([*range(5), 50, 51, 52, 53, 54], training)
    assert noise_grid.repeated_bigram_fraction([1, 2, 1, 2, 1]) == pytest.approx(1 - 2 / 4)
    assert noise_grid.repeated_bigram_fraction([7]) is None


def test_greedy_answers_match_one_prompt_at_a_time_decoding(bridge_state):
    from nemo_noise_plugin.jobs.reports.task_metric import task_batches
    from tests.support.generation import greedy_decode

    state, model = bridge_state
    eos = noise_grid._eos_id(state)
    batches = task_batches(state, "cpu")["validation"]
    prompts = [prompt for prompt, _, _ in noise_grid.prompts_and_answers(batches, eos)][:6]
    assert len({len(p) for p in prompts}) > 1, "the batch must mix prompt lengths (right padding)"
    batched = noise_grid.greedy_answers(model, prompts, eos, max_new_tokens=6, batch_size=4, device="cpu")
    for prompt, answer in zip(prompts, batched, strict=True):
        single = greedy_decode(model, prompt, eos, max_new_tokens=6)
        assert answer == [token for token in single if token != eos]


@pytest.mark.slow  # about a minute on 2 cores: every score, three attacks at two levels
def test_evaluate_cell_scores_clean_noised_and_attacked(bridge_state, monkeypatch):
    monkeypatch.setattr(noise_grid, "ATTACK_CHATS", 6)  # the CPU: a few chats, short answers
    monkeypatch.setattr(noise_grid, "MAX_NEW_TOKENS", 8)
    state, model = bridge_state
    cell = noise_grid.Cell("plain", 1, neftune_scores=True, frontier_levels=("gm_eps100", "mdp_eta30"))
    result = noise_grid.evaluate_cell(model, state, cell)
    for split in ("validation", "test"):
        clean = result["clean"][split]
        assert 0.0 <= clean["exact_match"] <= 1.0 and clean["loss"] > 0 and clean["examples"] > 0
    assert result["train_clean"]["loss"] > 0
    answers = result["answers_test"]
    assert answers["answers"] == result["clean"]["test"]["examples"]
    assert set(answers["per_task"]) <= {t for t in result["clean"]["test"]["per_task"]}
    for level in ("gm_eps100", "mdp_eta30"):
        frontier = result["frontier"][level]
        attacks = frontier["attacks"]
        assert attacks["noised_tokens"] > 0 and attacks["distinct_ids"] > 1
        for name in ("nn_l2", "nn_cosine", "lm_beam"):
            low, high = attacks[name]["interval"]
            assert low <= attacks[name]["recovery"] <= high
        noised = frontier["noised"]["test"]
        # a random tiny model under heavy noise: the loss moves (the noise is on at inference)
        assert noised["loss"] != pytest.approx(result["clean"]["test"]["loss"], rel=1e-6)
        assert frontier["privacy"]["eps_per_token"] > 0 and frontier["privacy"]["eps_per_sequence"] > 0
    assert result["frontier"]["gm_eps100"]["privacy"]["eps_per_token"] == pytest.approx(100.0)
    assert result["frontier"]["mdp_eta30"]["privacy"]["eps_per_token"] == pytest.approx(30 * 2 * noise_grid.CLIP_NORM)


def test_noise_at_inference_leaves_template_and_special_tokens_clean(bridge_state, monkeypatch):
    """The attack counts only tokens that received noise: the chat markers (special ids) are never noised."""
    monkeypatch.setattr(noise_grid, "ATTACK_CHATS", 6)
    state, model = bridge_state
    from nemo_noise_plugin.jobs.batches import recipe_tokenizer
    from nemo_noise_plugin.jobs.reports.task_metric import task_batches

    eos = noise_grid._eos_id(state)
    special = noise_grid.special_ids(recipe_tokenizer(state))
    assert eos in special
    batches = task_batches(state, "cpu")["test"]
    noise = noise_grid.level_config("gm_eps20", inference=True)
    report = noise_grid.attack_level(model, batches, noise, special, eos)
    prompts = [p for p, _, _ in noise_grid.prompts_and_answers(batches, eos)][: report["chats"]]
    ordinary = sum(1 for prompt in prompts for token in prompt if token not in special)
    assert report["noised_tokens"] == ordinary
