"""Run a Megatron-Bridge ``ConfigContainer`` with the plugin's forward step: Bridge's training loop, or the CPU loop.

The launcher behind ``nemo llm finetune`` and the main job (``jobs.main_job``), and usable from Python::

    from nemo_noise_plugin.jobs.launch.launcher import launch
    from nemo_noise_plugin.recipes import tiny_noise_sft_config

    if __name__ == "__main__":  # Bridge's checkpoint-save workers re-import the launching script
        launch(tiny_noise_sft_config(), ["train.train_iters=100", "model.noise.alpha=10"])

It decides three things from the config, so a recipe only has to return one:

- the overrides: Megatron-Bridge's Hydra path with the plugin's settings re-validated
  (``training.overrides.apply_overrides``): ``key=value`` sets a field, ``+key=value`` adds a key (inside
  dict-valued fields such as ``env_vars``), ``~key`` deletes one (a dataclass field goes back to its default);
- the forward step: ``distillation_forward_step`` for a distillation provider (GPT or hybrid), else
  ``noise_forward_step``;
- the entry: Bridge's ``finetune`` when ``checkpoint.pretrained_checkpoint`` names weights to start from, else
  ``pretrain`` (the tiny recipes train from scratch on the embedded corpus; both resume from ``checkpoint.load``).

Bridge's loop needs a GPU. Without one, ``launch`` runs the CPU loop when the caller allows it (recipes on the
embedded corpus), else raises ``GPUUnavailableError`` before it imports Bridge or writes anything.

Before either loop starts, ``check_run_settings`` turns the mistakes that Megatron would find only after start-up
(or, for the checkpoint folder, after training) into one ``ValueError`` naming the setting: a ``checkpoint.save``
that cannot be written, a micro batch that does not divide the global batch, a sequence length that differs from the
dataset's. A dataset path with spaces (a run folder such as ``/tmp/my runs``) is kept whole: Bridge splits a
``data_path`` string at whitespace into several datasets. ``saved_checkpoints`` says which checkpoints this process's
runs have on disk (what an interrupt leaves).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_noise_plugin.upstream.bridge_imports import import_bridge, use_prebuilt_dataset_helpers
from nemo_noise_plugin.validation import SettingError, check_int

__all__ = [
    "GPU_REQUIRED_MESSAGE",
    "GPUUnavailableError",
    "check_bridge_resume",
    "check_run_settings",
    "check_torchrun_ranks",
    "forward_step_for",
    "launch",
    "require_gpu",
    "saved_checkpoints",
    "training_entry_for",
]

GPU_REQUIRED_MESSAGE = (
    "Bridge's training loop needs a GPU; use --dryrun/--to-yaml, or `python -m nemo_noise_plugin` for the CPU main job"
)


class GPUUnavailableError(RuntimeError):
    """Raised by ``launch`` on a machine where CUDA is not available, before anything else happens."""


def cuda_available() -> bool:
    """Whether a CUDA device is available (the only CUDA call made before Bridge or the CPU loop starts)."""
    import torch

    return torch.cuda.is_available()


def require_gpu() -> None:
    """Raise ``GPUUnavailableError`` unless CUDA is available."""
    if not cuda_available():
        raise GPUUnavailableError(GPU_REQUIRED_MESSAGE)


def check_torchrun_ranks(*, cpu_loop: bool) -> None:
    """Under torchrun on a machine without a GPU: ``SettingError`` naming ``--nproc-per-node`` (or ``--nnodes``)
    before anything heavy is imported. Bridge's loop needs a GPU per rank and the CPU loop runs in one process, so
    each rank would otherwise import the whole stack only to fail (a few minutes on a small machine)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or cuda_available():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    setting, value = ("torchrun --nproc-per-node", local) if local > 1 else ("torchrun --nnodes", world)
    runs = "the CPU loop runs in one process: run the command without torchrun" if cpu_loop else GPU_REQUIRED_MESSAGE
    raise SettingError(setting, value, "a GPU per rank", why=f": this machine has no GPU; {runs}")


_BRIDGE_SAVE_FOLDERS: list[Path] = []
"""``checkpoint.save`` of the runs this process started in Bridge's loop (``saved_checkpoints`` looks there)."""


def saved_checkpoints() -> list[str]:
    """The checkpoints of this process's runs that exist on disk now: CPU-loop state files, Bridge's folders.
    Imports nothing (it answers an interrupt, which may come during an import): without the CPU loop's checkpoint
    module no CPU state was opened."""
    cpu = sys.modules.get("nemo_noise_plugin.jobs.cpu.checkpoint")
    found = [str(path) for path in cpu.CpuCheckpoint.on_disk()] if hasattr(cpu, "CpuCheckpoint") else []
    for folder in _BRIDGE_SAVE_FOLDERS:
        tracker = folder / "latest_checkpointed_iteration.txt"  # Bridge writes it after a complete save
        if tracker.is_file():
            found.append(f"{folder} (iteration {tracker.read_text().strip()})")
    return found


