"""The tiny hybrid recipes (issue 35) through the plugin's launcher and CPU loop: a real ``HybridModel`` built by the
plugin's hybrid providers, Bridge's data pipeline and forward step, Megatron's learning-rate schedule.

Training lowers the loss (SFT and KD); the noise is the GPT model's noise for the same seed, iteration and
microbatch; a stopped and resumed run equals an uninterrupted one bit for bit. The Mamba recipe needs mamba_ssm's
CUDA kernels: ``tests/gpu/test_hybrid_sft_gpu.py`` runs it, and skips with the reason where they are absent.
"""

from __future__ import annotations

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel

from nemo_noise_plugin.jobs.cpu.loop import run_cpu_loop
from nemo_noise_plugin.jobs.launch.launcher import launch
from nemo_noise_plugin.model.hybrid import NoisyHybridModel
from nemo_noise_plugin.recipes.hybrid import (
    tiny_hybrid_noise_distillation_config,
    tiny_hybrid_noise_sft_config,
)
from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config
from nemo_noise_plugin.training.forward_step import noise_forward_step
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

_Callback = import_bridge("megatron.bridge.training.callbacks").Callback

STEPS = 4
SMALL = "*-*-"
"""Two attention + MLP pairs: half the recipe's stack, for the tests that only need a hybrid model to train."""


class Record(_Callback):
    """Each step's losses and the model class; the final weights."""

    def __init__(self) -> None:
        self.losses: dict[int, dict[str, float]] = {}
        self.model_class: type | None = None
        self.teacher_class: type | None = None
        self.weights: dict[str, torch.Tensor] | None = None

    def on_train_start(self, context):
        from nemo_noise_plugin.distillation.teacher_weights import attached_teacher

        self.model_class = type(context.model[0])
        teacher = attached_teacher(context.model[0])
        self.teacher_class = type(teacher) if teacher is not None else None

    def on_train_step_end(self, context):
        self.losses[context.state.train_state.step] = {k: float(v) for k, v in context.loss_dict.items()}

    def on_train_end(self, context):
        self.weights = {k: v.clone() for k, v in context.model[0].state_dict().items() if torch.is_tensor(v)}


def test_the_hybrid_sft_recipe_trains_through_the_launcher_on_the_cpu_loop(tmp_path):
    record = Record()
    overrides = [f"model.hybrid_layer_pattern={SMALL}", "train.train_iters=6", "optimizer.lr=0.001"]
    launch(tiny_hybrid_noise_sft_config(dir=str(tmp_path)), overrides, callbacks=[record], allow_cpu_loop=True)
    assert record.model_class is NoisyHybridModel and record.teacher_class is None
    losses = [record.losses[step]["lm loss"] for step in range(6)]
    assert losses[-1] < losses[0] - 1.0, losses  # from ~5.5 (uniform over 257 bytes) towards the corpus's bytes


def test_the_hybrid_distillation_recipe_distils_from_a_clean_hybrid_teacher(tmp_path):
    record = Record()
    overrides = [f"model.hybrid_layer_pattern={SMALL}", "train.train_iters=4", "optimizer.lr=0.001"]
    launch(tiny_hybrid_noise_distillation_config(dir=str(tmp_path)), overrides, callbacks=[record], allow_cpu_loop=True)
    assert record.model_class is NoisyHybridModel and record.teacher_class is HybridModel
    first, last = record.losses[0], record.losses[3]
    assert set(first) == {"lm loss", "kd loss", "hidden loss", "total loss"}
    assert first["kd loss"] < 1e-3  # the teacher is the student's start: only the noise tells them apart
    assert last["kd loss"] > 10 * first["kd loss"]  # the student moves away from its frozen start
    assert last["lm loss"] < first["lm loss"] - 1.0


class DecoderInputs(_Callback):
    """The decoder input (noised embedding) and the clean embedding of every microbatch of a run.

    ``embedding`` given, the model's word embeddings are set to it at the start, so two models embed alike.
    """

    def __init__(self, embedding: torch.Tensor | None = None) -> None:
        self.embedding = embedding
        self.clean: list[torch.Tensor] = []
        self.noised: list[torch.Tensor] = []

    def on_train_start(self, context):
        model = context.model[0]
        if self.embedding is not None:
            with torch.no_grad():
                model.embedding.word_embeddings.weight.copy_(self.embedding)

        # The clean embedding is the lookup in [s, b, h] (no position table, no dropout), read from the ids the model
        # is called with: a GPT model adds its noise in the lookup itself (model/noised_lookup.py), never calling
        # its embedding module.
        def clean(module, args, kwargs):
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self.clean.append(module.embedding.word_embeddings.weight.detach()[input_ids].transpose(0, 1))

        model.register_forward_pre_hook(clean, with_kwargs=True)
        model.decoder.register_forward_pre_hook(
            lambda module, args, kwargs: self.noised.append(kwargs["hidden_states"].detach()), with_kwargs=True
        )


