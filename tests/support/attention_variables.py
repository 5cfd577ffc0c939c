"""A clean slate of Megatron's process-wide attention-backend variables (``NVTE_*``) for tests that build models.

Megatron pins the attention backend in ``NVTE_*`` environment variables when it builds a model and refuses a later
model whose backend disagrees, so a test that builds a model in a process where another test already built one
starts from no ``NVTE_*`` variables and gives the others theirs back afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def clean_attention_variables() -> Iterator[None]:
    """Remove every ``NVTE_*`` variable for the block; afterwards drop those the block set and restore the old ones.

    Example::

        with clean_attention_variables():
            model = provider.provide_distributed_model(wrap_with_ddp=False)
    """
    saved = {name: os.environ.pop(name) for name in [name for name in os.environ if name.startswith("NVTE_")]}
    try:
        yield
    finally:
        for name in [name for name in os.environ if name.startswith("NVTE_")]:
            del os.environ[name]
        os.environ.update(saved)