BRIDGE_RESUME_SETTINGS = ("model.noise.", "model.kd.", "rng.seed")
"""The settings a Bridge checkpoint's ``run_config.yaml`` must agree on with a run that resumes from it: the plugin's
own (noise, KD) and the seed, which Bridge's set-up leaves as they were given."""
BRIDGE_RESUME_SHAPE = (
    *(f"model.{name}" for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")),
    *(f"model.{name}" for name in ("num_query_groups", "kv_channels", "seq_length", "vocab_size")),
    *(f"dataset.{name}" for name in ("data_path", "blend", "dataset_root", "split", "seq_length", "random_seed")),
    "tokenizer.tokenizer_model",
    "tokenizer.vocab_size",
)
"""The model's shape and the data a checkpoint was trained on, compared where both the checkpoint and this run set
them: Bridge's set-up fills in what a recipe leaves unset (``kv_channels``, the data ``blend``), so a field unset on
either side says nothing. Its other derived fields (init methods, dtypes) are not compared."""


def _by_last_part(value: Any) -> Any:
    """Paths by their last part, also inside lists (Bridge's ``blend``: ``[[path, ...], weights]``)."""
    if isinstance(value, list):
        return [_by_last_part(item) for item in value]
    return os.path.basename(value.rstrip("/")) or value if isinstance(value, str) and "/" in value else value


def check_bridge_resume(config: Any) -> None:
    """``CheckpointMismatchError`` naming each difference when ``checkpoint.load`` holds a Bridge checkpoint (its
    tracker names an iteration) whose ``run_config.yaml`` records other ``BRIDGE_RESUME_SETTINGS`` or another model
    shape or data (``BRIDGE_RESUME_SHAPE``): Bridge would resume from it whatever it was trained with. Paths count
    by their last part, so a moved folder resumes."""
    import yaml

    from nemo_noise_plugin.jobs.cpu.checkpoint import CheckpointMismatchError, run_settings, setting_differences

    load = config.checkpoint.load
    tracker = Path(load) / "latest_checkpointed_iteration.txt" if load else None
    if tracker is None or not tracker.is_file():
        return
    iteration = tracker.read_text().strip()
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}" if iteration.isdigit() else None
    recorded = Path(load) / name / "run_config.yaml" if name else None
    if recorded is None or not recorded.is_file():
        return
    with open(recorded, encoding="utf-8") as stream:
        saved = run_settings(yaml.safe_load(stream) or {})
    current = run_settings(config)

    both = {key for key in BRIDGE_RESUME_SHAPE if saved.get(key) is not None and current.get(key) is not None}

    def chosen(settings: dict[str, Any]) -> dict[str, Any]:
        return {
            key: _by_last_part(value)
            for key, value in settings.items()
            if key.startswith(BRIDGE_RESUME_SETTINGS) or key in both
        }

    differences = setting_differences(chosen(saved), chosen(current))
    if differences:
        raise CheckpointMismatchError(
            f"checkpoint {load} (iteration {iteration}) was saved by other settings: {differences}; it is kept: "
            "rerun with its settings to resume it, or train these in another folder (--output-dir, or "
            "checkpoint.save and checkpoint.load)."
        )