def test_the_hybrid_model_draws_the_gpt_models_noise_for_the_same_seed_iteration_and_microbatch(tmp_path):
    torch.manual_seed(0)
    embedding = torch.randn(257, 256) * 0.02  # the corpus vocabulary (bytes and end-of-document), hidden 256
    gpt, hybrid = DecoderInputs(embedding), DecoderInputs(embedding)
    gpt_config = tiny_noise_sft_config(dir=str(tmp_path / "gpt"), train_iters=2, lr=1e-3)
    gpt_config.model.position_embedding_type = "rope"  # no position table added to the embedding, as on hybrid
    hybrid_config = tiny_hybrid_noise_sft_config(dir=str(tmp_path / "hybrid"), train_iters=2, lr=1e-3, pattern=SMALL)
    for config in (gpt_config, hybrid_config):
        config.model.noise.alpha = 10.0
        config.checkpoint.save = config.checkpoint.load = None
    run_cpu_loop(gpt_config, noise_forward_step, [gpt])
    run_cpu_loop(hybrid_config, noise_forward_step, [hybrid])
    assert len(gpt.noised) == len(hybrid.noised) == 8  # 2 iterations x 4 microbatches
    noise_gpt = [n - c for n, c in zip(gpt.noised, gpt.clean, strict=True)]
    noise_hybrid = [n - c for n, c in zip(hybrid.noised, hybrid.clean, strict=True)]
    for index in range(4):  # iteration 0: the same embedding weights, so the same noised input, bit for bit
        assert torch.equal(gpt.clean[index], hybrid.clean[index]), index
        assert torch.equal(gpt.noised[index], hybrid.noised[index]), index
    for index in range(4, 8):  # iteration 1: the weights moved apart; the noise is still the same draw
        assert not torch.equal(gpt.clean[index], hybrid.clean[index])
        torch.testing.assert_close(noise_hybrid[index], noise_gpt[index], rtol=0, atol=1e-6)
    bound = 10.0 / (128 * 256) ** 0.5  # NEFTune: |noise| <= alpha / sqrt(L d), full 128-token rows here
    for noise in noise_hybrid:
        assert 0.99 * bound < float(noise.abs().max()) <= bound * (1 + 1e-6)
    assert not torch.allclose(noise_gpt[0], noise_gpt[4], atol=1e-3)  # a new iteration draws new noise


def _resume_config(folder, *, exit_interval=None):
    config = tiny_hybrid_noise_sft_config(dir=str(folder), train_iters=STEPS, lr=1e-3, pattern=SMALL)
    config.model.noise.alpha = 10.0
    config.checkpoint.save_interval = 1
    config.train.exit_interval = exit_interval
    return config


def _run(config) -> Record:
    record = Record()
    run_cpu_loop(config, noise_forward_step, [record])
    return record


def test_a_stopped_and_resumed_hybrid_run_equals_an_uninterrupted_one_bitwise(tmp_path, capsys):
    straight = _run(_resume_config(tmp_path / "straight"))
    stopped = _run(_resume_config(tmp_path / "resumed", exit_interval=2))
    assert sorted(stopped.losses) == [0, 1] and stopped.weights is None
    assert "stopped at iteration 2" in capsys.readouterr().out
    resumed = _run(_resume_config(tmp_path / "resumed"))
    assert "at iteration 2 of 4" in capsys.readouterr().out
    assert sorted(resumed.losses) == [2, 3]
    assert {**stopped.losses, **resumed.losses} == straight.losses  # exact floats: same noise, data, state
    assert resumed.weights.keys() == straight.weights.keys()
    for name, value in resumed.weights.items():
        assert torch.equal(value, straight.weights[name]), name


class RecordKD(Record):
    """Also the KD loss of every step (a function of the clean teacher's weights too)."""

    def __init__(self) -> None:
        super().__init__()
        self.kd: dict[int, float] = {}

    def on_train_step_end(self, context):
        super().on_train_step_end(context)
        self.kd[context.state.train_state.step] = float(context.loss_dict["kd loss"])


def test_a_resumed_hybrid_distillation_run_distils_from_the_weights_it_started_from(tmp_path):
    from nemo_noise_plugin.jobs.launch.warm_start import CaptureWeights, StartFromWeights
    from nemo_noise_plugin.training.forward_step import distillation_forward_step

    capture = CaptureWeights()  # a clean start that differs from the initialisation: the teacher to distil from
    clean = _resume_config(tmp_path / "clean")
    clean.model.noise.enabled = False
    run_cpu_loop(clean, noise_forward_step, [capture])

    def run(folder, exit_interval=None) -> RecordKD:
        config = tiny_hybrid_noise_distillation_config(dir=str(folder), train_iters=STEPS, lr=1e-3, pattern=SMALL)
        config.checkpoint.save_interval = 1
        config.train.exit_interval = exit_interval
        record = RecordKD()
        run_cpu_loop(config, distillation_forward_step, [StartFromWeights(capture.weights), record])
        return record

    straight = run(tmp_path / "straight")
    stopped = run(tmp_path / "resumed", exit_interval=2)
    resumed = run(tmp_path / "resumed")
    assert sorted(resumed.kd) == [2, 3]
    assert {**stopped.kd, **resumed.kd} == straight.kd  # the same teacher after the restart
    assert {**stopped.losses, **resumed.losses} == straight.losses
    for name, value in resumed.weights.items():
        assert torch.equal(value, straight.weights[name]), name
