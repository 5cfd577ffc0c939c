"""Tiny Megatron-Core GPT models for the tests: the builders shared with the benchmarks (``benchmarks/tiny_gpt.py``).

Benchmarks never import ``tests/``, so the shared builders live there and the tests take them from here.
"""

from benchmarks.tiny_gpt import (  # noqa: F401
    TINY_CPU_TRANSFORMER_SETTINGS,
    build_tiny_gpt,
    causal_attention_mask,
    destroy_cpu_parallel,
    free_port,
    init_cpu_parallel,
    tiny_gpt_config,
)


def masked_mean_loss(model, batch: dict):
    """The model's per-token loss on ``batch`` (the ``conftest.batch`` keys), averaged over its loss mask."""
    per_token = model(
        batch["input_ids"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
