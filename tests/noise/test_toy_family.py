"""A new noise family is rows, not if-chains: a toy Laplace-like family registered in a fixture runs end to end.

The fixture adds one row to each building-block table (a unit sampler, an attacker density, a ledger) and a family
row pointing to them, and removes all four afterwards. Nothing else in the package learns the toy's name: the noise
layer, the config's checks, the ledger, the beam attack, the audit and its sweep find it through the rows. The toy's
sampler is Laplace by another route (``sign(v) * -ln |v|`` for ``v ~ U(-1, 1)``, where the shipped sampler inverts
the CDF with ``1 - |v|``), so its draws differ from the shipped ``laplace`` family's element by element while having
the same law; its ledger is pure DP at ``2C sqrt(d) / b`` written out here.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from scipy import stats

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.densities import NOISE_DENSITIES, NoiseDensity
from nemo_noise_plugin.noise.families import NOISE_FAMILIES, NoiseFamily, register_noise_family
from nemo_noise_plugin.noise.geometry import NoiseBatchInputs
from nemo_noise_plugin.noise.philox import element_words, words_to_symmetric_uniform
from nemo_noise_plugin.noise.sampling import UNIT_SAMPLERS, UnitSampler, unit_noise
from nemo_noise_plugin.noise.schedule import NoiseClock
from nemo_noise_plugin.privacy.audit.beam import noise_likelihood
from nemo_noise_plugin.privacy.audit.noised import noise_layer, noised_embeddings
from nemo_noise_plugin.privacy.audit.run import audit
from nemo_noise_plugin.privacy.audit.sweep import Sweep, audit_sweep
from nemo_noise_plugin.privacy.ledger import LEDGERS, Guarantee, PrivacyLedger, privacy_ledger

TOY = "toy_laplace"
SEQ, BATCH, HIDDEN, VOCAB = 48, 4, 64, 200
CLIP = 1.0


def _toy_unit(keys, stream: int) -> torch.Tensor:
    """Laplace(0, 1) as ``sign(v) * -ln |v|``: ``|v|`` is U(0, 1) and independent of the sign (never 0 here)."""
    v = words_to_symmetric_uniform(element_words(*keys, stream)).to(torch.float64)
    return (torch.sign(v) * -torch.log(v.abs())).to(torch.float32)


def _toy_density(queries: torch.Tensor, rows: torch.Tensor, scale) -> torch.Tensor:
    return -torch.cdist(queries, rows, p=1.0) / scale


def _toy_ledger(config: NoiseConfig, base: PrivacyLedger, sequence_delta: float) -> PrivacyLedger:
    """Pure DP: one release at ``2C sqrt(d) / b``, the sequence's ``L E`` releases composed by summing."""
    token = 2.0 * float(config.clip_norm) * math.sqrt(base.hidden_size) / float(config.laplace_scale)
    return dataclasses.replace(
        base,
        per_token=(Guarantee(token, 0.0, "toy: 2C sqrt(d) / b"),),
        per_sequence=(Guarantee(token * base.releases, 0.0, "toy: L E 2C sqrt(d) / b"),),
        assumptions=("toy ledger",),
    )


@pytest.fixture
def toy_family():
    """The toy family's four rows, registered for one test and removed after it."""
    UNIT_SAMPLERS[TOY] = UnitSampler(TOY, _toy_unit, math.sqrt(2.0), lambda d: math.sqrt(2.0 * d))
    NOISE_DENSITIES[TOY] = NoiseDensity(TOY, _toy_density, math.sqrt(2.0))
    LEDGERS[TOY] = _toy_ledger
    try:
        yield register_noise_family(
            NoiseFamily(
                name=TOY,
                magnitude_field="laplace_scale",
                unit=TOY,
                privacy_mechanism=True,
                clip="optional",
                attacker_density=TOY,
                accounting=TOY,
                sweep_fields=("laplace_scale",),
            )
        )
    finally:
        for table in (NOISE_FAMILIES, UNIT_SAMPLERS, NOISE_DENSITIES, LEDGERS):
            table.pop(TOY, None)


def _embeddings() -> torch.Tensor:
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(0))


