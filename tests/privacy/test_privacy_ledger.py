"""The privacy ledger: numbers for the shipped presets, the no-guarantee cases, and the `nemo noise ledger` command."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import pytest

from nemo_noise_plugin.cli.nemo_noise import run_ledger
from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
from nemo_noise_plugin.noise.families import NOISE_FAMILIES
from nemo_noise_plugin.privacy.ledger import privacy_ledger
from nemo_noise_plugin.privacy.ledger_format import format_ledger

REPO = pathlib.Path(__file__).resolve().parents[2]
GAUSSIAN_PRESET = "dp_gaussian_mechanism"
METRIC_PRESET = "metric_dp"


@pytest.fixture(scope="module")
def gaussian_ledger():
    return privacy_ledger(load_noise_config(GAUSSIAN_PRESET), sequence_length=512, epochs=3)


def test_gaussian_preset_is_calibrated_to_epsilon_8_delta_1e5_at_clip_1():
    config = load_noise_config(GAUSSIAN_PRESET)
    assert (config.mechanism, config.clip_norm, config.epsilon, config.delta) == ("gaussian_mechanism", 1.0, 8.0, 1e-5)
    assert config.calibration == "analytic"


def test_gaussian_ledger_per_token_numbers(gaussian_ledger):
    assert gaussian_ledger.sensitivity == 2.0
    # Balle & Wang's reference code gives 1.200458145 for (8, 1e-5, sensitivity 2).
    assert gaussian_ledger.sigma == pytest.approx(1.2004581443979037, rel=1e-9)
    assert gaussian_ledger.token_rho == pytest.approx(4.0 / (2.0 * 1.2004581443979037**2), rel=1e-12)
    (token,) = gaussian_ledger.per_token
    assert (token.epsilon, token.delta) == (8.0, 1e-5)


def test_gaussian_ledger_per_sequence_composes_l_times_e_releases(gaussian_ledger):
    rho = gaussian_ledger.sequence_rho
    assert gaussian_ledger.releases == 1536
    assert rho == pytest.approx(1536 * gaussian_ledger.token_rho, rel=1e-12)
    assert rho == pytest.approx(2131.705307871888, rel=1e-9)
    exact, optimal, bun_steinke = gaussian_ledger.per_sequence
    assert all(guarantee.delta == 1e-5 for guarantee in gaussian_ledger.per_sequence)
    assert bun_steinke.epsilon == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1e5)), rel=1e-12)
    assert optimal.epsilon == pytest.approx(2441.376120560419, rel=1e-9)
    assert exact.epsilon == pytest.approx(2409.2118587327973, rel=1e-9)
    assert exact.epsilon < optimal.epsilon < bun_steinke.epsilon


def test_exact_sequence_epsilon_is_the_gaussian_mechanism_of_sensitivity_2c_sqrt_le(gaussian_ledger):
    log_ndtr = pytest.importorskip("scipy.special").log_ndtr
    mu = 2.0 * math.sqrt(1536) / gaussian_ledger.sigma
    epsilon = gaussian_ledger.per_sequence[0].epsilon
    a, b = mu / 2, epsilon / mu
    delta = math.exp(log_ndtr(a - b)) - math.exp(epsilon + log_ndtr(-a - b))
    assert delta == pytest.approx(1e-5, rel=1e-6)


def test_delta_argument_sets_the_sequence_delta_only():
    config = load_noise_config(GAUSSIAN_PRESET)
    ledger = privacy_ledger(config, sequence_length=512, epochs=3, delta=1e-6)
    assert ledger.per_token[0].delta == 1e-5
    assert [guarantee.delta for guarantee in ledger.per_sequence] == [1e-6] * 3
    assert ledger.per_sequence[1].epsilon == pytest.approx(2471.3688297247377, rel=1e-9)


def test_one_token_one_epoch_sequence_is_the_token_guarantee():
    ledger = privacy_ledger(load_noise_config(GAUSSIAN_PRESET), sequence_length=1, epochs=1)
    assert ledger.per_sequence[0].epsilon == pytest.approx(8.0, rel=1e-9)


def test_gaussian_expected_noise_norm_uses_the_chi_mean():
    config = load_noise_config(GAUSSIAN_PRESET)
    sigma = config.dp_sigma
    one = privacy_ledger(config, sequence_length=1, hidden_size=1).expected_noise_norm
    two = privacy_ledger(config, sequence_length=1, hidden_size=2).expected_noise_norm
    assert one == pytest.approx(sigma * math.sqrt(2 / math.pi), rel=1e-12)
    assert two == pytest.approx(sigma * math.sqrt(math.pi / 2), rel=1e-12)


def test_metric_dp_ledger_is_pure_eta_times_2c_per_token_and_sums_per_sequence():
    ledger = privacy_ledger(load_noise_config(METRIC_PRESET), sequence_length=512, epochs=3, hidden_size=4096)
    assert (ledger.eta, ledger.clip_norm) == (100.0, 1.0)
    assert (ledger.per_token[0].epsilon, ledger.per_token[0].delta) == (200.0, 0.0)
    assert (ledger.per_sequence[0].epsilon, ledger.per_sequence[0].delta) == (307200.0, 0.0)
    assert ledger.expected_noise_norm == pytest.approx(40.96)
    assert "40.96" in format_ledger(ledger)


def test_metric_dp_without_clip_norm_says_unbounded_instead_of_failing():
    ledger = privacy_ledger(NoiseConfig(mechanism="metric_dp", eta=10.0), sequence_length=16)
    assert not ledger.has_formal_guarantee
    assert ledger.per_sequence[0].epsilon is None
    text = format_ledger(ledger)
    assert "unbounded" in text
    assert "without clip_norm" in text


def test_laplace_ledger_is_pure_2c_sqrt_d_over_b_per_token_and_sums_per_sequence():
    ledger = privacy_ledger(load_noise_config("laplace"), sequence_length=512, epochs=3, hidden_size=4096)
    assert (ledger.laplace_scale, ledger.clip_norm) == (0.5, 1.0)
    assert (ledger.per_token[0].epsilon, ledger.per_token[0].delta) == (256.0, 0.0)  # 2 * 1 * 64 / 0.5
    assert (ledger.per_sequence[0].epsilon, ledger.per_sequence[0].delta) == (256.0 * 1536, 0.0)
    assert ledger.expected_noise_norm == pytest.approx(0.5 * math.sqrt(2 * 4096))
    text = format_ledger(ledger)
    assert "2C sqrt(d) / b" in text and "L1 distance <= 2C sqrt(d)" in " ".join(text.split())


def test_laplace_ledger_needs_the_hidden_size_and_without_clip_norm_is_unbounded():
    with pytest.raises(ValueError, match="hidden_size=None is invalid with mechanism='laplace' and clip_norm=1.0"):
        privacy_ledger(load_noise_config("laplace"), sequence_length=8)
    ledger = privacy_ledger(NoiseConfig(mechanism="laplace"), sequence_length=16)
    assert not ledger.has_formal_guarantee and ledger.per_sequence[0].epsilon is None
    assert "without clip_norm" in format_ledger(ledger)


@pytest.mark.parametrize("mechanism", [name for name, family in NOISE_FAMILIES.items() if family.accounting is None])
def test_unclipped_mechanisms_have_no_formal_guarantee(mechanism):
    ledger = privacy_ledger(NoiseConfig(mechanism=mechanism), sequence_length=128, epochs=2)
    assert not ledger.has_formal_guarantee
    assert ledger.per_token == ledger.per_sequence == ()
    text = format_ledger(ledger)
    assert f"No formal privacy guarantee: mechanism={mechanism!r}" in text
    assert "unbounded" in text
    assert "epsilon" not in text.split("Assumptions")[0]


def test_disabled_noise_has_no_guarantee_even_for_a_privacy_mechanism():
    config = NoiseConfig(enabled=False, mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=1.0)
    text = format_ledger(privacy_ledger(config, sequence_length=8))
    assert "noise is disabled" in text


def test_ledger_states_scope_and_coverage():
    config = NoiseConfig(
        mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=2.0, tokens="response", special_token_ids=[1, 2]
    )
    text = format_ledger(privacy_ledger(config, sequence_length=64))
    flat = " ".join(text.split())
    assert "not the trained weights" in flat
    assert "clean labels" in flat
    assert "Only the response tokens are noised" in flat
    assert "special_token_ids [1, 2] are never noised" in flat
    assert "assumes the seed stays secret" in flat


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"sequence_length": 0}, r"sequence_length=0 is invalid: expected an integer >= 1"),
        ({"sequence_length": 8, "epochs": 0}, r"epochs=0 is invalid"),
        (
            {"sequence_length": 8, "delta": 1.0},
            r"privacy_ledger: delta=1.0 is invalid: expected a finite number in \(0, 1\) \(or null\)",
        ),
        ({"sequence_length": 8, "hidden_size": 2.5}, r"hidden_size=2.5 is invalid"),
    ],
)
def test_ledger_argument_errors_name_the_argument(arguments, message):
    with pytest.raises(ValueError, match=message):
        privacy_ledger(load_noise_config(GAUSSIAN_PRESET), **arguments)


def test_ledger_command_applies_noise_config_overrides():
    out = run_ledger([f"config={GAUSSIAN_PRESET}", "sequence_length=4", "epsilon=0.5", "calibration=classical"])
    assert "19.3792" in out  # 2 sqrt(2 ln(1.25e5)) / 0.5, the classical sigma
    assert "classical calibration" in out


def test_ledger_command_reports_config_errors_by_field():
    with pytest.raises(ValueError, match="NoiseConfig.clip_norm=None is invalid"):
        run_ledger([f"config={GAUSSIAN_PRESET}", "sequence_length=4", "clip_norm=null"])
    with pytest.raises(ValueError, match="unknown argument.s. epsilom: expected config, sequence_length"):
        run_ledger([f"config={GAUSSIAN_PRESET}", "sequence_length=4", "epsilom=4"])
    with pytest.raises(ValueError, match="missing argument.s. sequence_length"):
        run_ledger([f"config={GAUSSIAN_PRESET}"])


def test_ledger_command_reads_a_preset_by_path_too():
    path = REPO / "configs" / "noise" / "dp_gaussian_mechanism.yaml"
    assert run_ledger([f"config={path}", "sequence_length=4"]) == run_ledger(
        [f"config={GAUSSIAN_PRESET}", "sequence_length=4"]
    )


def _ledger_table(output: str) -> str:
    return output[output.index("Privacy ledger:") :].strip()


@pytest.mark.slow
def test_nemo_noise_ledger_prints_the_same_table():
    nemo = pathlib.Path(sys.executable).with_name("nemo")
    result = subprocess.run(
        [str(nemo), "noise", "ledger", "config=dp_gaussian_mechanism", "sequence_length=512", "epochs=3"]
        + ["hidden_size=4096"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = privacy_ledger(load_noise_config(GAUSSIAN_PRESET), sequence_length=512, epochs=3, hidden_size=4096)
    assert _ledger_table(result.stdout) == format_ledger(expected)
    assert "2409.21" in result.stdout
    # the user's table first; no third-party chatter (only NeMo-Run's own torch import warns, before the plugin)
    assert result.stdout.splitlines()[0] == "Privacy ledger: gaussian_mechanism", result.stdout[:1000]
    chatter = [line for line in result.stderr.splitlines() if "Warning" in line or "INFO" in line]
    assert [line for line in chatter if "pynvml" not in line] == [], result.stderr[-3000:]
