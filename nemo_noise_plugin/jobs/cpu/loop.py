"""A single-process training loop on the CPU for recipes whose model fits one (the tiny recipes).

Bridge's training loop needs CUDA. Without a GPU, this loop drives the recipe's own pieces: its provider and model,
its datasets through Bridge's GPT data pipeline, the plugin's Bridge forward step and loss, and Bridge callbacks
(fired with Bridge's ``CallbackContext`` at the same events, so the progress line and the robustness report are the
same objects as on a GPU). It says what differs: float32 instead of bf16, torch's AdamW instead of Megatron's
optimizer, and Megatron's CUDA-only pieces replaced by the substitutes in ``nemo_noise_plugin.jobs.cpu`` (listed at
start).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from nemo_noise_plugin.jobs.batches import collate, recipe_datasets, setup_tokenizer
from nemo_noise_plugin.jobs.cpu import CPU_SUBSTITUTES, causal_attention_mask, destroy_cpu_parallel, init_cpu_parallel
from nemo_noise_plugin.jobs.cpu.checkpoint import CpuCheckpoint, run_settings, settings_digest
from nemo_noise_plugin.jobs.progress import NonFiniteLossError
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = [
    "CPU_LOOP_NOTICE",
    "CPU_LOOP_PARALLEL_SETTINGS",
    "build_optimizer",
    "check_cpu_loop_settings",
    "run_cpu_loop",
]

CPU_LOOP_NOTICE = (
    "CPU loop (Bridge's training loop needs CUDA): the recipe's provider, model, data pipeline, forward step\n"
    "and loss, driven by a single-process loop; float32 instead of bf16, torch AdamW instead of Megatron's\n"
    "optimizer (with the recipe's gradient clipping and Megatron's learning-rate schedule), every step eager (a\n"
    "CUDA graph, model.cuda_graph_impl, needs a GPU). CPU substitutes in use:"
)


CPU_LOOP_PARALLEL_SETTINGS: dict[str, str] = {
    "tensor_model_parallel_size": "it would train the whole model in one process, ignoring the split",
    "pipeline_model_parallel_size": "it would build and train the first pipeline stage only",
    "virtual_pipeline_model_parallel_size": "it would build the first virtual stage only",
    "context_parallel_size": "it would train whole sequences in one process, ignoring the split",
    "expert_model_parallel_size": "it would hold every expert in one process, ignoring the split",
    "expert_tensor_parallel_size": "it would train whole experts in one process, ignoring the split",
}
"""The model-parallel settings the single-process CPU loop cannot honour, and what it would do instead."""


def check_cpu_loop_settings(config: Any) -> None:
    """Refuse what the CPU loop cannot honour, before any model is built or file written: ``ValueError`` naming the
    setting (``model.pipeline_model_parallel_size=2``), the value and what is allowed.

    The loop trains in one process on Megatron's parallel state of size 1, so any model-parallel size other than 1
    (``CPU_LOOP_PARALLEL_SETTINGS``; ``None`` where Megatron reads it as "not split") would be silently changed.
    """
    model = config.model
    for name, instead in CPU_LOOP_PARALLEL_SETTINGS.items():
        value = getattr(model, name, None)
        if value is not None and value != 1:
            raise ValueError(
                f"model.{name}={value!r} is invalid on the CPU loop (no GPU here): expected 1, since the loop trains "
                f"in one process and {instead}; set model.{name}=1, or run on GPUs (Bridge's loop)."
            )


def run_cpu_loop(config: Any, forward_step: Callable, callbacks: Sequence[Any] = ()) -> None:
    """Train ``config`` (a ``ConfigContainer`` whose model fits one CPU process) with ``forward_step``.

    Steps, optimizer settings and seed are the config's (``train.train_iters``, ``rng.seed``): torch's AdamW with
    ``optimizer.lr``/``adam_beta1``/``adam_beta2``/``adam_eps``, gradients clipped to ``optimizer.clip_grad`` (global
    norm; 0 turns it off), and the learning rate and weight decay set every step by Megatron's own
    ``OptimizerParamScheduler`` built from ``scheduler`` as Bridge builds it (warm-up ``lr_warmup_iters``, decay
    style, ``min_lr``), stepped after each optimizer step as Bridge's loop does.
    ``callbacks`` (Bridge ``Callback`` objects) see ``on_train_start``, ``on_train_step_start``/``_end`` (with the
    step's ``loss_dict``) and ``on_train_end``.

    Checkpoints as Bridge's loop keeps them, in the loop's own format (``jobs.cpu.checkpoint``): saved into
    ``checkpoint.save`` every ``checkpoint.save_interval`` iterations, at ``train.exit_interval`` (where the run then
    stops, without ``on_train_end``, as Bridge's does) and at the end; a run whose settings match a checkpoint in
    ``checkpoint.load`` resumes from it, with the same noise and batches as an uninterrupted run.

    Model-parallel settings other than 1 are refused first (``check_cpu_loop_settings``). A model built for a
    full-iteration CUDA graph (replayable noise keys) gets its keys published before every step, as the launchers'
    ``PublishNoiseStep`` does on a GPU (added when ``callbacks`` has none).
    """
    check_cpu_loop_settings(config)
    from nemo_noise_plugin.training.noise_step_publisher import PublishNoiseStep

    if not any(isinstance(callback, PublishNoiseStep) for callback in callbacks):
        callbacks = [PublishNoiseStep(), *callbacks]  # a model built for a step graph keeps its keys in tensors
    print(CPU_LOOP_NOTICE)
    for name, role in CPU_SUBSTITUTES.items():
        print(f"  - {name}: {role}")
    joined_a_process_group = torch.distributed.is_initialized()  # a caller's (e.g. a test session's): keep it
    # Megatron pins the attention backend process-wide through NVTE_* variables and refuses a model whose backend
    # disagrees with them: build this one from a clean slate and give the caller its variables back afterwards.
    attention_settings = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("NVTE_")}
    settings = run_settings(config)  # before building the model, which fills in derived settings
    init_cpu_parallel(seed=config.rng.seed)
    try:
        _train(config, forward_step, callbacks, settings)
    finally:
        from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

        destroy_num_microbatches_calculator()
        if not joined_a_process_group:
            destroy_cpu_parallel()
        _restore_attention_settings(attention_settings)


def _restore_attention_settings(saved: dict[str, str]) -> None:
    """Undo the ``NVTE_*`` variables Megatron sets process-wide for the model's attention backend, so models built
    later in the caller's process (with another backend) are not refused."""
    for name in [name for name in os.environ if name.startswith("NVTE_")]:
        if name not in saved:
            del os.environ[name]
    os.environ.update(saved)


def _build_model(state: Any) -> torch.nn.Module:
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = state.cfg
    provider = config.model
    provider.bf16, provider.params_dtype, provider.pipeline_dtype = False, torch.float32, torch.float32
    config.dataset.skip_getting_attention_mask_from_dataset = False  # the CPU needs an explicit causal mask
    setup_tokenizer(state)  # as Bridge's setup() leaves the tokenizer and config.dataset
    config.dataset.finalize()
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(config.rng.seed)
    return provider.provide_distributed_model(
        use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
    )[0]


def _train(config: Any, forward_step: Callable, callbacks: Sequence[Any], settings: dict[str, Any]) -> None:
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    bridge_callbacks = import_bridge("megatron.bridge.training.callbacks")
    train = config.train
    micro_batches = train.global_batch_size // train.micro_batch_size
    init_num_microbatches_calculator(0, None, train.global_batch_size, train.micro_batch_size, 1)
    state = import_bridge("megatron.bridge.training.state").GlobalState()
    state.cfg = config
    model = _build_model(state)
    train_set, _, _ = recipe_datasets(state, train.train_iters * train.global_batch_size, 0)
    manager = bridge_callbacks.CallbackManager()
    manager.add(list(callbacks))

    def fire(event: str, **extra: Any) -> None:
        manager.fire(
            event, bridge_callbacks.CallbackContext(state=state, model=[model], user_state=manager.user_state, **extra)
        )

    mask = causal_attention_mask(config.model.seq_length)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(config, parameters)
    checkpoint = CpuCheckpoint(config.checkpoint.save, config.checkpoint.load, settings_digest(settings), settings)
    first_step = _resume(checkpoint, model, optimizer, scheduler, manager.user_state, train.train_iters)
    state.train_state.step = first_step
    state.train_state.consumed_train_samples = first_step * train.global_batch_size
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters ({type(model).__name__});")
    print(f"noise: {_non_default(config.model.noise)}; {micro_batches} microbatches of {train.micro_batch_size}")
    fire("on_train_start", optimizer=optimizer, scheduler=scheduler)
    model.train()

    def save(iteration: int) -> None:
        state_dict = {
            "iteration": iteration,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "model_parallel_rng": get_cuda_rng_tracker().get_states(),  # dropout inside TP regions
            "user_state": dict(manager.user_state),
        }
        checkpoint.save(state_dict)

    interval = config.checkpoint.save_interval or 0
    for step in range(first_step, train.train_iters):
        state.train_state.step = step
        fire("on_train_step_start")
        optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        start = step * train.global_batch_size
        for batch in collate(train_set, micro_batches, train.micro_batch_size, mask, "cpu", start):
            output, loss_function = forward_step(state, iter([batch]), model)
            loss_sum, num_tokens, report = _checked_loss(loss_function, output, step)
            (loss_sum / num_tokens / micro_batches).backward()
            for key, value in report.items():
                totals[key] = totals.get(key, 0) + value.detach()
        if config.optimizer.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(parameters, config.optimizer.clip_grad)
        optimizer.step()
        scheduler.step(increment=train.global_batch_size)
        fire("on_train_step_end", loss_dict={key: value[0] / value[1] for key, value in totals.items()})
        done = step + 1  # Bridge counts the iteration after its step-end event
        state.train_state.step = done
        state.train_state.consumed_train_samples = done * train.global_batch_size
        stop_here = train.exit_interval is not None and done % train.exit_interval == 0 and done < train.train_iters
        if (interval and done % interval == 0) or stop_here or done == train.train_iters:
            save(done)
        if stop_here:
            print(f"stopped at iteration {done} (train.exit_interval); the same settings resume from {checkpoint.name}")
            return
    fire("on_train_end")  # train_state.step is train_iters here: set by the last iteration, or by the resume


def _resume(
    checkpoint: CpuCheckpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    user_state: dict,
    train_iters: int,
) -> int:
    """Load this configuration's saved state, if any, into the loop's objects; returns the first iteration to run."""
    try:
        saved = checkpoint.load()
        if saved is None:
            others = checkpoint.others()
            if others is not None:
                print(f"no checkpoint of these settings: {others}; training these from iteration 0")
            if checkpoint.save_path is not None:
                print(f"checkpoint: {checkpoint.save_path} (the same settings resume from it)")
            return 0
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["torch_rng"])
        get_cuda_rng_tracker().set_states(saved["model_parallel_rng"])
        user_state.update(saved["user_state"])
        iteration = int(saved["iteration"])
    except (OSError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as error:
        reason = " ".join(str(error).split())[:300]
        raise ValueError(
            f"checkpoint {checkpoint.load_path} cannot be resumed from ({type(error).__name__}: {reason}); it is kept "
            "as it is: move or delete it to train these settings from the start."
        ) from None
    print(f"resumed from {checkpoint.load_path} at iteration {iteration} of {train_iters}")
    return iteration


def build_optimizer(config: Any, parameters: Sequence[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, Any]:
    """Torch AdamW and Megatron's ``OptimizerParamScheduler`` for ``config`` (its ``optimizer`` and ``scheduler``).

    The scheduler is the one Bridge's loop uses (``megatron.bridge.training.optim``), with the steps Bridge derives
    from ``train`` (``ConfigContainer``'s scheduler-step calculation: samples, i.e. iterations x global batch);
    constructing it sets the learning rate of iteration 0 (``lr_warmup_init`` when warming up).
    """
    optim = import_bridge("megatron.bridge.training.optim")
    settings = config.optimizer
    optimizer = torch.optim.AdamW(
        list(parameters),
        lr=settings.lr,
        betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_eps,
        weight_decay=settings.weight_decay,
    )
    schedule = config.scheduler
    if schedule.start_weight_decay is None:
        schedule.start_weight_decay = settings.weight_decay
    if schedule.end_weight_decay is None:
        schedule.end_weight_decay = settings.weight_decay
    config._calculate_scheduler_steps()
    return optimizer, optim._get_scheduler(settings, schedule, optimizer)


def _checked_loss(loss_function: Callable, output: Any, step: int) -> Any:
    """The step's loss; Megatron's NaN/Inf check in the loss (its rerun state machine) becomes
    ``NonFiniteLossError`` naming this loop's step (the machine's own iteration counter is not kept here)."""
    try:
        return loss_function(output)
    except RuntimeError as error:
        if "Unexpected result" not in str(error):
            raise
        reason = str(error).rpartition("message=")[2].strip("')") or "a non-finite loss"
        raise NonFiniteLossError(
            f"step {step + 1}: {reason}; training stopped (check the learning rate and the noise / KD settings)."
        ) from None


def _non_default(config: NoiseConfig) -> str:
    """The fields that differ from their declared defaults (read off the fields: no second config is built)."""
    changed = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != (f.default_factory() if f.default is dataclasses.MISSING else f.default)
    }
    return f"{type(config).__name__}({', '.join(f'{k}={v!r}' for k, v in changed.items())})"
