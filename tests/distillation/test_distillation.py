"""NoisyDistillationProvider and the Bridge forward steps on CPU: real Bridge provider, config, state and GPT step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.model import NoisyGPTModel
from nemo_noise_plugin.noise.config import NoiseConfig
from tests.support.models import TINY_CPU_TRANSFORMER_SETTINGS, causal_attention_mask

SEQ = 32


@pytest.fixture(scope="module")
def bridge(megatron_cpu):
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    return {
        "config": import_bridge("megatron.bridge.training.config"),
        "state": import_bridge("megatron.bridge.training.state"),
        "tokenizer": import_bridge("megatron.bridge.training.tokenizers.config"),
        "gpt_step": import_bridge("megatron.bridge.training.gpt_step"),
    }


def _provider(noise: NoiseConfig, kd: KDConfig | None = None, **overrides):
    from nemo_noise_plugin.providers import NoisyDistillationProvider

    provider = NoisyDistillationProvider(
        **{
            **TINY_CPU_TRANSFORMER_SETTINGS,
            "vocab_size": 256,
            "seq_length": SEQ,
            "make_vocab_size_divisible_by": 128,
            "transformer_layer_spec": get_gpt_layer_local_spec(),
            **overrides,
        },
        noise=noise,
        kd=kd if kd is not None else KDConfig(),
    )
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return provider


def _model(provider):
    torch.manual_seed(5)
    return provider.provide_distributed_model(
        use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
    )


def _state(bridge, provider, step: int = 0):
    config = bridge["config"]
    container = config.ConfigContainer(
        model=provider,
        train=config.TrainingConfig(train_iters=4, global_batch_size=2, micro_batch_size=2),
        optimizer=config.OptimizerConfig(optimizer="adam", lr=1e-4),
        scheduler=config.SchedulerConfig(),
        dataset=config.MockGPTDatasetConfig(
            seq_length=SEQ, random_seed=1, reset_attention_mask=False, reset_position_ids=False, eod_mask_loss=False
        ),
        logger=config.LoggerConfig(),
        tokenizer=bridge["tokenizer"].TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256),
        checkpoint=config.CheckpointConfig(),
        rng=config.RNGConfig(),
    )
    container.dataset.skip_getting_attention_mask_from_dataset = False  # the CPU needs an explicit causal mask
    state = bridge["state"].GlobalState()
    state.cfg = container
    state.train_state.step = step
    return state


def _batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, SEQ), generator=generator)
    loss_mask = torch.zeros(2, SEQ)
    loss_mask[0, 4:30] = 1
    loss_mask[1, 10:20] = 1
    return {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(SEQ).expand(2, -1).contiguous(),
        "attention_mask": causal_attention_mask(SEQ),
    }


def _distill(state, chunk):
    from nemo_noise_plugin.training.forward_step import distillation_forward_step

    logits, loss_function = distillation_forward_step(state, iter([_batch()]), chunk)
    return logits, loss_function(logits)


def test_kd_and_noise_settings_are_dataclass_fields_of_a_bridge_provider(bridge):
    from nemo_noise_plugin.providers import NoisyDistillationProvider, NoisyGPTModelProvider

    names = [field.name for field in dataclasses.fields(NoisyDistillationProvider)]
    assert {"kd", "noise", "teacher_shares_frozen_modules", "hidden_size"} <= set(names)
    assert issubclass(NoisyDistillationProvider, NoisyGPTModelProvider)


def test_each_chunk_carries_a_clean_frozen_teacher_outside_its_module_tree(bridge):
    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher

    (student,) = _model(_provider(NoiseConfig(alpha=10.0)))
    teacher = attached_teacher(student)
    assert type(student) is NoisyGPTModel and type(teacher) is GPTModel
    assert all(not p.requires_grad for p in teacher.parameters())
    assert not any(module is teacher for module in student.modules())
    assert list(student.state_dict()) == list(teacher.state_dict())  # the checkpoint is the student's alone
    assert all("teacher" not in key for key in student.sharded_state_dict())


def test_without_noise_the_kd_loss_is_zero_and_with_noise_it_is_positive(bridge):
    provider = _provider(NoiseConfig(enabled=False))
    (clean,) = _model(provider)
    _, (_, _, report) = _distill(_state(bridge, provider), clean)
    assert report["kd loss"][0].item() == 0.0

    provider = _provider(NoiseConfig(alpha=10.0))
    (noisy,) = _model(provider)
    _, (loss_sum, num_tokens, report) = _distill(_state(bridge, provider), noisy)
    assert report["kd loss"][0].item() > 1e-3
    assert num_tokens.item() == 36  # response tokens of the two sequences
    expected_total = report["lm loss"][0] + report["kd loss"][0]  # ce_weight 1, kd_weight 1, T = 1
    assert torch.allclose(loss_sum.detach(), expected_total, rtol=1e-5)


def test_the_student_gets_gradients_and_the_teacher_none(bridge):
    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher

    provider = _provider(NoiseConfig(alpha=10.0))
    (student,) = _model(provider)
    _, (loss_sum, num_tokens, _) = _distill(_state(bridge, provider), student)
    (loss_sum / num_tokens).backward()
    assert student.embedding.word_embeddings.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in attached_teacher(student).parameters())


def test_teacher_takes_the_students_weights_at_iteration_zero_and_keeps_its_snapshot_after_a_resume(bridge):
    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher, ready_teacher

    provider = _provider(NoiseConfig(alpha=10.0))
    (student,) = _model(provider)
    teacher = attached_teacher(student)
    with torch.no_grad():  # what a pretrained_checkpoint load after the model is built does
        for parameter in student.parameters():
            parameter.add_(0.5)
    ready_teacher(_state(bridge, provider, step=0), student)
    for (name, s), t in zip(student.named_parameters(), teacher.parameters(), strict=True):
        assert torch.equal(s, t), name

    (resumed,) = _model(provider)
    snapshot = {name: p.clone() for name, p in attached_teacher(resumed).named_parameters()}
    with torch.no_grad():  # what loading a resume checkpoint of a fine-tuned student does
        for parameter in resumed.parameters():
            parameter.add_(0.25)
    ready_teacher(_state(bridge, provider, step=7), resumed)
    for name, parameter in attached_teacher(resumed).named_parameters():
        assert torch.equal(parameter, snapshot[name]), "without pretrained_checkpoint the snapshot is the source"


def test_hidden_state_matching_at_chosen_layers(bridge):
    kd = KDConfig(hidden_loss="mse", hidden_layers=[0, 1], hidden_weight=0.5)
    provider = _provider(NoiseConfig(alpha=10.0), kd)
    (student,) = _model(provider)
    _, (_, _, report) = _distill(_state(bridge, provider), student)
    assert report["hidden loss"][0].item() > 0


def test_noise_forward_step_is_bridges_step_plus_the_noise_clock_and_the_loss_mask(bridge):
    from nemo_noise_plugin.training.forward_step import noise_forward_step

    provider = _provider(NoiseConfig(enabled=False))
    (plain,) = _model(provider)
    state = _state(bridge, provider, step=3)
    expected, expected_loss = bridge["gpt_step"].forward_step(state, iter([_batch()]), plain)
    actual, actual_loss = noise_forward_step(state, iter([_batch()]), plain)
    assert torch.equal(actual, expected)
    assert torch.equal(actual_loss(actual)[0], expected_loss(expected)[0])

    provider = _provider(NoiseConfig(alpha=10.0))  # true_length scaling: needs the loss mask, which Bridge omits
    (noisy,) = _model(provider)
    state = _state(bridge, provider, step=3)
    output, _ = noise_forward_step(state, iter([_batch()]), noisy)
    assert not torch.equal(output, expected)
    assert noisy.noise_clock.iteration == 4  # synced to step 3, then advanced past its single microbatch
    with noisy.noise_batch_inputs() as handed:
        assert handed.loss_mask is None, "the loss mask is handed over for one forward step only"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(pipeline_model_parallel_size=2, kd=KDConfig(hidden_loss="mse", hidden_layers=[0])),
            "hidden_loss='mse' is not supported with pipeline_model_parallel_size=2",
        ),
        (
            dict(kd=KDConfig(hidden_loss="mse", hidden_layers=[5])),
            r"hidden_layers=\[5\] is invalid with num_layers=2: expected layer indices in 0\.\.1",
        ),
    ],
)
def test_unsupported_distillation_settings_are_rejected_before_building(bridge, overrides, message):
    from nemo_noise_plugin.providers import NoisyDistillationProvider

    kd = overrides.pop("kd", KDConfig())
    provider = NoisyDistillationProvider(
        **{**TINY_CPU_TRANSFORMER_SETTINGS, "vocab_size": 256, "seq_length": SEQ, **overrides}, kd=kd
    )
    with pytest.raises(ValueError, match=message):
        provider.validate_distillation()


def test_after_a_resume_the_teacher_reloads_a_megatron_pretrained_checkpoint(bridge, tmp_path):
    from megatron.core import dist_checkpointing

    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher, settle_teacher_weights

    provider = _provider(NoiseConfig(alpha=10.0))
    (pretrained,) = _model(provider)
    with torch.no_grad():
        for parameter in pretrained.parameters():
            parameter.mul_(1.5)  # distinct from the seeded initialisation the resumed run starts from
    base = tmp_path / "pretrained"
    (base / "iter_0000003").mkdir(parents=True)
    dist_checkpointing.save({"model": pretrained.sharded_state_dict()}, str(base / "iter_0000003"))
    # The iteration directory itself (Bridge's tracker-file reader allocates on "cuda", so a base directory
    # resolves only on a GPU machine; both go through Bridge's _resolve_checkpoint_iteration).

    (resumed,) = _model(provider)
    with torch.no_grad():  # the resume checkpoint: fine-tuned weights
        for parameter in resumed.parameters():
            parameter.add_(0.25)
    state = _state(bridge, provider, step=7)
    state.cfg.checkpoint.pretrained_checkpoint = str(base / "iter_0000003")
    teacher = attached_teacher(resumed)
    source = settle_teacher_weights(state, resumed, teacher)
    assert source.startswith("Megatron checkpoint") and source.endswith("iter_0000003")
    for (name, expected), actual in zip(pretrained.named_parameters(), teacher.parameters(), strict=True):
        assert torch.equal(actual, expected), name


def test_teacher_checkpoint_gives_the_teacher_other_weights_than_the_student_at_iteration_0(bridge, tmp_path):
    """KD from a clean fine-tuned teacher: with ``teacher_checkpoint`` the teacher is loaded from that checkpoint,
    not copied from the student, already at iteration 0 (and after a resume alike)."""
    from megatron.core import dist_checkpointing

    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher, settle_teacher_weights

    provider = _provider(NoiseConfig(alpha=10.0))
    (fine_tuned,) = _model(provider)
    with torch.no_grad():
        for parameter in fine_tuned.parameters():
            parameter.add_(0.5)  # the "fine-tuned" teacher: not the student's start weights
    folder = tmp_path / "plain_run" / "iter_0000040"
    folder.mkdir(parents=True)
    dist_checkpointing.save({"model": fine_tuned.sharded_state_dict()}, str(folder))

    provider.teacher_checkpoint = str(folder)
    provider.validate_distillation()
    for step in (0, 9):
        (student,) = _model(provider)
        state = _state(bridge, provider, step=step)
        source = settle_teacher_weights(state, student, attached_teacher(student))
        assert source == f"Megatron checkpoint {folder}"
        teacher = attached_teacher(student)
        for (name, expected), actual, own in zip(
            fine_tuned.named_parameters(), teacher.parameters(), student.parameters(), strict=True
        ):
            assert torch.equal(actual, expected), name
            assert not torch.equal(actual, own), f"{name}: the teacher must not be the student's weights"


@pytest.mark.parametrize("path", ["", 5, "/no/such/teacher"])
def test_teacher_checkpoint_must_name_a_folder(path):
    from nemo_noise_plugin.providers import NoisyDistillationProvider

    provider = NoisyDistillationProvider(
        **{**TINY_CPU_TRANSFORMER_SETTINGS, "vocab_size": 256, "seq_length": SEQ}, teacher_checkpoint=path
    )
    with pytest.raises(ValueError, match="NoisyDistillationProvider.teacher_checkpoint=.* is invalid"):
        provider.validate_distillation()
