"""CPU smoke test of ``benchmarks/sft_throughput.py``: a tiny Llama, 2 steps of each runner, one JSON per runner.

The plugin runs its CPU flavour (its provider and forward step; Bridge's loop needs CUDA), the plain loop and, when
trl is installed, TRL's SFTTrainer. All start from the same HF weights and see the same first batch, so their first
losses agree (one micro-batch per step makes Megatron's per-microbatch mean and TRL's global mean the same).
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import sft_throughput
from tests.support.chat_sft import VOCAB_SIZE, write_chat_tokenizer


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=VOCAB_SIZE, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    write_chat_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def results(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_out")
    arguments = ["--model", "tiny", "--hf-path", str(tiny_llama_dir), "--device", "cpu", "--out", str(out)]
    arguments += ["--global-batch", "2", "--micro-batch", "2", "--steps", "2", "--repeats", "1", "--discard", "0"]
    return sft_throughput.main(arguments), out


def test_every_runner_writes_its_json_with_two_losses_per_slot(results):
    found, out = results
    expected = {"plugin_off", "plugin_off_again", "plugin_on", "plugin_off_sdpa", "plugin_on_sdpa", "plain"}
    assert expected <= set(found)
    for name in found:
        saved = json.loads((out / f"{name}.json").read_text())
        assert len(saved["step_seconds_per_repeat"]) == 1 and len(saved["step_seconds_per_repeat"][0]) == 2
        assert saved["tokens_per_s"] > saved["answer_tokens_per_s"] > 0
    assert len(found["plugin_off"]["losses"]) == 4  # its own slot and the A/A control's
    assert len(found["plain"]["losses"]) == 2
    assert (out / "summary.md").read_text().count("| `") == len(found)


def test_plugin_and_plain_start_from_the_same_loss(results):
    found, _ = results
    first = found["plain"]["losses"][0]
    assert math.isfinite(first) and first > 1.0
    assert found["plugin_off"]["losses"][0] == pytest.approx(first, rel=1e-4)
    assert found["plugin_on"]["losses"][0] != pytest.approx(first, rel=1e-6)  # NEFTune noise changes the forward


def test_the_sdpa_runners_train_as_the_unfused_ones(results):
    """The SDPA core attention changes how attention is computed, not what: the same losses at every step."""
    found, _ = results
    assert (
        found["plugin_on_sdpa"]["core_attention"]
        == found["plugin_off_sdpa"]["core_attention"]
        == ["SDPADotProductAttention"]
    )
    assert found["plugin_on"]["core_attention"] == ["DotProductAttention"]
    assert found["plain"]["core_attention"] == []
    # The recipe's embedding is the lookup alone (TP 1, no dropout): the noise goes in where the rows are looked up.
    assert found["plugin_on"]["noise_in_lookup"] == found["plugin_on_sdpa"]["noise_in_lookup"] == "lookup"
    assert found["plugin_off"]["noise_in_lookup"] is None and found["plain"]["noise_in_lookup"] is None
    assert found["plugin_off_sdpa"]["losses"] == pytest.approx(found["plugin_off"]["losses"][:2], rel=1e-4)
    assert found["plugin_on_sdpa"]["losses"] == pytest.approx(found["plugin_on"]["losses"], rel=1e-4)
    assert found["plugin_on_sdpa"]["losses"][0] != pytest.approx(found["plugin_off_sdpa"]["losses"][0], rel=1e-6)


def test_trl_starts_from_the_plain_loss(results):
    pytest.importorskip("trl")
    found, _ = results
    first = found["plain"]["losses"][0]
    assert found["trl_off"]["losses"][0] == pytest.approx(first, rel=2e-2)  # its last target per row is unscored
    assert found["trl_on"]["losses"][0] != pytest.approx(found["trl_off"]["losses"][0], rel=1e-6)


def test_the_llama_path_starts_plugin_and_plain_from_the_same_random_weights(tiny_llama_dir, tmp_path, monkeypatch):
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    dims |= dict(intermediate_size=128, vocab_size=512, max_position_embeddings=128, tie_word_embeddings=True)
    monkeypatch.setattr(sft_throughput, "LLAMA_1B", dims)
    arguments = ["--model", "llama-1b", "--hf-path", str(tiny_llama_dir), "--device", "cpu", "--out", str(tmp_path)]
    arguments += ["--seq", "32", "--global-batch", "4", "--micro-batch", "2", "--steps", "2", "--repeats", "1"]
    found = sft_throughput.main([*arguments, "--discard", "0", "--warm", "0", "--runners", "plain", "--profile", "1"])
    assert set(found) == {"plugin_off", "plugin_off_again", "plain"}
    assert found["plain"]["tokens_per_step"] == [4 * 32, 4 * 32]  # random tokens: every position scored
    assert found["plain"]["answer_tokens_per_step"] == found["plain"]["tokens_per_step"]
    assert found["plugin_off"]["losses"][:2] == pytest.approx(found["plain"]["losses"], rel=1e-4)
    assert found["plain"]["losses"][0] == pytest.approx(math.log(512), rel=0.05)  # random init: ~ln(vocab)
    profiled = json.loads((tmp_path / "profile.json").read_text())  # --profile 1: one more step of each, profiled
    assert set(profiled) == {"plugin_off", "plain"}
    for name, summary in profiled.items():
        assert summary["steps"] == 1 and summary["wall_ms_per_step"] > 0
        assert summary["kernel_launches_per_step"] == 0  # no CUDA on the CPU
        assert "top operators by host time" in (tmp_path / f"profile_{name}.txt").read_text()
    assert len(json.loads((tmp_path / "plain.json").read_text())["losses"]) == 2  # written before the profile


def test_another_baseline_takes_the_ratios_and_the_aa_control_without_the_plain_runner(tiny_llama_dir, tmp_path):
    """``--baseline plugin_off_sdpa``: the ratios against it, its second slot the A/A control, no plain runner needed
    (what fits two 1B-sized runners on one 80 GB card)."""
    arguments = ["--model", "tiny", "--hf-path", str(tiny_llama_dir), "--device", "cpu", "--out", str(tmp_path)]
    arguments += ["--global-batch", "2", "--micro-batch", "2", "--steps", "2", "--repeats", "1", "--discard", "0"]
    found = sft_throughput.main([*arguments, "--baseline", "plugin_off_sdpa", "--runners", "plugin_on_sdpa"])
    assert set(found) == {"plugin_off_sdpa", "plugin_off_sdpa_again", "plugin_on_sdpa"}
    assert found["plugin_on_sdpa"]["baseline"] == "plugin_off_sdpa"
    assert found["plugin_off_sdpa"]["tokens_per_step"] == found["plugin_on_sdpa"]["tokens_per_step"]
    assert len(found["plugin_on_sdpa"]["tokens_per_step"]) == 2
    assert "| vs plugin_off_sdpa |" in (tmp_path / "summary.md").read_text()


def test_a_graph_baseline_off_the_gpu_is_refused_naming_the_setting(capsys, tmp_path):
    """``--baseline plugin_off_graph`` (the noise-off graph runner, the noise's cost under the graph with its own A/A
    control) needs CUDA: on the CPU it is refused before anything is built, naming the flag, value and device."""
    with pytest.raises(SystemExit) as stopped:
        sft_throughput.main(["--out", str(tmp_path), "--device", "cpu", "--baseline", "plugin_off_graph"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "--baseline plugin_off_graph" in error and "--device cuda" in error and "(got cpu)" in error
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("runners", "expected"),
    [
        ("plain,plugin_on_graph", "--runners plain,plugin_on_graph: plugin_on_graph need --device cuda (got cpu)"),
        ("plain,trl_of", "--runners plain,trl_of: unknown trl_of; expected some of plugin_off, plugin_on"),
    ],
)
def test_a_graph_or_unknown_runner_named_off_the_gpu_is_refused_not_dropped(capsys, tmp_path, runners, expected):
    """A runner named in ``--runners`` that cannot run (a CUDA-graph runner on the CPU, a misspelt name) is refused
    before anything is built; before, it was left out of the table without a word."""
    with pytest.raises(SystemExit) as stopped:
        sft_throughput.main(["--out", str(tmp_path), "--device", "cpu", "--runners", runners])
    assert stopped.value.code == 2
    assert expected in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_step_graphs_fixed_width_batches_train_as_the_per_batch_padded_ones(tiny_llama_dir):
    """The graph runner's micro-batches (``pad_to_max_length``, every row ``seq`` wide) are the same samples with more
    masked padding: the noisy model's losses are those of the per-batch padded ones (causal attention; the noise's
    NEFTune length comes from the loss mask), so its tokens/s counts the same tokens."""
    from benchmarks.sft_runners import Batches, PluginCpuRunner
    from nemo_noise_plugin.training.forward_step import noise_forward_step

    settings = dict(sft_throughput.PRESETS["tiny"], global_batch=2, micro_batch=2, seq=192)
    padded = sft_throughput.instruction_batches(str(tiny_llama_dir), settings, 2)
    fixed = sft_throughput.instruction_batches(str(tiny_llama_dir), settings, 2, fixed_width=True)
    assert {batch["tokens"].shape[-1] for batch in fixed} == {settings["seq"]}
    assert max(batch["tokens"].shape[-1] for batch in padded) < settings["seq"]
    for short, wide in zip(padded, fixed, strict=True):
        width = short["tokens"].shape[-1]
        assert wide["tokens"][:, :width].equal(short["tokens"]) and int(wide["loss_mask"][:, width:].sum()) == 0
        assert wide["loss_mask"][:, :width].equal(short["loss_mask"])
    losses = {}
    for name, rows in (("padded", padded), ("fixed", fixed)):
        config = sft_throughput.plugin_config("tiny", str(tiny_llama_dir), settings, 5.0, "sdpa")
        runner = PluginCpuRunner(config, noise_forward_step, Batches(rows, 1), settings["lr"])
        runner.steps(2)
        losses[name] = runner.losses
    assert losses["fixed"] == pytest.approx(losses["padded"], rel=1e-5)
