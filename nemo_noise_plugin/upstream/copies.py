"""The pieces of Megatron-Core 0.19.2 that the plugin copies and changes, in one list.

Megatron-Core offers no hook at these places, so the plugin carries an edited copy of the upstream function.
Each entry names our copy, the upstream original, what the copy changes, and the SHA-256 of the original's source
as megatron-core 0.19.2 ships it. ``tests/upstream/test_upstream_copies.py`` fails when the installed original
differs: then re-read the original, carry its change into our copy, and record the new digest here
(``upstream_source_sha256``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap
from dataclasses import dataclass

__all__ = ["UPSTREAM_COPIES", "UpstreamCopy", "resolve", "upstream_source_sha256"]


@dataclass(frozen=True)
class UpstreamCopy:
    """One function the plugin copied from Megatron-Core and edited."""

    ours: str
    """``module:Qualified.name`` of the plugin's copy."""
    upstream: str
    """``module:Qualified.name`` of the original."""
    change: str
    """What the copy does differently."""
    sha256: str
    """Digest of the original's source (``upstream_source_sha256``) in megatron-core 0.19.2."""


UPSTREAM_COPIES: tuple[UpstreamCopy, ...] = (
    UpstreamCopy(
        ours="nemo_noise_plugin.schedule_plan.builder:PluginSchedulePlanMixin.build_schedule_plan",
        upstream="megatron.core.models.gpt.gpt_model:GPTModel.build_schedule_plan",
        change="builds NoisyModelChunkSchedulePlan (the plugin's nodes) instead of TransformerModelChunkSchedulePlan, "
        "or NoisyHybridModelChunkSchedulePlan for a checked HybridModel, rejects other models, and stores the noise "
        "layer's batch inputs in the plan's chunk state",
        sha256="2236c9121c9eafb8acad5843cd065ab36f0b73696cd1ce67c8da999218179d91",
    ),
    UpstreamCopy(
        ours="nemo_noise_plugin.schedule_plan.nodes:NoisyLayerSchedulePlan._build_callable_nodes",
        upstream="megatron.core.models.common.model_chunk_schedule_plan:"
        "TransformerLayerSchedulePlan._build_callable_nodes",
        change="constructs the class attribute NODE_CLASS (FrozenTolerantLayerNode) where upstream hard-codes "
        "TransformerLayerNode",
        sha256="0a1c20f8415c7468084b7ba2407b937843d7e153808da19a28499120ea81379d",
    ),
    UpstreamCopy(
        ours="nemo_noise_plugin.schedule_plan.hybrid:hybrid_preprocess",
        upstream="megatron.core.models.hybrid.hybrid_model:HybridModel.forward",
        change="the embedding and rotary-embedding part of HybridModel.forward (hybrid_model.py:455-496) as a "
        "_preprocess method, with the noise (add_noise, NoisyHybridModel._preprocess) added to the embedding output",
        sha256="44f9659a4e9c541624e3fb091a7b6abfc8d1bdceb50623fbcd00f8480e1f2810",
    ),
    UpstreamCopy(
        ours="nemo_noise_plugin.schedule_plan.hybrid:hybrid_postprocess",
        upstream="megatron.core.models.hybrid.hybrid_model:HybridModel.forward",
        change="the output-layer and loss part of HybridModel.forward as a _postprocess method for the schedule "
        "plan's post-process node, without its MTP and inference branches, with GPTModel._postprocess's "
        "output_processor call",
        sha256="44f9659a4e9c541624e3fb091a7b6abfc8d1bdceb50623fbcd00f8480e1f2810",
    ),
)


def resolve(path: str) -> object:
    """The object at ``module:Qualified.name``."""
    module_name, _, qualified_name = path.partition(":")
    target: object = importlib.import_module(module_name)
    for part in qualified_name.split("."):
        target = getattr(target, part)
    return target


def upstream_source_sha256(path: str) -> str:
    """SHA-256 of the dedented source of the function at ``path``."""
    source = textwrap.dedent(inspect.getsource(resolve(path)))
    return hashlib.sha256(source.encode()).hexdigest()
