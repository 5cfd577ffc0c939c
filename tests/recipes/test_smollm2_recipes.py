"""The SmolLM2-135M-Instruct recipes: config, provider, overrides and YAML; greedy answers, export, a few noisy steps.

All but the first tests need the real model (``slow``; the session fixture converts it once, then it is cached).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.jobs.cpu import init_cpu_parallel
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.recipes import RECIPES
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from tests.support.attention_variables import clean_attention_variables
from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401  (the session fixture)

EOS = 2


def test_both_recipes_are_registered_for_every_command():
    for mode in ("sft", "distillation"):
        recipe = RECIPES[f"smollm2_135m_noise_{mode}"]
        assert recipe.embedded_corpus  # the main job's --recipe choices and the CPU path of `nemo llm finetune`
        assert recipe.path == f"nemo_noise_plugin.recipes.smollm2:smollm2_135m_noise_{mode}_config"


@pytest.fixture(scope="module")
def sft_config(smollm2_hf_dir, tmp_path_factory):  # noqa: F811
    from nemo_noise_plugin.recipes.smollm2 import smollm2_135m_noise_sft_config

    return smollm2_135m_noise_sft_config(dir=str(tmp_path_factory.mktemp("sft")), hf_path=str(smollm2_hf_dir))


@pytest.mark.slow
def test_the_sft_recipe_is_autobridges_smollm2_as_a_noisy_provider_on_the_instruction_set(sft_config, smollm2_hf_dir):  # noqa: F811
    from nemo_noise_plugin.providers import NoisyDistillationProvider, NoisyGPTModelProvider

    model = sft_config.model
    assert type(model) is NoisyGPTModelProvider and not isinstance(model, NoisyDistillationProvider)
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.num_query_groups) == (30, 576, 9, 3)
    assert model.share_embeddings_and_output_weights and model.noise == NoiseConfig(alpha=5.0)
    assert model._pre_wrap_hooks  # AutoBridge's HF weight loading survives the conversion
    builders = import_bridge("megatron.bridge.data.builders.gpt_sft")
    assert isinstance(sft_config.dataset, builders.GPTSFTDatasetConfig)
    assert sorted(p.name for p in Path(sft_config.dataset.dataset_root).glob("*.jsonl")) == [
        "test.jsonl",  # read by the task report only (the recipe's dataset has do_test=False)
        "training.jsonl",
        "validation.jsonl",
    ]
    assert sft_config.dataset.do_test is False
    assert sft_config.tokenizer.tokenizer_model == str(smollm2_hf_dir)
    assert (sft_config.optimizer.clip_grad, sft_config.scheduler.lr_warmup_iters) == (1.0, 2)


@pytest.mark.slow
def test_the_distillation_recipe_carries_kd_settings(smollm2_hf_dir, tmp_path):  # noqa: F811
    from nemo_noise_plugin.providers import NoisyDistillationProvider
    from nemo_noise_plugin.recipes.smollm2 import smollm2_135m_noise_distillation_config

    config = smollm2_135m_noise_distillation_config(
        dir=str(tmp_path), hf_path=str(smollm2_hf_dir), kd=KDConfig(temperature=2.0)
    )
    assert isinstance(config.model, NoisyDistillationProvider) and config.model.kd.temperature == 2.0


@pytest.mark.slow
def test_overrides_and_a_yaml_round_trip_keep_the_plugin_settings(sft_config, tmp_path):
    from nemo_noise_plugin.training.overrides import apply_overrides

    overrides = ["model.noise.alpha=10", "train.train_iters=7", "optimizer.clip_grad=0.5"]
    config = apply_overrides(copy.deepcopy(sft_config), overrides)
    assert (config.model.noise.alpha, config.train.train_iters, config.optimizer.clip_grad) == (10.0, 7, 0.5)
    path = tmp_path / "run.yaml"
    config.to_yaml(str(path))
    restored = apply_overrides(copy.deepcopy(sft_config), [], config_filepath=str(path))  # the recipe + the YAML
    assert restored.model.noise == config.model.noise and restored.model.noise.alpha == 10.0
    assert (restored.train.train_iters, restored.optimizer.clip_grad) == (7, 0.5)
    assert restored.dataset.dataset_root == config.dataset.dataset_root
    with pytest.raises(ValueError, match="alpah"):
        apply_overrides(sft_config, ["model.noise.alpah=10"])


# --- the model: greedy decoding, export, a few noisy steps ---------------------------------------------------------


def _build(config) -> torch.nn.Module:
    """The recipe's model on the CPU in float32, with AutoBridge's pretrained weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    provider = config.model
    provider.bf16, provider.params_dtype, provider.pipeline_dtype = False, torch.float32, torch.float32
    provider.use_cpu_initialization = True
    provider.finalize()
    # Earlier models in this test process may have pinned another attention backend (NVTE_* variables).
    with clean_attention_variables():
        return provider.provide_distributed_model(
            wrap_with_ddp=False,
            use_cpu_initialization=True,
            mixed_precision_wrapper=None,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )[0].eval()


@pytest.fixture(scope="module")
def model(megatron_cpu, sft_config):
    return _build(sft_config)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_hf_dir):  # noqa: F811
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_hf_dir)


def _prompts(hf_tokenizer, count):
    from nemo_noise_plugin.data.instruction_set import instruction_examples

    chats = [[m for m in e["messages"] if m["role"] != "assistant"] for e in instruction_examples()[:count]]
    return [hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) for chat in chats]


