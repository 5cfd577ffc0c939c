"""The ModelOpt baseline of ``benchmarks/distillation_step.py`` trains (issue 26), on CPU with the real objects.

Bridge's training loop needs CUDA, so the benchmark's ``modelopt_provider`` (Bridge's ``DistillationProvider`` over
ModelOpt: noisy student, teacher holding the student's start weights, logits KL) is built on a tiny local-spec GPT
and trained here by a plain loop around Bridge's ``forward_step_modelopt`` and its loss function (``loss_func_kd``),
on Bridge's mock-data pattern (documents ``1, 2, ..., n-1, EOD``), with Adam and gradient clipping at 1 as in the
benchmark. The benchmark's own ``loss_checks`` decides whether it trained. ModelOpt's default balancer, the old
configuration, is trained too: it does not, which is the cause the benchmark's comment names.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.distillation_step import loss_checks, modelopt_provider
from tests.support.models import causal_attention_mask

SEQ, MICRO_BATCH, VOCAB, STEPS = 64, 4, 256, 40


def _mock_batches(seed: int = 0):
    """Bridge's mock GPT data: documents 1, 2, ..., n-1 then EOD (0), packed into windows of SEQ + 1 tokens."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        rows = []
        for _ in range(MICRO_BATCH):
            row: list[int] = []
            while len(row) < SEQ + 1:
                length = int(torch.randint(2, 60, (1,), generator=generator))
                row += [index % VOCAB for index in range(1, length)] + [0]
            rows.append(torch.tensor(row[: SEQ + 1]))
        window = torch.stack(rows)
        yield {
            "tokens": window[:, :-1],
            "labels": window[:, 1:],
            "loss_mask": torch.ones(MICRO_BATCH, SEQ),
            "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, -1).contiguous(),
            "attention_mask": causal_attention_mask(SEQ),
        }


def _state(provider):
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    config = import_bridge("megatron.bridge.training.config")
    tokenizer = import_bridge("megatron.bridge.training.tokenizers.config")
    container = config.ConfigContainer(
        model=provider,
        train=config.TrainingConfig(train_iters=STEPS, global_batch_size=MICRO_BATCH, micro_batch_size=MICRO_BATCH),
        optimizer=config.OptimizerConfig(optimizer="adam", lr=1e-3),
        scheduler=config.SchedulerConfig(),
        dataset=config.MockGPTDatasetConfig(
            seq_length=SEQ, random_seed=1, reset_attention_mask=False, reset_position_ids=False, eod_mask_loss=False
        ),
        logger=config.LoggerConfig(),
        tokenizer=tokenizer.TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        checkpoint=config.CheckpointConfig(),
        rng=config.RNGConfig(),
    )
    container.dataset.skip_getting_attention_mask_from_dataset = False
    state = import_bridge("megatron.bridge.training.state").GlobalState()
    state.cfg = container
    return state


