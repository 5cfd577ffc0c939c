"""When a noisy model adds its noise where the embedding rows are looked up, in one pass over the output.

Megatron-Core's ``LanguageModelEmbedding`` makes the decoder input in three passes (the lookup into ``[b, s, h]``, a
transposed copy into ``[s, b, h]``, dropout) and the noise layer adds a fourth. When that embedding reduces to the
lookup alone, the noisy model instead hands ``GPTModel._preprocess`` a decoder input made by
``EmbeddingNoise.noised_lookup``: one kernel reading the table's rows and writing the noised ``[s, b, h]`` output
(``noise.fused_noise.fused_gather_add_noise``; on the CPU the lookup and ``add_noise_reference``). The values, the
noise bits and the table's gradient are those of the unfused path.

``lookup_fusion_blocker`` says why it cannot (None: it can). Every condition keeps the fused path equal to the
unfused one: the vocabulary on one rank (no tensor parallelism, whose partial lookups are summed before the noise),
no sequence-parallel scatter, no learned position or token-type embeddings, no MuP multiplier or fp32 residual cast,
dropout off (the noise comes after it), Megatron's plain (non-deterministic-mode) lookup, a mechanism whose noise is
independent of the embedding values (no clipping, not relative), no projection, and no inference context.
"""

from __future__ import annotations

from typing import Any

from megatron.core.inference.utils import InferenceMode
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

from nemo_noise_plugin.noise.mechanisms import noise_independent_of_input
from nemo_noise_plugin.utils import group_size

__all__ = ["lookup_fusion_blocker"]


def _embedding_blocker(embedding: Any, training: bool) -> str | None:
    """Why ``embedding``'s forward is more than the lookup moved to ``[s, b, h]`` (None: it is exactly that)."""
    if type(embedding).forward is not LanguageModelEmbedding.forward:
        return f"the embedding is a {type(embedding).__name__}, not Megatron-Core's LanguageModelEmbedding"
    word = embedding.word_embeddings
    if type(word).forward is not VocabParallelEmbedding.forward:
        return f"the word embedding is a {type(word).__name__}, not Megatron-Core's VocabParallelEmbedding"
    config = embedding.config
    blockers = {
        "the vocabulary is split over tensor-parallel ranks": group_size(getattr(word, "tp_group", None)) > 1,
        "sequence parallelism scatters the embedding output": bool(config.sequence_parallel),
        "the lookup reduce-scatters its output": bool(getattr(word, "reduce_scatter_embeddings", False)),
        "the lookup runs in deterministic mode (an index, not F.embedding)": bool(word.deterministic_mode),
        "the embedding table is rematerialised (gtp_remat_size > 1)": getattr(word, "gtp_remat_size", 1) > 1,
        "learned position embeddings are added": bool(embedding.add_position_embedding),
        "token-type embeddings are added": embedding.tokentype_embeddings is not None,
        "a MuP embedding multiplier is applied": bool(getattr(config, "use_mup", False))
        and getattr(config, "mup_embedding_mult", 1.0) != 1.0,
        "the embedding output is cast to fp32 (fp32_residual_connection)": bool(config.fp32_residual_connection),
        "embedding dropout is on (the noise follows it)": training and embedding.embedding_dropout.p > 0,
    }
    return next((reason for reason, blocks in blockers.items() if blocks), None)


def lookup_fusion_blocker(model: Any, inference_context: Any = None) -> str | None:
    """Why ``model`` (a noisy GPT-like model) cannot add its noise in the embedding lookup (None: it can)."""
    if not getattr(model, "fuse_noise_into_lookup", False):
        return "the model's fuse_noise_into_lookup is off"
    config = model.noise_config
    if config.projection != "none":
        return f"projection={config.projection!r} needs the noised embeddings and the selection separately"
    if not noise_independent_of_input(config):
        return f"mechanism {config.mechanism!r} (clip_norm={config.clip_norm!r}) depends on the embedding values"
    if inference_context is not None or InferenceMode.is_active():
        return "the forward is an inference forward"
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return "the model has no embedding module"
    return _embedding_blocker(embedding, model.training)
