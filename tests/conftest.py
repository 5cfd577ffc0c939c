"""Shared fixtures: real Megatron-Core on a single-process gloo group (CPU substitutes from the package)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from tests.support.models import causal_attention_mask, destroy_cpu_parallel, init_cpu_parallel


@pytest.fixture(scope="session")
def megatron_cpu():
    """Megatron's parallel state initialised once (TP=PP=CP=1) for in-process model tests."""
    init_cpu_parallel(seed=1234)
    yield
    destroy_cpu_parallel()


@pytest.fixture(autouse=True)
def _attention_variables_stay_with_their_test():
    """Megatron pins the attention backend process-wide in ``NVTE_*`` variables when it builds a model and refuses a
    later model of another backend; whatever a test (or a training loop it starts in-process) sets there is undone
    after it, so no test's backend leaks into the next one's models (``tests.support.attention_variables`` gives a
    test a clean slate inside)."""
    with _attention_variables_restored():
        yield


@pytest.fixture(scope="module", autouse=True)
def _attention_variables_stay_with_their_module():
    """The same for a module's own fixtures (a module-scoped fixture that trains a model sets them before any test)."""
    with _attention_variables_restored():
        yield


@contextlib.contextmanager
def _attention_variables_restored():
    saved = {name: value for name, value in os.environ.items() if name.startswith("NVTE_")}
    try:
        yield
    finally:
        for name in [name for name in os.environ if name.startswith("NVTE_")]:
            del os.environ[name]
        os.environ.update(saved)


@pytest.fixture
def batch():
    """A padded batch: 4 sequences of true lengths 64, 48, 32 and 16 in a 64-token window."""
    torch.manual_seed(0)
    batch_size, seq = 4, 64
    tokens = torch.randint(1, 256, (batch_size, seq))
    loss_mask = torch.zeros(batch_size, seq)
    for row, length in enumerate((64, 48, 32, 16)):
        loss_mask[row, :length] = 1.0
    return {
        "input_ids": tokens,
        "position_ids": torch.arange(seq).unsqueeze(0).expand(batch_size, -1),
        "attention_mask": causal_attention_mask(seq),
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": loss_mask,
        "true_lengths": torch.tensor([64.0, 48.0, 32.0, 16.0]),
    }
