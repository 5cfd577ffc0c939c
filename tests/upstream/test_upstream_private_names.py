"""The private upstream names the plugin uses: every one still exists, and none is used without being listed."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

from nemo_noise_plugin.upstream.private_names import PRIVATE_UPSTREAM_NAMES, PrivateUpstreamName

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "nemo_noise_plugin"
UPSTREAM = ("megatron", "nemo_run", "modelopt", "transformer_engine")
INSTANCE_ATTRIBUTE_USES = {
    "_pg_collection": "megatron.bridge.models.gpt_provider:GPTModelProvider._pg_collection",
    "_calculate_scheduler_steps": "megatron.bridge.training.config:ConfigContainer._calculate_scheduler_steps",
}
"""Private members reached through an instance (``provider._pg_collection``), which the module scan cannot type."""


def _resolves(entry: PrivateUpstreamName) -> bool:
    module_name, _, qualified = entry.name.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError:  # ``module.Class`` written as the module path
        module_name, _, owner = module_name.rpartition(".")
        target = getattr(importlib.import_module(module_name), owner)
    *owners, last = qualified.split(".")
    for part in owners:
        target = getattr(target, part)
    if hasattr(target, last):
        return True
    if entry.instance_attribute and inspect.isclass(target):
        fields = getattr(target, "__dataclass_fields__", {})
        return last in fields or f"self.{last}" in inspect.getsource(target)
    return False


def private_upstream_uses(root: pathlib.Path) -> set[str]:
    """``module:name`` of every private upstream name the modules under ``root`` reach through a module: an
    ``import_bridge("...")`` result, an imported upstream module, or ``from upstream import _name``."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args:
                function = node.value.func
                name = getattr(function, "id", getattr(function, "attr", None))
                argument = node.value.args[0]
                if name == "import_bridge" and isinstance(argument, ast.Constant):
                    modules.update({t.id: argument.value for t in node.targets if isinstance(t, ast.Name)})
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(UPSTREAM):
                        modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else ""
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(UPSTREAM):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.add(f"{node.module}:{alias.name}")
                    else:
                        modules.setdefault(alias.asname or alias.name, f"{node.module}.{alias.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and modules.get(node.value.id)
            ):
                found.add(f"{modules[node.value.id]}:{node.attr}")
            elif isinstance(node, ast.Attribute) and node.attr in INSTANCE_ATTRIBUTE_USES:
                found.add(INSTANCE_ATTRIBUTE_USES[node.attr])
    return found


@pytest.mark.parametrize("entry", PRIVATE_UPSTREAM_NAMES, ids=lambda entry: entry.name.rpartition(":")[2])
def test_every_listed_private_name_still_exists_upstream(entry):
    assert _resolves(entry), (
        f"{entry.name} is gone from the installed upstream package: {entry.used_by} uses it ({entry.why}); "
        "re-read upstream, change the plugin, then nemo_noise_plugin/upstream/private_names.py"
    )
    assert importlib.import_module(entry.used_by)


def test_the_package_uses_no_private_upstream_name_that_is_not_listed():
    listed = {entry.name for entry in PRIVATE_UPSTREAM_NAMES}
    unlisted = private_upstream_uses(PACKAGE) - listed
    assert not unlisted, f"add these to nemo_noise_plugin/upstream/private_names.py (or stop using them): {unlisted}"


def test_every_listed_name_is_still_used_by_the_package():
    used = private_upstream_uses(PACKAGE)
    assert {entry.name for entry in PRIVATE_UPSTREAM_NAMES} <= used


def test_the_scan_finds_a_new_private_use(tmp_path):
    (tmp_path / "module.py").write_text(
        "from megatron.core import parallel_state\n"
        "from nemo_run.cli.api import _is_torchrun\n"
        "def f(import_bridge):\n"
        "    gpt_step = import_bridge('megatron.bridge.training.gpt_step')\n"
        "    return gpt_step._forward_step_common, parallel_state._TENSOR_MODEL_PARALLEL_GROUP\n"
    )
    assert private_upstream_uses(tmp_path) == {
        "nemo_run.cli.api:_is_torchrun",
        "megatron.bridge.training.gpt_step:_forward_step_common",
        "megatron.core.parallel_state:_TENSOR_MODEL_PARALLEL_GROUP",
    }
