"""The audit report (``audit_sweep``: rows, ledger, task loss, JSON/table/PNG) and the ``nemo noise audit`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_noise_plugin.jobs.audit.settings import parse_audit_arguments
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.audit import audit, median_nearest_neighbour_distance
from nemo_noise_plugin.privacy.audit.sweep import STANDARD_SWEEPS, Sweep, audit_sweep, parse_sweeps, write_sweep_report
from nemo_noise_plugin.privacy.ledger import privacy_ledger

VOCAB, HIDDEN = 400, 24
SWEEPS = [Sweep("uniform", "alpha", (0.0, 20.0, 1000.0)), Sweep("gaussian_mechanism", "epsilon", (300.0, 3.0))]
ATTACKS = ("nn_l2", "nn_cosine", "direction")


def table_and_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, VOCAB, (6, 40), generator=torch.Generator().manual_seed(1))
    return table, tokens


NO_PADDING = torch.zeros(6, 40, dtype=torch.bool)


@pytest.fixture(scope="module")
def report() -> dict:
    table, tokens = table_and_tokens()
    base = NoiseConfig(clip_norm=3.0)
    return audit_sweep(
        table,
        tokens,
        base,
        SWEEPS,
        ATTACKS,
        task_loss=lambda config: 10.0 * config.magnitude,
        epochs=2,
        padding_mask=NO_PADDING,
    )


def test_one_row_per_mechanism_level_and_applicable_attack(report):
    keys = [(row["mechanism"], row["level"], row["attack"]) for row in report["rows"]]
    expected = [("uniform", level, attack) for level in (0.0, 20.0, 1000.0) for attack in ("nn_l2", "nn_cosine")]
    expected += [("gaussian_mechanism", level, attack) for level in (300.0, 3.0) for attack in ATTACKS]
    assert keys == expected
    assert report["skipped"] == [{"mechanism": "uniform", "attack": "direction"}]
    json.loads(json.dumps(report))


def test_rows_hold_the_audit_of_their_configuration(report):
    table, tokens = table_and_tokens()
    for row in report["rows"]:
        config = NoiseConfig(**row["noise_config"])
        assert getattr(config, row["field"]) == row["level"] and config.mechanism == row["mechanism"]
        direct = audit(table, tokens, config, (row["attack"],), padding_mask=NO_PADDING)["attacks"][row["attack"]]
        assert row["recovery"] == direct
    rates = [row["recovery"]["overall"]["rate"] for row in report["rows"] if row["attack"] == "nn_l2"]
    assert rates[0] == 1.0 and rates[2] < 0.05, rates  # alpha 0: everything; alpha 1000 (|z| ~ 20 d_nn): ~chance


def test_ledger_epsilon_matches_privacy_ledger_for_each_row(report):
    for row in report["rows"]:
        ledger = privacy_ledger(NoiseConfig(**row["noise_config"]), sequence_length=40, epochs=2, hidden_size=HIDDEN)
        if row["mechanism"] == "uniform":
            assert row["per_token_epsilon"] is None and row["per_sequence_epsilon"] is None
        else:
            assert row["per_token_epsilon"] == ledger.per_token[0].epsilon == row["level"]
            assert row["per_sequence_epsilon"] == ledger.per_sequence[0].epsilon
            assert row["per_sequence_epsilon"] > 10 * row["per_token_epsilon"]  # 80 releases compose
        assert [entry["epsilon"] for entry in row["ledger"]["per_sequence"]] == [g.epsilon for g in ledger.per_sequence]


def test_task_loss_is_measured_at_each_level_and_without_noise(report):
    for row in report["rows"]:
        assert row["task_loss"] == pytest.approx(10.0 * NoiseConfig(**row["noise_config"]).magnitude)
    assert report["clean_task_loss"] == pytest.approx(10.0 * 5.0)  # base config (alpha 5) with enabled=False


def test_noise_to_neighbour_distance_ratio_tracks_distance_multiple():
    table, tokens = table_and_tokens()
    sweep = Sweep("gaussian", "distance_multiple", (0.5, 2.0))
    result = audit_sweep(table, tokens, NoiseConfig(mechanism="gaussian"), [sweep], ("nn_l2",), padding_mask=NO_PADDING)
    assert result["median_nearest_neighbour_distance"] == pytest.approx(median_nearest_neighbour_distance(table))
    ratios = [row["noise_to_neighbour_distance"] for row in result["rows"]]
    assert ratios == pytest.approx([0.5, 2.0], rel=0.03)


def test_report_files_are_written(report, tmp_path):
    paths = write_sweep_report(report, str(tmp_path))
    assert json.loads(Path(paths["json"]).read_text()) == json.loads(json.dumps(report))
    lines = Path(paths["txt"]).read_text().splitlines()
    assert len(lines) == 2 + len(report["rows"]) and "gaussian_mechanism" in lines[-1] and "epsilon=3" in lines[-1]
    assert Path(paths["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(paths["png"]) > 10_000


def test_parse_sweeps_forms():
    assert parse_sweeps("alpha:1,5", "uniform") == [Sweep("uniform", "alpha", (1.0, 5.0))]
    assert parse_sweeps("metric_dp/eta:100,10;gaussian/sigma:2", "uniform") == [
        Sweep("metric_dp", "eta", (100.0, 10.0)),
        Sweep("gaussian", "sigma", (2.0,)),
    ]
    assert parse_sweeps("standard", "uniform") == list(STANDARD_SWEEPS)


@pytest.mark.parametrize(
    "arguments,message",
    [
        (["model=tiny", "sweep=alpha:1", "output_dir=x", "colour=red"], "unknown argument.s. colour"),
        (["model=tiny", "sweep=alpha:1"], r"missing argument\(s\) output_dir"),
        (["model=tiny", "sweep=alpha", "output_dir=x"], "sweep='alpha' is invalid at 'alpha'"),
        (["model=tiny", "sweep=alpha:", "output_dir=x"], "sweep=.alpha:. is invalid at .alpha:."),
        (["model=tiny", "sweep=alpha:1", "output_dir=x", "tokens=true"], "tokens=True is invalid: expected an integer"),
        (["model=tiny", "sweep=alpha:1,x", "output_dir=x"], r"expected \[mechanism/\]field:level"),
        (
            ["model=tiny", "sweep=eta:1", "output_dir=x"],
            "sweep field for uniform='eta' is invalid: expected one of alpha",
        ),
        (
            ["model=tiny", "sweep=alpha:1", "output_dir=x", "tokens=many"],
            "tokens='many' is invalid: expected an integer",
        ),
        (["model=tiny", "sweep=alpha:1", "output_dir=x", "alpha=-1"], "NoiseConfig.alpha=-1"),
        (["model=tiny", "sweep=alpha:1", "output_dir=x", "attacks=nn_l3"], "attacks='nn_l3' is invalid"),
    ],
)
def test_audit_command_argument_errors_name_the_argument(arguments, message):
    with pytest.raises(ValueError, match=message):
        settings = parse_audit_arguments(arguments)
        table, tokens = table_and_tokens()
        audit_sweep(table, tokens, settings["config"], settings["sweeps"], settings["attacks"], padding_mask=NO_PADDING)


def test_audit_command_unknown_model_is_named(tmp_path):
    from nemo_noise_plugin.cli.nemo_noise import run_audit

    with pytest.raises(ValueError, match="model='gpt5' is invalid: expected one of tiny, smollm2"):
        run_audit(["model=gpt5", "sweep=alpha:1", f"output_dir={tmp_path}"])


@pytest.mark.slow
def test_nemo_noise_audit_runs_on_the_tiny_model(tmp_path):
    nemo = Path(sys.executable).with_name("nemo")
    command = [str(nemo), "noise", "audit", "model=tiny", "sweep=alpha:0,1000", "tokens=256", "max_length=32"]
    command += ["task_sequences=4", f"output_dir={tmp_path}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "privacy_audit.json").read_text())
    assert report["model"] == "tiny" and report["table_shape"] == [257, 256] and report["tokens"] == 256
    rates = {(row["level"], row["attack"]): row["recovery"]["overall"]["rate"] for row in report["rows"]}
    assert rates[(0.0, "nn_l2")] == 1.0 and rates[(0.0, "nn_cosine")] == 1.0
    assert rates[(1000.0, "nn_l2")] < 0.05
    assert report["rows"][0]["task_loss"] == pytest.approx(report["clean_task_loss"], rel=1e-6)
    assert (tmp_path / "privacy_audit.png").is_file() and "nn_cosine" in result.stdout


def test_the_task_exact_match_is_reported_at_each_level_and_without_noise(tmp_path):
    table, tokens = table_and_tokens()
    result = audit_sweep(
        table,
        tokens,
        NoiseConfig(alpha=5.0),
        [Sweep("uniform", "alpha", (1.0, 50.0))],
        ("nn_l2",),
        task_loss=lambda config: 10.0 * config.magnitude,
        task_exact_match=lambda config: 1.0 / (1.0 + config.magnitude if config.enabled else 1.0),
        padding_mask=NO_PADDING,
    )
    assert [row["task_exact_match"] for row in result["rows"]] == pytest.approx([1 / 2, 1 / 51])
    assert result["clean_task_exact_match"] == 1.0
    paths = write_sweep_report(result, str(tmp_path))
    lines = Path(paths["txt"]).read_text().splitlines()
    assert "clean exact match 1.000" in lines[0] and lines[1].rstrip().endswith("exact match")
    assert lines[2].rstrip().endswith("0.500") and lines[3].rstrip().endswith("0.020")


def test_without_a_task_metric_the_exact_match_column_is_empty(report, tmp_path):
    assert {row["task_exact_match"] for row in report["rows"]} == {None}
    assert report["clean_task_exact_match"] is None
    lines = Path(write_sweep_report(report, str(tmp_path))["txt"]).read_text().splitlines()
    assert all(line.rstrip().endswith("-") for line in lines[2:])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["model=tiny", "hf_dir=/tmp"], "hf_dir='/tmp' is only used with model=smollm2"),
        (["model=smollm2", "hf_dir=/nonexistent/hf"], "hf_dir='/nonexistent/hf' is invalid: expected a Hugging Face"),
    ],
)
def test_a_bad_hf_dir_is_named_before_any_model_is_loaded(arguments, message, tmp_path):
    from nemo_noise_plugin.cli.nemo_noise import run_audit

    with pytest.raises(ValueError, match=message):
        run_audit([*arguments, "sweep=alpha:1", f"output_dir={tmp_path}"])
