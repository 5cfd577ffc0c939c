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
