"""Megatron-Bridge imports here through the plugin's single import point; only missing packages are substituted."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import nemo_noise_plugin

PACKAGE_ROOT = pathlib.Path(nemo_noise_plugin.__file__).parent


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _expected_substitutions() -> list[str]:
    """What is missing here, probed in a fresh interpreter (this one may already hold substitutes)."""
    probe = _run(
        """
        import importlib.util, json
        def missing(name):
            try:
                return importlib.util.find_spec(name) is None
            except ImportError:
                return True
        print(json.dumps({name: missing(name) for name in
                          ["transformer_engine", "nvidia_resiliency_ext", "nvidia_resiliency_ext.inprocess"]}))
        """
    )
    missing = json.loads(probe.stdout.strip().splitlines()[-1])
    expected = []
    if missing["transformer_engine"]:
        expected.append("megatron.bridge.peft.lora_layers")
    if missing["nvidia_resiliency_ext.inprocess"]:
        if missing["nvidia_resiliency_ext"]:
            expected.append("nvidia_resiliency_ext")
        expected.append("nvidia_resiliency_ext.inprocess")
    return expected


def test_bridge_modules_the_plugin_needs_import_and_only_missing_packages_are_substituted():
    result = _run(
        """
        import json, sys
        from nemo_noise_plugin.upstream.bridge_imports import import_bridge, SUBSTITUTED_MODULES
        for name in ["megatron.bridge", "megatron.bridge.models.gpt_provider", "megatron.bridge.training.config",
                     "megatron.bridge.training.gpt_step", "megatron.bridge.training.finetune",
                     "megatron.bridge.recipes", "megatron.bridge.training.utils.omegaconf_utils",
                     "megatron.bridge.models.distillation_provider"]:
            import_bridge(name)
        print(json.dumps({"substituted": SUBSTITUTED_MODULES,
                          "te_in_sys_modules": "transformer_engine" in sys.modules}))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["substituted"] == _expected_substitutions()
    assert report["te_in_sys_modules"] is False  # TE is never faked
    if report["substituted"]:
        assert result.stderr.count("nemo_noise_plugin substituted modules") == 1
        assert "transformer_engine missing" in result.stderr or "nvidia-resiliency-ext missing" in result.stderr


def test_substituted_classes_fail_clearly_when_used():
    result = _run(
        """
        from nemo_noise_plugin.upstream.bridge_imports import ensure_bridge_importable, MissingDependencyError
        substituted = ensure_bridge_importable()
        import importlib
        messages = []
        for module_name, class_name in [("megatron.bridge.peft.lora_layers", "LoRALinear"),
                                        ("nvidia_resiliency_ext.inprocess", "CallWrapper")]:
            if module_name not in substituted:
                continue
            try:
                getattr(importlib.import_module(module_name), class_name)()
            except MissingDependencyError as error:
                messages.append(str(error))
            module = importlib.import_module(module_name)
            # absent, not failing, for hasattr/getattr-with-default (torch.compile's pickler walks modules so)
            assert getattr(module, "torch", "absent") == "absent" and not hasattr(module, "torch")
            try:
                module.torch
            except AttributeError as error:
                messages.append(str(error))
        print("\\n".join(messages))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if "megatron.bridge.peft.lora_layers" in _expected_substitutions():
        assert "LoRALinear is unavailable: Transformer Engine is not installed" in result.stdout
        assert "megatron.bridge.peft.lora_layers.torch is unavailable" in result.stdout
    if "nvidia_resiliency_ext.inprocess" in _expected_substitutions():
        assert "CallWrapper is unavailable: nvidia-resiliency-ext is not installed" in result.stdout


def test_no_other_plugin_module_imports_megatron_bridge():
    offenders = []
    for path in PACKAGE_ROOT.rglob("*.py"):
        if path.name == "upstream/bridge_imports.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {name}" for name in names if name.startswith("megatron.bridge")]
    assert offenders == []
