"""The clean teacher: a frozen, noise-free copy of the student that shares process groups, not parameters."""

from __future__ import annotations

import functools

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from nemo_noise_plugin.distillation.teacher import build_clean_teacher, frozen_submodules
from nemo_noise_plugin.model import NoiseInjectionMixin, NoisyGPTModel
from nemo_noise_plugin.noise.config import NoiseConfig
from tests.support.models import build_tiny_gpt


def _student() -> NoisyGPTModel:
    torch.manual_seed(11)
    return build_tiny_gpt(model_class=NoisyGPTModel, noise_config=NoiseConfig(alpha=10.0))


def _logits(model, batch) -> torch.Tensor:
    return model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])


def test_teacher_is_a_plain_frozen_eval_copy_with_the_students_weights(megatron_cpu, batch):
    student = _student()
    teacher = build_clean_teacher(student)
    assert type(teacher) is GPTModel and not isinstance(teacher, NoiseInjectionMixin)
    assert not teacher.training and all(not p.requires_grad for p in teacher.parameters())
    student_state, teacher_state = student.state_dict(), teacher.state_dict()
    assert student_state.keys() == teacher_state.keys()
    for key, value in student_state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, teacher_state[key]), key
    student.eval()
    with torch.no_grad():
        assert torch.equal(_logits(teacher, batch), _logits(student, batch))


def test_teacher_stays_clean_when_the_student_trains_with_noise(megatron_cpu, batch):
    student = _student()
    teacher = build_clean_teacher(student)
    student.train()
    with torch.no_grad(), student.noise_batch_inputs(batch["loss_mask"]):
        noisy = _logits(student, batch)
        clean = _logits(teacher, batch)
    assert not torch.equal(noisy, clean)
    student.eval()
    with torch.no_grad():
        assert torch.equal(_logits(student, batch), clean)


def test_teacher_shares_process_groups_but_not_parameters(megatron_cpu):
    student = _student()
    teacher = build_clean_teacher(student)
    assert teacher.pg_collection is student.pg_collection
    student_layer, teacher_layer = student.decoder.layers[0], teacher.decoder.layers[0]
    assert teacher_layer.self_attention.pg_collection is student_layer.self_attention.pg_collection
    student_storages = {p.untyped_storage().data_ptr() for p in student.parameters()}
    assert not student_storages & {p.untyped_storage().data_ptr() for p in teacher.parameters()}


def test_teacher_is_bit_identical_after_student_optimizer_steps_and_never_gets_grad(megatron_cpu, batch):
    student = _student()
    teacher = build_clean_teacher(student)
    before = {name: p.clone() for name, p in teacher.named_parameters()}
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        with student.noise_batch_inputs(batch["loss_mask"]):
            student_logits = _logits(student, batch)
        with torch.no_grad():
            teacher_logits = _logits(teacher, batch)
        loss = torch.nn.functional.mse_loss(student_logits, teacher_logits) + student_logits.pow(2).mean()
        loss.backward()
        optimizer.step()
    for name, parameter in teacher.named_parameters():
        assert torch.equal(parameter, before[name]), name
        assert parameter.grad is None
    moved = [name for name, p in student.named_parameters() if not torch.equal(p, before[name])]
    assert moved, "the student trained"


def test_gradients_and_data_parallel_buffers_are_not_copied(megatron_cpu):
    student = _student()
    buffer = torch.zeros(sum(p.numel() for p in student.parameters()))
    offset = 0
    for parameter in student.parameters():  # what Megatron's DDP attaches: views into one grad buffer
        parameter.main_grad = buffer[offset : offset + parameter.numel()].view_as(parameter)
        parameter.grad = torch.ones_like(parameter)
        offset += parameter.numel()
    teacher = build_clean_teacher(student)
    for parameter in teacher.parameters():
        assert parameter.grad is None and not hasattr(parameter, "main_grad")
    for parameter in student.parameters():
        assert parameter.main_grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_frozen_student_modules_can_be_shared_instead_of_copied(megatron_cpu, batch):
    student = _student()
    for parameter in student.embedding.parameters():
        parameter.requires_grad_(False)
    assert frozen_submodules(student) == [student.embedding]
    shared = build_clean_teacher(student, share_frozen_modules=True)
    copied = build_clean_teacher(student)
    assert shared.embedding is student.embedding
    assert copied.embedding is not student.embedding
    assert shared.decoder is not student.decoder
    with torch.no_grad():
        assert torch.equal(_logits(shared, batch), _logits(copied, batch))
    assert not student.embedding.word_embeddings.weight.requires_grad


def test_teacher_shares_the_config_even_when_it_references_uncopyable_training_state(megatron_cpu):
    """Under Bridge the modules' config is the provider, which setup() points at DDP/optimizer bound methods."""
    from megatron.core import parallel_state

    student = _student()
    student.config.grad_scale_func = functools.partial(print, group=parallel_state.get_data_parallel_group())
    teacher = build_clean_teacher(student)
    assert teacher.config is student.config
    assert teacher.decoder.layers[0].config is student.config