def _train_modelopt(kd_weight: float | None) -> tuple[list[float], list[float], list[float]]:
    """The benchmark's ModelOpt mode on a tiny GPT: each step's lm loss, grad norm and logits KL per token."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_noise_plugin.recipes.common import local_spec_settings
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    gpt_step = import_bridge("megatron.bridge.training.gpt_step")
    settings = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=4,
        vocab_size=VOCAB,
        seq_length=SEQ,
        make_vocab_size_divisible_by=128,
        use_cpu_initialization=True,
        **local_spec_settings(),
    )
    torch.manual_seed(5)
    provider = modelopt_provider(settings, kd_weight=kd_weight)
    provider.finalize()
    groups = ProcessGroupCollection.use_mpu_process_groups()
    provider._pg_collection = provider.teacher._pg_collection = groups
    (model,) = provider.provide_distributed_model(wrap_with_ddp=False, mixed_precision_wrapper=None)
    teacher = model.teacher_model
    assert all(not p.requires_grad for p in teacher.parameters()), "ModelOpt freezes the teacher"
    trained = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trained}.isdisjoint(id(p) for p in teacher.parameters())
    optimizer = torch.optim.Adam(trained, lr=1e-3)
    state, batches = _state(provider), _mock_batches()
    ce, grad_norm, kl = [], [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        output, loss_function = gpt_step.forward_step_modelopt(state, batches, model)
        loss, num_tokens, report = loss_function(output)
        (loss / num_tokens).backward()  # Bridge's schedule: the summed loss over the step's loss-mask tokens
        grad_norm.append(float(torch.nn.utils.clip_grad_norm_(trained, 1.0)))
        optimizer.step()
        ce.append(float(report["lm loss"][0] / report["lm loss"][1]))
        kl.append(float(report["logits distillation loss"][0] / num_tokens))
    return ce, grad_norm, kl


@pytest.fixture(scope="module")
def runs(megatron_cpu):
    # Building Bridge's DistillationProvider sets process-wide environment variables that the later tests'
    # subprocesses (torchrun tasks, the main job) would inherit and fail on: give the environment back afterwards.
    saved = dict(os.environ)
    try:
        return {"fixed": _train_modelopt(1.0), "modelopt_default": _train_modelopt(None)}
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow  # two 40-step trainings of a tiny GPT with its teacher: about 25 s on 2 cores
def test_the_benchmarks_modelopt_mode_trains(runs):
    ce, grad_norm, kl = runs["fixed"]
    check = loss_checks({"modelopt": ce})["modelopt"]
    assert check["trains"], check
    assert check["last_mean"] < 0.75 * check["first_mean"]  # ~5.4 -> ~3.0 nats in 40 steps
    assert max(grad_norm) < 5.0
    assert 0 < kl[0] < 0.1  # the teacher holds the student's start weights: only the noise separates them


@pytest.mark.slow
def test_modelopts_default_balancer_does_not_train_with_a_teacher_equal_to_the_student(runs):
    """The old configuration: the balancer scales the KD term up to the CE's size, i.e. its gradient by CE / KL."""
    ce, grad_norm, kl = runs["modelopt_default"]
    assert not loss_checks({"modelopt": ce})["modelopt"]["trains"]
    assert ce[0] / kl[0] > 100  # the factor the KL's gradient is multiplied by
    fixed_grad_norm = runs["fixed"][1]
    assert min(grad_norm) > 3 * max(fixed_grad_norm)  # ~10 against < 2


def test_loss_checks_needs_a_fall_by_the_margin_over_enough_steps():
    checks = loss_checks(
        {
            "falls": [10.0] * 5 + [6.0] * 5,
            "flat": [10.79] * 5 + [10.74] * 5,
            "short": [10.0, 1.0],
            "nan": [10.0] * 5 + [float("nan")] * 5,
        },
        window=5,
        min_drop=0.1,
    )
    assert {mode: check["trains"] for mode, check in checks.items()} == {
        "falls": True,
        "flat": False,
        "short": False,
        "nan": False,
    }
    assert checks["falls"]["first_mean"] == 10.0 and checks["falls"]["last_mean"] == 6.0


class _FakeRunner:
    """A mode's runner as ``build_modes`` returns it (``MemoryTracked`` around a run with ``losses``)."""

    def __init__(self, losses: list[float]) -> None:
        self.runner = type("Run", (), {"losses": losses})()
        self.transient_bytes = 0

    def steps(self, count: int) -> list[float]:
        return [0.1] * count


@pytest.mark.parametrize("modelopt_trains", [False, True])
def test_the_benchmark_prints_no_ratio_against_a_mode_that_does_not_train(monkeypatch, capsys, modelopt_trains):
    import benchmarks.distillation_step as benchmark

    falls, flat = [10.8] * 5 + [4.0] * 54, [10.79] * 5 + [10.74] * 54
    losses = {"plain": falls, "noise_kd": falls, "modelopt": falls if modelopt_trains else flat}
    monkeypatch.setattr(
        benchmark,
        "build_modes",
        lambda modes, *_: ({m: _FakeRunner(losses[m]) for m in modes}, dict.fromkeys(modes, 1)),
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "fake")
    monkeypatch.setattr("sys.argv", ["distillation_step.py", "--modes", "plain,noise_kd,modelopt", "--repeats", "2"])
    if modelopt_trains:
        benchmark.main()
    else:
        with pytest.raises(SystemExit) as exited:
            benchmark.main()
        assert exited.value.code == 1
    out = capsys.readouterr().out
    assert ("FAILED: modelopt did not train" in out) is not modelopt_trains
    assert ("noise_kd / modelopt: step time" in out) is modelopt_trains
