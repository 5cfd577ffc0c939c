"""The README's main-job command on CPU: the tiny recipe on the embedded corpus, then the robustness report."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from nemo_noise_plugin.jobs.reports.robustness import HELD_OUT_BATCHES
from nemo_noise_plugin.jobs.reports.robustness_statistics import paired_difference


def _run_demo(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    # `--steps 6` with its control: 240 s of CPU measured 2026-12-03 (887 s wall at load 38 on 2 cores)
    return subprocess.run(
        [sys.executable, "-m", "nemo_noise_plugin", *args],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=cwd,
        env=env,
    )


PROGRESS_LINE = re.compile(r"^\s+(\d+)/\d+\s+(\d+\.\d+)\s+(\S+)\s+(\d+)\s*$")


def _rows(out: str) -> list[list[str]]:
    """Progress lines ``step/steps  loss  kd  tokens/s`` as ``[step, loss, kd, tokens/s]``."""
    return [list(match.groups()) for line in out.splitlines() if (match := PROGRESS_LINE.match(line))]


@pytest.mark.slow
def test_main_job_trains_the_tiny_recipe_and_writes_the_robustness_report(tmp_path):
    result = _run_demo("--steps", "6", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "recipe tiny_noise_sft on the embedded corpus" in out
    assert "CPU loop (Bridge's training loop needs CUDA)" in out and "CPU substitutes in use" in out
    # First the control (the same 6 steps without noise), then the noisy run: the report compares the two.
    assert out.index("-- control: the same 6 steps without noise --") < out.index("-- noise training:")
    assert "NoiseConfig(enabled=False" in out.split("-- noise training:")[0]
    rows = [row for row in _rows(out) if len(row) == 4]
    assert [int(row[0]) for row in rows] == [1, 2, 3, 4, 5, 6] * 2
    losses = [float(row[1]) for row in rows[6:]]
    assert losses[-1] < losses[0] - 1.0  # it learns the corpus
    latest = tmp_path / "tiny_noise_sft" / "reports" / "latest"  # each run keeps its report under its run id
    report = json.loads((latest / "robustness.json").read_text())
    assert list(report) == ["provenance", "before", "no noise", "after"]
    before, control, after = report["before"], report["no noise"], report["after"]
    assert [point["scale"] for point in before] == [0.0, 2.5, 5.0, 10.0, 20.0, 40.0]
    assert [point["scale"] for point in control] == [point["scale"] for point in after]
    assert before[0]["kl"] == 0.0 and before[-1]["kl"] > before[1]["kl"] > 0  # more noise, more shift
    assert after[0]["loss"] < before[0]["loss"] - 1.0
    assert control[0]["loss"] < before[0]["loss"] - 1.0 and control[0]["loss"] != after[0]["loss"]
    assert (latest / "robustness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "tiny_noise_sft" / "data").is_dir()  # the corpus as a Megatron indexed dataset
    _assert_the_report_compares_noise_training_with_its_control(report, out)


def _assert_the_report_compares_noise_training_with_its_control(report: dict, out: str) -> None:
    """Each level of ``after`` carries its verdict against the control, reproducible from the per-batch values in
    the file, and the printed summary counts exactly those verdicts."""
    control, after = report["no noise"], report["after"]
    for point in [*report["before"], *control, *after]:  # per held-out batch, whose token-weighted mean is the point
        assert len(point["batch_loss"]) == len(point["batch_kl"]) == HELD_OUT_BATCHES
        assert sum(point["batch_kl"]) / HELD_OUT_BATCHES == pytest.approx(point["kl"], rel=1e-4, abs=1e-9)
    verdicts = {"loss": [], "kl": []}
    for mine, theirs in zip(after, control, strict=True):
        comparison = mine["vs_control"]
        assert comparison["control"] == "no noise" and comparison["batches"] == HELD_OUT_BATCHES
        for metric in ("loss", "kl"):
            again = paired_difference(mine[f"batch_{metric}"], theirs[f"batch_{metric}"])
            written = comparison[metric]
            assert written["verdict"] == again.verdict, (metric, mine["scale"])
            assert (written["mean"], written["low"], written["high"]) == pytest.approx(
                (again.mean, again.low, again.high)
            )
            assert written["low"] <= written["mean"] <= written["high"]
            verdicts[metric].append(written["verdict"])
    assert verdicts["kl"][0] == "no difference (interval includes 0)"  # level 0: no noise, KL 0 for both
    kl = [verdicts["kl"][1:].count(word) for word in ("better", "worse", "no difference (interval includes 0)")]
    loss = [verdicts["loss"].count(word) for word in ("better", "worse", "no difference (interval includes 0)")]
    assert (
        f"noise training vs control: lower KL at {kl[0]} of 5 noise levels, higher at {kl[1]}, no difference at "
        f"{kl[2]}; held-out loss lower at {loss[0]} of 6 levels, higher at {loss[1]}, no difference at {loss[2]} "
        f"(95 % paired t-interval over {HELD_OUT_BATCHES} held-out batches, same noise draws)"
    ) in out
    words = out.split("same noise draws)\n")[1].splitlines()[0]
    if kl[0] and not kl[1] and not loss[1]:
        assert words.startswith("noise training made this model more robust than its control"), words
    elif kl[0] and not kl[1]:
        assert words.startswith("a trade-off" if loss[0] else "steadier, not more accurate"), words
    else:
        no_gain = ("no overall robustness gain measured", "no robustness gain measured", "no difference measured")
        assert words.startswith(no_gain), words


@pytest.mark.slow
def test_the_distillation_recipe_distils_from_a_clean_pretrained_teacher(tmp_path):
    result = _run_demo(
        "--recipe", "tiny_noise_distillation", "--steps", "2", "--clean-pretrain-steps", "25", "--no-control",
        "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "-- clean pre-training: 25 steps, noise and KD off" in out and "-- control:" not in out
    assert "2 steps after 25 clean" in out
    rows = [row for row in _rows(out) if len(row) == 4]
    assert len(rows) == 25 + 2
    pretraining, distillation = rows[:25], rows[25:]
    assert all(float(row[2]) == 0 for row in pretraining)  # KD off while pre-training
    assert float(pretraining[-1][1]) < float(pretraining[0][1]) - 1.0
    # The distillation run starts from the pre-trained weights (not the random start) and its teacher is that
    # model, so the KD loss is only the shift that the noise causes: small, not the gap to a random teacher.
    assert float(distillation[0][1]) < float(pretraining[0][1]) - 1.0
    assert all(0 < float(row[2]) < 0.5 for row in distillation)


@pytest.mark.slow
def test_main_job_trains_the_hybrid_recipe_and_writes_its_robustness_report(tmp_path):
    """``--recipe tiny_hybrid_noise_sft``: Megatron-Core's HybridModel (issue 35) through the main job, without the
    control run (the control and the verdicts are the GPT test's; the code after training is the same)."""
    from tests.support.training_processes import training_env

    recipe = "tiny_hybrid_noise_sft"
    result = _run_demo(
        "--recipe", recipe, "--steps", "3", "--no-control", "--output-dir", str(tmp_path), env=training_env()
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert f"recipe {recipe} on the embedded corpus" in out and "-- control:" not in out
    assert "CPU loop (Bridge's training loop needs CUDA)" in out
    assert re.search(r"^model: [\d.]+M parameters \(NoisyHybridModel\)", out, re.MULTILINE), out
    rows = [row for row in _rows(out) if len(row) == 4]
    assert [int(row[0]) for row in rows] == [1, 2, 3]
    assert all(row[2] == "-" for row in rows)  # no KD loss: the SFT recipe
    assert float(rows[-1][1]) < float(rows[0][1]) - 0.5  # it learns the corpus
    report = json.loads((tmp_path / recipe / "reports" / "latest" / "robustness.json").read_text())
    assert list(report) == ["provenance", "before", "after"]
    model = report["provenance"]["config"]["model"]
    assert report["provenance"]["recipe"] == recipe
    assert model["_target_"] == "nemo_noise_plugin.providers.hybrid.NoisyHybridModelProvider"
    assert model["hybrid_layer_pattern"] == "*-*-*-*-" and model["noise"]["alpha"] == 10.0
    before, after = report["before"], report["after"]
    assert [point["scale"] for point in before] == [point["scale"] for point in after] == [0, 2.5, 5, 10, 20, 40]
    assert before[0]["kl"] == after[0]["kl"] == 0.0
    assert after[-1]["kl"] > after[1]["kl"] > 0  # more noise, more shift, for the trained hybrid model too
    assert after[0]["loss"] < before[0]["loss"] - 1.0
    assert (tmp_path / recipe / "reports" / "latest" / "robustness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_job_rejects_bad_noise_settings_with_the_field_name():
    result = _run_demo("--alpha", "-1")
    assert result.returncode == 2
    assert "NoiseConfig.alpha=-1.0 is invalid: expected a finite number >= 0." in result.stderr


@pytest.mark.slow
def test_main_job_takes_a_yaml_preset_and_flag_overrides(tmp_path):
    result = _run_demo("--steps", "1", "--noise-config", "gaussian", "--sigma", "3", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mechanism='gaussian'" in result.stdout and "sigma=3.0" in result.stdout
    assert "against sigma" in result.stdout


def test_main_job_names_an_unreadable_preset():
    result = _run_demo("--noise-config", "configs/noise/missing.yaml")
    assert result.returncode == 2
    assert "--noise-config 'configs/noise/missing.yaml' cannot be read: No such file or directory" in result.stderr
