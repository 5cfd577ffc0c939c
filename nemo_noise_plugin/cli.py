"""Entry point of the ``noise`` command group of NeMo-Run's ``nemo`` command line.

Registered under the ``nemo_run.cli`` entry-point group in ``pyproject.toml``; ``nemo`` imports this module to
build the group, so importing it must stay cheap and must not need Transformer Engine, a GPU or Megatron-Bridge.
``nemo noise ledger`` prints the privacy ledger of a noise config. ``nemo llm finetune`` lives in
``nemo_noise_plugin.cli_llm`` (the ``llm`` entry point; it moves to ``nemo noise finetune`` where NeMo 2's own
``llm`` group is installed).
"""

# No ``from __future__ import annotations`` and no ``X | None``: NeMo-Run's argument parser (0.11) needs real
# types and rejects ``types.UnionType`` ("Unsupported type: float | None"), so the optional arguments use Optional.
from typing import Optional

import nemo_run as run


@run.cli.entrypoint(namespace="noise", enable_executor=False)
def ledger(
    config_path: str,
    sequence_length: int,
    epochs: int = 1,
    delta: Optional[float] = None,  # noqa: UP045
    hidden_size: Optional[int] = None,  # noqa: UP045
) -> None:
    """Print the privacy ledger of a noise config: per-token and per-sequence guarantees and their assumptions.

    Runs in-process (no executor, no confirmation), like ``python -m nemo_noise_plugin.privacy ledger``::

        nemo noise ledger config_path=configs/noise/dp_gaussian_mechanism.yaml sequence_length=512 epochs=3

    Args:
        config_path: noise config YAML (``configs/noise/*.yaml``).
        sequence_length: tokens per sequence, L.
        epochs: passes over each sequence, E.
        delta: per-sequence delta (default: the config's delta).
        hidden_size: hidden size d, for the expected noise norm.
    """
    from nemo_noise_plugin.noise.config import load_noise_config
    from nemo_noise_plugin.privacy.ledger import format_ledger, privacy_ledger

    config = load_noise_config(config_path)
    print(
        format_ledger(
            privacy_ledger(config, sequence_length=sequence_length, epochs=epochs, delta=delta, hidden_size=hidden_size)
        )
    )
