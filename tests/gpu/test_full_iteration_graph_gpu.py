"""Noisy training under Bridge's full-iteration CUDA graph (issue 34): every replayed step adds its own noise.

The tiny noisy recipe trains 12 steps through Bridge's GPU loop three times, side by side on one GPU: eager, under
``cuda_graph_impl="full_iteration"`` (2 eager warm-up steps, the capture, then replays), and eager with the noise
off. The graph run must give the eager run's losses at every step; the noise-off run shows how far apart the losses
of different noise are, so a replay that froze the noise could not pass. NEFTune alpha 50, so the noise moves the
loss clearly. Needs Bridge's wheels (tests/gpu/RESULTS.md says how they were carried).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.support.training_processes import training_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 12

LAUNCHER = """
import json
import sys

from nemo_noise_plugin.jobs.launch.launcher import launch
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from megatron.core.utils import unwrap_model

Callback = import_bridge("megatron.bridge.training.callbacks").Callback


class Losses(Callback):
    def __init__(self):
        self.rows = []

    def on_train_step_end(self, context):
        row = {key: float(value) for key, value in context.loss_dict.items()}
        row["graph"] = FullCudaGraphWrapper.cuda_graph.get("training") is not None  # captured by now
        layer = getattr(unwrap_model(context.model[0]), "noise_layer", None)
        row["replayable"] = layer is not None and layer.replayable_step is not None
        self.rows.append(row)


if __name__ == "__main__":  # Bridge's checkpoint workers re-import this script
    work, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    noise = NoiseConfig(alpha=50.0, enabled=mode != "noise_off")
    config = tiny_noise_sft_config(f"{work}/{mode}", train_iters=steps, noise=noise)
    overrides = ["model.use_te_rng_tracker=true", "rerun_state_machine.check_for_nan_in_loss=false"]
    if mode == "graph":
        overrides += [
            "model.cuda_graph_impl=full_iteration",
            "model.cuda_graph_warmup_steps=2",
            "model.cuda_graph_use_single_mempool=false",  # the recipe evaluates: the launcher refuses one pool
        ]
    losses = Losses()
    launch(config, overrides, callbacks=[losses])
    with open(f"{work}/{mode}.json", "w") as out:
        json.dump(losses.rows, out)
"""


def test_every_replayed_step_adds_its_own_noise_and_matches_the_eager_run(tmp_path):
    script = tmp_path / "launch_tiny.py"
    script.write_text(textwrap.dedent(LAUNCHER))
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))  # tests.support
    modes = ("eager", "graph", "noise_off")
    runs = {
        mode: subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), mode, str(STEPS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=training_env(PYTHONPATH=path),
        )  # fmt: skip
        for mode in modes
    }
    outputs = {mode: run.communicate(timeout=500)[0] for mode, run in runs.items()}
    for mode, run in runs.items():
        assert run.returncode == 0, f"{mode}:\n{outputs[mode][-6000:]}"
    rows = {mode: json.loads((tmp_path / f"{mode}.json").read_text()) for mode in modes}
    losses = {mode: [row["lm loss"] for row in rows[mode]] for mode in modes}
    assert [row["graph"] for row in rows["graph"]] == [False, False] + [True] * (STEPS - 2)  # captured at step 3
    assert all(row["replayable"] for row in rows["graph"]) and not any(row["replayable"] for row in rows["eager"])
    for mode in modes:
        print(mode, " ".join(f"{loss:.7f}" for loss in losses[mode]))
    assert all(len(values) == STEPS for values in losses.values()), losses
    eager, graph, noise_off = losses["eager"], losses["graph"], losses["noise_off"]
    gap = [abs(a - b) for a, b in zip(eager, graph, strict=True)]
    noise_effect = [abs(a - b) for a, b in zip(eager, noise_off, strict=True)]
    print("max |graph - eager|", max(gap), " min |eager - noise off| after step 3", min(noise_effect[3:]))
    assert max(gap) <= 1e-5 * max(eager), gap
    assert min(noise_effect[3:]) > 100 * max(max(gap), 1e-7), noise_effect  # the noise moves the loss far more
    assert eager[-1] < eager[0]
