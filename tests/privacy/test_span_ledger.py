"""The span ledger: epsilon per protected span and per example, composed over the span's noised tokens."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.span_ledger import format_span_ledger, span_ledger, span_token_counts
from nemo_noise_plugin.validation import SettingError

GAUSSIAN = NoiseConfig(mechanism="gaussian_mechanism", epsilon=2.0, delta=1e-6, clip_norm=1.0, tokens="spans")
METRIC_DP = NoiseConfig(mechanism="metric_dp", eta=10.0, clip_norm=0.5, tokens="spans")  # 10 per token


def _gaussian_delta(epsilon: float, sigma: float, sensitivity: float) -> float:
    """Balle & Wang's exact delta of one Gaussian release, written out here (Phi via erf)."""
    phi = lambda x: 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))  # noqa: E731
    a, b = sensitivity / (2 * sigma), epsilon * sigma / sensitivity
    return phi(a - b) - math.exp(epsilon) * phi(-a - b)


def test_metric_dp_spans_compose_purely_n_times_e_times_the_token_epsilon():
    ledger = span_ledger(METRIC_DP, [[4, 3], [1]], epochs=2)
    assert [span.epsilon for span in ledger.spans[0]] == [80.0, 60.0]  # 4 * 2 * 10, 3 * 2 * 10
    assert [example.epsilon for example in ledger.examples] == [140.0, 20.0]
    assert all(span.basic.delta == 0.0 and span.tighter == () for span in ledger.spans[0])


def test_gaussian_spans_get_basic_composition_and_the_tighter_exact_gaussian_bound():
    ledger = span_ledger(GAUSSIAN, [[4, 3]], epochs=2)
    span = ledger.spans[0][0]
    assert (span.tokens, span.releases) == (4, 8)
    assert span.basic.epsilon == 16.0 and span.basic.delta == pytest.approx(8e-6)  # 8 releases of (2, 1e-6)
    exact = span.tighter[0]
    assert exact.epsilon == pytest.approx(6.41786, abs=1e-4) and exact.delta == 1e-6
    # 8 releases at sensitivity 2C = 2 are one Gaussian release at sensitivity 2 sqrt(8): delta(eps) is 1e-6 there
    assert _gaussian_delta(exact.epsilon, GAUSSIAN.dp_sigma, 2.0 * math.sqrt(8)) == pytest.approx(1e-6, rel=1e-4)
    assert span.epsilon == exact.epsilon < min(g.epsilon for g in span.tighter[1:]) < span.basic.epsilon
    zcdp = ledger.spans[0][0].tighter[1]
    assert zcdp.how.startswith("zCDP -> DP")


def test_an_example_composes_all_its_spans_and_an_example_without_spans_releases_nothing():
    ledger = span_ledger(GAUSSIAN, [[4, 3], []], epochs=2)
    whole, empty = ledger.examples
    assert whole.tokens == 7 and whole.basic.epsilon == 28.0
    assert whole.epsilon == pytest.approx(8.90886, abs=1e-4)
    assert _gaussian_delta(whole.epsilon, GAUSSIAN.dp_sigma, 2.0 * math.sqrt(14)) == pytest.approx(1e-6, rel=1e-4)
    assert max(span.epsilon for span in ledger.spans[0]) < whole.epsilon < sum(s.epsilon for s in ledger.spans[0])
    assert (empty.tokens, empty.epsilon, ledger.spans[1]) == (0, 0.0, ())


def test_span_token_counts_reads_the_runs_of_a_private_mask():
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0, 0, 1], [0] * 8]).bool()
    assert span_token_counts(mask) == [[3, 2], [1, 1], []]


def test_the_span_ledger_needs_tokens_spans_and_positive_span_counts():
    with pytest.raises(SettingError, match=r"NoiseConfig.tokens='all' is invalid: expected 'spans'"):
        span_ledger(NoiseConfig(mechanism="metric_dp", eta=10.0, clip_norm=0.5), [[2]])
    with pytest.raises(SettingError, match=r"span_tokens\[1\]"):
        span_ledger(METRIC_DP, [[2], [0]])


def test_a_mechanism_without_a_guarantee_reports_unbounded_spans():
    ledger = span_ledger(NoiseConfig(alpha=5.0, tokens="spans"), [[3]])
    assert ledger.spans[0][0].epsilon is None and "No formal privacy guarantee" in ledger.spans[0][0].basic.how
    assert "epsilon unbounded" in format_span_ledger(ledger)


def test_the_text_names_each_example_and_span_with_its_epsilon():
    text = format_span_ledger(span_ledger(METRIC_DP, [[4, 3]], epochs=2))
    assert "example 0: 7 protected tokens, epsilon 140" in text
    assert "span 1: 3 tokens, epsilon 60" in text
