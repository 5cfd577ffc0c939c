"""``PrivacyAuditCallback`` inside a training run (the CPU loop fires Bridge's callback events as Bridge's loop)."""

from __future__ import annotations

import json

from nemo_noise_plugin.jobs.cpu.loop import run_cpu_loop
from nemo_noise_plugin.jobs.reports.audit_callback import PrivacyAuditCallback
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config
from nemo_noise_plugin.training.forward_step import noise_forward_step


def test_the_callback_audits_the_training_table_every_n_steps_and_appends_one_json_line_each(tmp_path):
    config = tiny_noise_sft_config(dir=str(tmp_path / "run"), train_iters=4, lr=1e-3)
    exact = PrivacyAuditCallback(NoiseConfig(alpha=0.0), str(tmp_path / "exact"), every_steps=2, held_out_batches=1)
    drowned = PrivacyAuditCallback(NoiseConfig(alpha=1e6), str(tmp_path / "drowned"), every_steps=2)
    run_cpu_loop(config, noise_forward_step, [exact, drowned])

    assert [entry["step"] for entry in exact.history] == [0, 2]  # steps 0 and 2 of 0..3 (Bridge's numbering)
    lines = (tmp_path / "exact" / "privacy_audit.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == json.loads(json.dumps(exact.history))
    for entry in exact.history:  # no noise: every token is its own nearest neighbour
        assert set(entry["attacks"]) == {"nn_l2", "nn_cosine"}
        assert entry["tokens"]["real"] > 0
        assert all(result["overall"]["rate"] == 1.0 for result in entry["attacks"].values())
    vocabulary = config.model.vocab_size
    for entry in drowned.history:  # noise a million times the NEFTune scale: chance level (1 / vocabulary) or so
        assert all(result["overall"]["rate"] < 20 / vocabulary for result in entry["attacks"].values())