def _layer_noise(config: NoiseConfig, x: torch.Tensor) -> torch.Tensor:
    batch = NoiseBatchInputs(loss_mask=torch.ones(BATCH, SEQ))
    return (noise_layer(config)(x, batch, NoiseClock(iteration=3)) - x).double()


def test_the_layer_draws_the_toy_sampler_at_the_toy_scale(toy_family):
    config = NoiseConfig(mechanism=TOY, laplace_scale=0.05, seed=11)
    noise = _layer_noise(config, _embeddings())
    positions, samples = torch.arange(SEQ), torch.arange(BATCH)
    expected = 0.05 * unit_noise(11, 3, samples, positions, HIDDEN, TOY).double()
    torch.testing.assert_close(noise, expected, rtol=1e-5, atol=1e-6)
    # Laplace(0, b): E|z_i| = b, the law of the shipped laplace family; its draws are another sampler's
    assert noise.abs().mean().item() == pytest.approx(0.05, rel=0.03)
    assert stats.kstest((noise / 0.05).flatten().numpy(), stats.laplace().cdf).pvalue > 1e-3
    shipped = _layer_noise(dataclasses.replace(config, mechanism="laplace"), _embeddings())
    assert (shipped - noise).abs().max().item() > 0.05


def test_the_toy_family_is_refused_a_schedule_like_every_privacy_mechanism(toy_family):
    with pytest.raises(ValueError, match=r"NoiseConfig.schedule='linear' is invalid .*mechanism='toy_laplace'"):
        NoiseConfig(mechanism=TOY, schedule="linear", decay_steps=10)


def test_the_ledger_of_the_toy_family_is_its_own_row(toy_family):
    config = NoiseConfig(mechanism=TOY, laplace_scale=0.5, clip_norm=CLIP)
    ledger = privacy_ledger(config, sequence_length=8, epochs=2, hidden_size=HIDDEN)
    assert ledger.mechanism == TOY and ledger.assumptions == ("toy ledger",)
    assert ledger.per_token[0].epsilon == pytest.approx(2 * CLIP * 8.0 / 0.5)  # sqrt(64) = 8
    assert ledger.per_sequence[0].epsilon == pytest.approx(16 * 2 * CLIP * 8.0 / 0.5)


def test_the_beam_attack_scores_the_toy_noise_with_the_toy_density(toy_family):
    config = NoiseConfig(mechanism=TOY, laplace_scale=0.2, clip_norm=CLIP)
    table = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
    token_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    scoring = noise_likelihood(config, noised_embeddings(table, token_ids, config))
    assert scoring.kind == TOY and scoring.clip_norm == CLIP and not scoring.relative
    torch.testing.assert_close(scoring.scale, torch.full((BATCH * SEQ,), 0.2))  # b: unit std / density std = 1


def test_the_audit_sweep_recovers_fewer_tokens_as_the_toy_noise_grows_with_the_toy_ledgers_epsilon(toy_family):
    table = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.125  # row norms ~1
    token_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    base = NoiseConfig(mechanism=TOY, clip_norm=CLIP)
    sweep = Sweep(TOY, "laplace_scale", (0.001, 1.0))
    uniform_lm = lambda prefix: torch.zeros(prefix.size(0), VOCAB)  # noqa: E731 - a prior that adds nothing
    report = audit_sweep(table, token_ids, base, [sweep], ("nn_l2", "lm_beam"), lm_log_probs=uniform_lm)
    rates = {(row["level"], row["attack"]): row["recovery"]["overall"]["rate"] for row in report["rows"]}
    assert rates[(0.001, "nn_l2")] == 1.0 and rates[(0.001, "lm_beam")] == 1.0
    assert rates[(1.0, "nn_l2")] < 0.1 and rates[(1.0, "lm_beam")] < 0.1  # noise norm ~11 against rows of norm 1
    epsilons = {row["level"]: row["per_token_epsilon"] for row in report["rows"]}
    assert epsilons == pytest.approx({0.001: 2 * CLIP * 8.0 / 0.001, 1.0: 2 * CLIP * 8.0})
    single = audit(table, token_ids, dataclasses.replace(base, laplace_scale=0.001), ("nn_l2",))
    assert single["attacks"]["nn_l2"]["overall"]["rate"] == 1.0
