"""The private names of Megatron-Core 0.19.2, Megatron-Bridge 0.6.2 and NeMo-Run that the plugin uses, in one list.

Upstream may rename or drop a name that starts with an underscore in any release, without notice. Each entry says
where the plugin uses it and why no public name does the job. ``tests/upstream/test_upstream_private_names.py`` fails
when an entry no longer resolves in the installed packages (re-read upstream, then change the plugin and this list), and
when the package uses a private upstream name that is not listed here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRIVATE_UPSTREAM_NAMES", "PrivateUpstreamName"]


@dataclass(frozen=True)
class PrivateUpstreamName:
    """One private upstream name the plugin relies on."""

    name: str
    """``module:name`` or ``module:Class.name`` in the installed upstream package."""
    used_by: str
    """The plugin module that uses it."""
    why: str
    """What it is used for, and why no public name does it."""
    instance_attribute: bool = False
    """A field set on instances (a dataclass field or assigned ``self.<name>`` in the class), not a class member."""


_GPT_STEP = "megatron.bridge.training.gpt_step"
_CHECKPOINTING = "megatron.bridge.training.checkpointing"
_RANDOM = "megatron.core.tensor_parallel.random"

PRIVATE_UPSTREAM_NAMES: tuple[PrivateUpstreamName, ...] = (
    PrivateUpstreamName(
        f"{_GPT_STEP}:_forward_step_common",
        "nemo_noise_plugin.training.forward_step",
        "the batch -> model -> (output, loss mask) part of Bridge's forward_step, reused so the noisy and distillation "
        "steps read batches exactly as Bridge does",
    ),
    PrivateUpstreamName(
        f"{_GPT_STEP}:_create_loss_function",
        "nemo_noise_plugin.training.forward_step",
        "Bridge's masked LM loss closure (token normalisation, CP reduction), so the noisy step's loss is Bridge's",
    ),
    PrivateUpstreamName(
        f"{_GPT_STEP}:_has_packed_sequence_metadata",
        "nemo_noise_plugin.training.forward_step",
        "whether a batch is packed (THD), to partition its loss mask under context parallelism as Bridge does",
    ),
    PrivateUpstreamName(
        f"{_GPT_STEP}:_partition_packed_batch_for_cp",
        "nemo_noise_plugin.training.forward_step",
        "the CP partition of a packed batch, so the noise's loss mask matches the rank's tokens",
    ),
    PrivateUpstreamName(
        f"{_CHECKPOINTING}:_build_auto_bridge_for_save",
        "nemo_noise_plugin.distillation.teacher_weights",
        "the AutoBridge Bridge itself builds to read an HF folder as a teacher checkpoint",
    ),
    PrivateUpstreamName(
        f"{_CHECKPOINTING}:_load_model_weights_from_checkpoint",
        "nemo_noise_plugin.distillation.teacher_weights",
        "loads a Megatron checkpoint's weights into the teacher only (no optimizer, no iteration); the public "
        "load_checkpoint loads the whole training state into the student",
    ),
    PrivateUpstreamName(
        f"{_CHECKPOINTING}:_resolve_checkpoint_iteration",
        "nemo_noise_plugin.distillation.teacher_weights",
        "the latest (or release) iteration folder of a teacher checkpoint, as Bridge resolves it",
    ),
    PrivateUpstreamName(
        "megatron.bridge.training.optim:_get_scheduler",
        "nemo_noise_plugin.jobs.cpu.loop",
        "the CPU loop builds Bridge's own LR scheduler for its optimizer (setup_optimizer also builds a CUDA-only "
        "optimizer)",
    ),
    PrivateUpstreamName(
        "megatron.bridge.training.config:ConfigContainer._calculate_scheduler_steps",
        "nemo_noise_plugin.jobs.cpu.loop",
        "the scheduler's step counts that ConfigContainer.validate() would fill in (the CPU loop cannot run the "
        "CUDA parts of validate)",
    ),
    PrivateUpstreamName(
        "megatron.bridge.models.gpt_provider:GPTModelProvider._pg_collection",
        "nemo_noise_plugin.jobs.cpu.loop",
        "the process groups Bridge's setup() hands the provider before provide(); the CPU loop repeats that step",
        instance_attribute=True,
    ),
    PrivateUpstreamName(
        "megatron.core.models.common.utils.TransformerLayerNode:_resolve_free_input",
        "nemo_noise_plugin.schedule_plan.nodes",
        "which of a layer node's inputs the schedule plan frees after its forward; the plugin's node keeps the MoE "
        "dispatch/combine inputs on a single-rank all-to-all and defers to upstream otherwise",
    ),
    PrivateUpstreamName(
        "megatron.core.num_microbatches_calculator:_GLOBAL_NUM_MICROBATCHES_CALCULATOR",
        "nemo_noise_plugin.noise.schedule",
        "whether Megatron's microbatch calculator is initialised (its public getter raises when it is not)",
    ),
    PrivateUpstreamName(
        f"{_RANDOM}:_CUDA_RNG_STATE_TRACKER",
        "nemo_noise_plugin.jobs.cpu.substitutes",
        "the CPU loop's RNG tracker substitute (jobs.cpu.substitutes) replaces Megatron's CUDA-only tracker",
    ),
    PrivateUpstreamName(
        f"{_RANDOM}:_CUDA_RNG_STATE_TRACKER_INITIALIZED",
        "nemo_noise_plugin.jobs.cpu.substitutes",
        "marks the substituted tracker as initialised, as Megatron's own initialisation does",
    ),
    PrivateUpstreamName(
        f"{_RANDOM}:_get_cuda_rng_state",
        "nemo_noise_plugin.jobs.cpu.substitutes",
        "replaced on CPU so activation recompute replays the CPU generator's state",
    ),
    PrivateUpstreamName(
        f"{_RANDOM}:_set_cuda_rng_state",
        "nemo_noise_plugin.jobs.cpu.substitutes",
        "replaced on CPU so activation recompute replays the CPU generator's state",
    ),
    PrivateUpstreamName(
        "nemo_run.cli.api:_is_torchrun",
        "nemo_noise_plugin.cli.nemo_llm",
        "NeMo-Run's own test for running under torchrun, so the nemo command behaves as NeMo-Run's commands do",
    ),
    PrivateUpstreamName(
        "megatron.bridge.data.utils:_REGISTRY",
        "nemo_noise_plugin.data.span_dataset",
        "Bridge's dataset-config -> provider table (first isinstance match wins); PrivateSpanSFTDatasetConfig, a "
        "GPTSFTDatasetConfig subclass, is put in front of its base so Bridge's loop builds the private-span datasets "
        "(get_dataset_provider offers no registration call)",
    ),
)
