"""Knowledge distillation of a noisy student from a clean teacher.

``config`` (``KDConfig``), ``vocab_parallel`` (reductions over the tensor-parallel logit shards), ``divergences``
(KL both ways, JSD, fused CE + forward KL), ``losses`` (the step's distillation loss), ``teacher`` (the frozen clean
copy), ``teacher_weights`` (its weights under Bridge), ``plan_loss`` (CE + KD inside the fine-grained schedule plan's
post-process node), ``pipeline_teacher`` (the teacher's hidden state along the student's pipeline schedule, under
pipeline parallelism).
"""

from nemo_noise_plugin.distillation.config import KDConfig, load_kd_config
from nemo_noise_plugin.distillation.divergences import (
    cross_entropy_and_forward_kl,
    forward_kl,
    jsd,
    logit_divergence,
    reverse_kl,
)
from nemo_noise_plugin.distillation.losses import (
    DistillationLoss,
    combined_distillation_loss,
    hidden_state_loss,
    kd_token_mask,
    masked_token_mean,
)
from nemo_noise_plugin.distillation.vocab_parallel import token_cross_entropy, vocab_parallel_log_softmax

__all__ = [
    "DistillationLoss",
    "KDConfig",
    "combined_distillation_loss",
    "cross_entropy_and_forward_kl",
    "forward_kl",
    "hidden_state_loss",
    "jsd",
    "kd_token_mask",
    "load_kd_config",
    "logit_divergence",
    "masked_token_mean",
    "reverse_kl",
    "token_cross_entropy",
    "vocab_parallel_log_softmax",
]
