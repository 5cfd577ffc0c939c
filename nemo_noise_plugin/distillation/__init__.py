"""Knowledge distillation of a noisy student from a clean teacher: configuration and tensor-parallel KD losses."""

from nemo_noise_plugin.distillation.kd_config import KDConfig
from nemo_noise_plugin.distillation.losses import (
    DistillationLoss,
    combined_distillation_loss,
    cross_entropy_and_forward_kl,
    forward_kl,
    hidden_state_loss,
    jsd,
    kd_token_mask,
    logit_divergence,
    masked_token_mean,
    reverse_kl,
    token_cross_entropy,
    vocab_parallel_log_softmax,
)

__all__ = [
    "DistillationLoss",
    "KDConfig",
    "combined_distillation_loss",
    "cross_entropy_and_forward_kl",
    "forward_kl",
    "hidden_state_loss",
    "jsd",
    "kd_token_mask",
    "logit_divergence",
    "masked_token_mean",
    "reverse_kl",
    "token_cross_entropy",
    "vocab_parallel_log_softmax",
]
