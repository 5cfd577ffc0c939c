"""A user script may import the plugin first and then Megatron-Bridge directly, without Transformer Engine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # two fresh interpreters importing Bridge: about a minute on 2 cores

SCRIPT = """
import json, sys
import nemo_noise_plugin
before = sorted(name for name in sys.modules if name.startswith("megatron.bridge"))
from megatron.bridge import AutoBridge
from nemo_noise_plugin.upstream.bridge_imports import SUBSTITUTED_MODULES
print(json.dumps({"bridge_before": before, "auto_bridge": AutoBridge.__name__, "substituted": SUBSTITUTED_MODULES,
                  "te_in_sys_modules": "transformer_engine" in sys.modules}))
"""


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE installed: nothing to shim")
def test_a_script_importing_the_plugin_then_autobridge_works_without_transformer_engine():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bridge_before"] == []  # importing the plugin imports no Bridge module
    assert report["auto_bridge"] == "AutoBridge"
    assert "megatron.bridge.peft.lora_layers" in report["substituted"]
    assert report["te_in_sys_modules"] is False  # TE itself is never faked


def test_without_the_plugin_the_same_line_fails_on_transformer_engine():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TE installed: Bridge imports without the shim")
    result = subprocess.run(
        [sys.executable, "-c", "from megatron.bridge import AutoBridge"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode != 0 and "transformer_engine" in result.stderr
