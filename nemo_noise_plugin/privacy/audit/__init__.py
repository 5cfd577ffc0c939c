"""Privacy audit: how many training tokens an attacker recovers from the noised embeddings.

The attacker sees the noised decoder input (e.g. what a first pipeline stage sends on) and knows the embedding table
and the noise configuration. ``noised_embeddings`` reproduces exactly what training feeds the network (the plugin's
own noise layer and Philox streams); the attacks guess each token by nearest neighbour (L2 or cosine), by nearest
neighbour against the clipped table (clipped mechanisms), or by a beam search that adds a language-model prior to the
noise likelihood (the BeamClean idea). ``recovery_report`` turns guesses into recovery rates with Wilson intervals,
``audit`` runs it all on one configuration and ``audit_sweep`` over noise levels, with the privacy ledger's epsilon
and the task loss at each level (JSON, table, PNG).

Modules: ``noised`` (the exact inputs), ``search`` (the chunked, vocabulary-parallel top-k search), ``attacks``
(nearest neighbour, direction), ``beam`` (the LM-prior beam), ``statistics`` (recovery rates), ``run`` (one audit),
``sweep`` (the report over noise levels).
"""

from nemo_noise_plugin.privacy.audit.attacks import Neighbours, direction_attack, nearest_neighbour_attack
from nemo_noise_plugin.privacy.audit.beam import lm_beam_attack
from nemo_noise_plugin.privacy.audit.noised import noised_embeddings, noised_tokens
from nemo_noise_plugin.privacy.audit.run import ATTACKS, audit
from nemo_noise_plugin.privacy.audit.search import median_nearest_neighbour_distance
from nemo_noise_plugin.privacy.audit.statistics import rare_token_ids, recovery_report, wilson_interval

__all__ = [
    "ATTACKS",
    "Neighbours",
    "audit",
    "direction_attack",
    "lm_beam_attack",
    "median_nearest_neighbour_distance",
    "nearest_neighbour_attack",
    "noised_embeddings",
    "noised_tokens",
    "rare_token_ids",
    "recovery_report",
    "wilson_interval",
]