@pytest.mark.slow
def test_megatron_greedy_decoding_gives_transformers_greedy_answer(model, smollm2_hf_dir, hf_tokenizer):  # noqa: F811
    import transformers

    from tests.support.generation import greedy_decode

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    for prompt in _prompts(hf_tokenizer, 3):
        megatron = greedy_decode(model, prompt, EOS, max_new_tokens=12)
        with torch.no_grad():
            output = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert megatron == output[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_teacher_forced_exact_match_agrees_with_greedy_decoding(model, sft_config, hf_tokenizer):
    from nemo_noise_plugin.data.instruction_set import instruction_examples
    from nemo_noise_plugin.jobs.batches import collate, recipe_datasets
    from nemo_noise_plugin.jobs.cpu.parallel import causal_attention_mask
    from nemo_noise_plugin.jobs.reports.task_metric import exact_match
    from tests.support.generation import greedy_decode

    state = import_bridge("megatron.bridge.training.state").GlobalState()
    state.cfg = sft_config
    _, valid, _ = recipe_datasets(state)
    batches = collate(valid, 2, 4, causal_attention_mask(128), "cpu")
    _, _, hits = exact_match(model, batches, EOS)
    answers = [e["messages"][-1]["content"] for e in instruction_examples()[:8]]
    decoded = [
        hf_tokenizer.decode(greedy_decode(model, prompt, EOS, 8), skip_special_tokens=True).strip()
        for prompt in _prompts(hf_tokenizer, 8)
    ]
    assert hits == [reply == answer for reply, answer in zip(decoded, answers, strict=True)]


@pytest.mark.slow
def test_export_before_training_is_bitwise_the_source(model, smollm2_hf_dir, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    from nemo_noise_plugin.jobs.reports.hf_export import export_hf

    folder = export_hf(model, str(smollm2_hf_dir), str(tmp_path / "hf"))
    source = {k: v for f in smollm2_hf_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    exported = {k: v for f in Path(folder).glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(exported) == set(source)
    assert all(torch.equal(exported[name], source[name]) for name in source)


@pytest.fixture(scope="module")
def trained(smollm2_hf_dir, tmp_path_factory):  # noqa: F811
    """Three noisy steps (NEFTune alpha 5) of the SFT recipe on the CPU loop, measured inside the run."""
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.jobs.batches import collate
    from nemo_noise_plugin.jobs.cpu.loop import run_cpu_loop
    from nemo_noise_plugin.jobs.reports.hf_export import export_hf
    from nemo_noise_plugin.jobs.reports.robustness import logits_of
    from nemo_noise_plugin.recipes.smollm2 import smollm2_135m_noise_sft_config
    from nemo_noise_plugin.training.forward_step import noise_forward_step

    root = tmp_path_factory.mktemp("trained")
    config = smollm2_135m_noise_sft_config(
        dir=str(root), hf_path=str(smollm2_hf_dir), train_iters=3, lr=2e-4, global_batch_size=4, micro_batch_size=4
    )
    config.scheduler.lr_warmup_iters = 0
    config.checkpoint.save = None  # no resumable state (1.6 GB with AdamW's moments): the test measures the run only
    callbacks = import_bridge("megatron.bridge.training.callbacks")
    seen: dict = {}

    def response_loss(model, batches):
        with torch.no_grad():
            total = count = 0.0
            for batch in batches:
                log_probs = logits_of(model, batch).float().log_softmax(-1)
                picked = log_probs.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
                total += -(picked * batch["loss_mask"]).sum().item()
                count += batch["loss_mask"].sum().item()
        return total / count

    class Measure(callbacks.Callback):
        def on_train_start(self, context):
            from nemo_noise_plugin.jobs.batches import recipe_datasets
            from nemo_noise_plugin.jobs.cpu.parallel import causal_attention_mask

            train, _, _ = recipe_datasets(context.state)
            self.batches = collate(train, 3, 4, causal_attention_mask(128), "cpu")  # the batches it trains on
            model = unwrap_model(context.model[0]).eval()
            seen["before"] = response_loss(model, self.batches)
            model.train()

        def on_train_end(self, context):
            model = unwrap_model(context.model[0]).eval()
            seen["after"] = response_loss(model, self.batches)
            with torch.no_grad():
                seen["logits"] = logits_of(model, self.batches[0])[..., :49152]
            seen["batch"] = self.batches[0]
            seen["folder"] = export_hf(model, str(smollm2_hf_dir), str(root / "hf"))

    was_initialized = torch.distributed.is_initialized()
    run_cpu_loop(config, noise_forward_step, [Measure()])
    if was_initialized:  # the session's in-process Megatron state, which the CPU loop tore down
        init_cpu_parallel(seed=1234)
    return seen


@pytest.mark.slow
def test_three_noisy_steps_lower_the_response_loss(trained):
    assert trained["after"] < trained["before"] - 0.05, (trained["before"], trained["after"])


@pytest.mark.slow
def test_the_trained_export_reloads_in_transformers_with_megatrons_logits(trained):
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(trained["folder"], dtype=torch.float32).eval()
    batch = trained["batch"]
    with torch.no_grad():
        hf_logits = hf_model(input_ids=batch["tokens"], attention_mask=torch.ones_like(batch["tokens"])).logits
    difference = (hf_logits - trained["logits"]).abs().max().item()
    assert difference < 1e-3, difference
