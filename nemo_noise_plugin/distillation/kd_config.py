"""Moved to ``nemo_noise_plugin.distillation.config``; this alias keeps old imports and YAML ``_target_`` working."""

from nemo_noise_plugin.distillation.config import (  # noqa: F401
    HIDDEN_LOSSES,
    KD_LOSSES,
    KD_TOKEN_SELECTIONS,
    HiddenLossKind,
    KDConfig,
    KDLossKind,
    KDTokens,
)