def check_run_settings(
    config: Any, *, world_size: int | None = None, dry: bool = False, folders_here: bool = True
) -> None:
    """Check what Megatron would find only after start-up, and a noise level the model's build would refuse (its
    noise overflows the dtype: ``noise.bounds``); ``ValueError`` naming the setting, the value and what is
    allowed. Creates ``checkpoint.save`` (checked writable) and keeps a dataset path with spaces whole.

    A dry run or a launcher checks the same settings: ``world_size`` is the run's number of ranks (default:
    ``WORLD_SIZE``, 1 outside torchrun), ``dry`` creates nothing (``checkpoint.save`` must be creatable and
    writable), and ``folders_here=False`` skips the folder checks when the run's folders are on the cluster or
    container side (a remote executor's paths do not exist on this machine).
    """

    from nemo_noise_plugin.jobs.reports.artifacts import check_output_dir
    from nemo_noise_plugin.recipes.common import check_fixed_width_batches, check_graph_memory_pools

    if config.checkpoint.save and folders_here:
        check_output_dir(config.checkpoint.save, "checkpoint.save", create=not dry)
    train, model = config.train, config.model
    parallel = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        parallel *= getattr(model, name, 1) or 1
    ranks = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    data_parallel = max(1, ranks // parallel)
    micro, global_batch = train.micro_batch_size, train.global_batch_size
    if not _positive_int(micro):
        raise ValueError(f"train.micro_batch_size={micro!r} is invalid: expected an integer >= 1.")
    if global_batch is not None:
        if not _positive_int(global_batch):
            raise ValueError(f"train.global_batch_size={global_batch!r} is invalid: expected an integer >= 1.")
        if global_batch % (micro * data_parallel):
            per_rank = global_batch // data_parallel if global_batch % data_parallel == 0 else None
            allowed = [n for n in range(1, per_rank + 1) if per_rank % n == 0] if per_rank else []
            raise ValueError(
                f"train.micro_batch_size={micro} is invalid with train.global_batch_size={global_batch} and "
                f"{data_parallel} data-parallel rank(s): the global batch must be a multiple of micro batch x ranks; "
                f"expected one of {', '.join(map(str, allowed)) or 'none: change train.global_batch_size'}."
            )
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        size = getattr(model, name, None)
        if size is not None and not _positive_int(size):  # 0 layers trained nothing, then divided by zero
            raise ValueError(f"model.{name}={size!r} is invalid: expected an integer >= 1.")
    _check_sizes(config)
    check_fixed_width_batches(config)
    check_graph_memory_pools(config)
    noise = getattr(model, "noise", None)
    if noise is not None and _positive_int(getattr(model, "hidden_size", None)):  # what the model's build refuses
        from nemo_noise_plugin.noise.bounds import check_noise_fits

        check_noise_fits(noise, model.hidden_size, getattr(model, "params_dtype", None))
    seq_length = getattr(model, "seq_length", None)
    if seq_length is not None and not _positive_int(seq_length):
        raise ValueError(f"model.seq_length={seq_length!r} is invalid: expected an integer >= 1.")
    dataset = config.dataset
    data_length = getattr(dataset, "seq_length", None)
    if data_length is not None and not _positive_int(data_length):
        raise ValueError(f"dataset.seq_length={data_length!r} is invalid: expected an integer >= 1.")
    if seq_length is not None and data_length is not None and seq_length != data_length:
        raise ValueError(
            f"model.seq_length={seq_length} is invalid: expected dataset.seq_length={data_length} (the model and its "
            f"data must agree; set both, e.g. model.seq_length={data_length} or also dataset.seq_length={seq_length})."
        )
    path = getattr(dataset, "data_path", None)
    if isinstance(path, str) and len(path.split()) > 1 and os.path.isfile(path + ".idx"):  # one dataset, not several
        dataset.data_path = [path]
        if getattr(dataset, "blend", None) == (path.split(), None):
            dataset.blend = None


_INT64_MAX = 2**63 - 1


def _check_sizes(config: Any) -> None:
    """The sizes Megatron takes without a check and then misuses: steps, the checkpoint interval, the attention
    heads' width and the KD top-k (``SettingError`` naming the setting)."""
    train, model = config.train, config.model
    iters, batch = train.train_iters, train.global_batch_size
    if iters is not None:
        limit = _INT64_MAX // batch if _positive_int(batch) else _INT64_MAX
        check_int(
            "train.train_iters", iters, minimum=1, maximum=limit, why=_SAMPLES_WHY if _positive_int(batch) else ""
        )
    interval = config.checkpoint.save_interval
    if interval is not None:
        check_int("checkpoint.save_interval", interval, minimum=0, optional=True, why=" (0 or null: no periodic save)")
    hidden, heads = getattr(model, "hidden_size", None), getattr(model, "num_attention_heads", None)
    if (
        _positive_int(hidden)
        and _positive_int(heads)
        and getattr(model, "kv_channels", None) is None
        and hidden % heads
    ):
        raise SettingError(
            "model.hidden_size",
            hidden,
            f"a multiple of model.num_attention_heads={heads} (e.g. {hidden // heads * heads or heads}), or "
            "model.kv_channels set to the width of one head",
            why=": each head gets hidden_size / num_attention_heads channels",
        )
    kd, vocab = getattr(model, "kd", None), getattr(model, "vocab_size", None)
    top_k = getattr(kd, "top_k", None)
    if getattr(kd, "enabled", False) and _positive_int(top_k) and _positive_int(vocab) and top_k > vocab:
        raise SettingError(
            "model.kd.top_k",
            top_k,
            f"an integer in [1, {vocab}] (or null for the whole vocabulary)",
            context=f" with model.vocab_size={vocab}",
            why=": the teacher has only that many tokens to rank",
        )


_SAMPLES_WHY = " (iterations x train.global_batch_size must fit Megatron's int64 sample counters)"


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def forward_step_for(config: Any) -> Callable:
    """The plugin's forward step for ``config.model``: distillation for a distillation provider
    (``NoisyDistillationProvider``, ``NoisyHybridDistillationProvider``), else noise."""
    from nemo_noise_plugin.providers import DISTILLATION_PROVIDERS
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step

    return distillation_forward_step if isinstance(config.model, DISTILLATION_PROVIDERS) else noise_forward_step


def training_entry_for(config: Any) -> Callable:
    """Bridge's ``finetune`` when ``checkpoint.pretrained_checkpoint`` is set, else ``pretrain``."""
    if config.checkpoint.pretrained_checkpoint is not None:
        return import_bridge("megatron.bridge.training.finetune").finetune
    return import_bridge("megatron.bridge.training.pretrain").pretrain


def launch(
    config: Any,
    overrides: Sequence[str] = (),
    *,
    forward_step: Callable | None = None,
    callbacks: Sequence[Any] | None = None,
    allow_cpu_loop: bool = False,
) -> None:
    """Train ``config`` (after ``overrides``) with the plugin's forward step and Bridge ``callbacks``.

    With a GPU: Bridge's real loop (``training_entry_for(config)``), after letting Bridge use megatron-core's prebuilt
    dataset helper (``use_prebuilt_dataset_helpers``); under ``torchrun`` every rank calls this. Without one: the CPU
    loop (``jobs.cpu.loop``) when ``allow_cpu_loop``, else ``GPUUnavailableError`` before anything else happens.
    ``forward_step`` defaults to ``forward_step_for(config)``. The overrides are checked as they are applied, the run
    settings Bridge leaves to training time next (``validate_plugin_settings``), and an assignment made in Python to
    ``config.model.noise``/``kd`` at the provider's ``finalize`` (Bridge's ``ConfigContainer.validate``, or the CPU
    loop's build); ``FiniteLossGuard`` stops a run whose loss is not finite.
    Under the plugin's commands Bridge's console output goes to the run folder's ``bridge.log``
    (``jobs.launch.bridge_console.bridge_output``), the callbacks' lines to the console.

    Args:
        config: Bridge's ``ConfigContainer``, e.g. a recipe's (``smollm2_135m_noise_sft_config()``).
        overrides: Hydra-style ``key=value`` settings applied first (``model.noise.alpha=10``).
        forward_step: the forward step; None picks ``noise_forward_step`` or ``distillation_forward_step``.
        callbacks: Bridge callbacks (``jobs.reports.callbacks`` builds the report callbacks a recipe names).
        allow_cpu_loop: without a GPU, train on the plugin's single-process CPU loop instead of refusing.

    Raises:
        GPUUnavailableError: no GPU and ``allow_cpu_loop`` is False.
        ValueError: a setting that cannot work (the message names it), before any folder is created.

    Example::

        launch(tiny_noise_sft_config(), ["train.train_iters=20", "model.noise.alpha=10"], allow_cpu_loop=True)
    """
    from nemo_noise_plugin.jobs.progress import FiniteLossGuard
    from nemo_noise_plugin.training.noise_step_publisher import PublishNoiseStep
    from nemo_noise_plugin.training.overrides import apply_overrides, validate_plugin_settings

    on_gpu = cuda_available()
    if not on_gpu and not allow_cpu_loop:
        raise GPUUnavailableError(GPU_REQUIRED_MESSAGE)
    config = apply_overrides(config, list(overrides))
    validate_plugin_settings(config)
    if not on_gpu:  # the CPU loop's refusals come before check_run_settings creates the checkpoint folder
        from nemo_noise_plugin.jobs.cpu.loop import check_cpu_loop_settings

        check_cpu_loop_settings(config)
    check_run_settings(config)
    step = forward_step or forward_step_for(config)
    callbacks = [PublishNoiseStep(), *(callbacks or []), FiniteLossGuard()]  # the keys first: a graph replays them
    if not on_gpu:
        from nemo_noise_plugin.jobs.cpu.loop import run_cpu_loop

        run_cpu_loop(config, step, callbacks)
        return
    from nemo_noise_plugin.jobs.launch.bridge_console import bridge_output, on_console

    check_bridge_resume(config)
    use_prebuilt_dataset_helpers()
    if config.checkpoint.save:
        _BRIDGE_SAVE_FOLDERS.append(Path(config.checkpoint.save))
    with bridge_output(config):  # the plugin's commands: Bridge's console output to the run folder's bridge.log
        training_entry_for(config)(config, step, callbacks=on_console(callbacks))
