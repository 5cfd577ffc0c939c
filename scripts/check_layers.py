#!/usr/bin/env python3
"""Check the package's house plan: imports point down the floors only, and no two modules import each other.

Every ``import`` statement in the package counts, including those inside functions and under ``TYPE_CHECKING``:
a lazy import upward is still an upward import. ``from package import name`` counts as an import of
``package.name`` when that is a module. Usage::

    python scripts/check_layers.py            # counts and each violation; exit 1 on any
    python scripts/check_layers.py --tree     # also the module tree, one line per module (its docstring's first line)
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "nemo_noise_plugin"

FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("command line", ("cli", "__main__", "")),
    ("training", ("training",)),
    (
        "providers, recipes, reports",
        ("providers", "recipes", "robustness", "audit_report", "evaluation", "provenance"),
    ),
    ("distillation", ("distillation",)),
    ("model", ("model",)),
    ("schedule plan", ("schedule_plan",)),
    ("privacy", ("privacy",)),
    ("noise", ("noise",)),
    (
        "utilities",
        (
            "utils",
            "bridge_imports",
            "validation",
            "presets",
            "cpu",
            "corpus",
            "batches",
            "pretrained",
            "upstream_copies",
            "artifacts",
            "instructions",
            "yaml_files",
        ),
    ),
]
"""Top floor first. A module's floor is that of its first path component under the package ("" = the package)."""


@dataclass
class Report:
    """What the check found."""

    modules: dict[str, Path] = field(default_factory=dict)
    edges: dict[str, set[str]] = field(default_factory=dict)
    unplaced: list[str] = field(default_factory=list)
    upward: list[tuple[str, str]] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)


def module_names(root: Path, package: str) -> dict[str, Path]:
    """``dotted.name -> file`` for every module of the package under ``root`` (``__init__`` as the package)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` of a non-module attribute path
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def floor_of(name: str, package: str) -> int | None:
    """Index of the floor holding ``name`` (0 = top), or None when no floor lists it."""
    first = name[len(package) + 1 :].split(".")[0] if name != package else ""
    for index, (_, components) in enumerate(FLOORS):
        if first in components:
            return index
    return None


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def check(root: Path, package: str = PACKAGE) -> Report:
    """Walk the package under ``root`` and report unplaced modules, upward imports and import cycles."""
    report = Report(modules=module_names(root, package))
    for name, path in report.modules.items():
        report.edges[name] = imported_modules(name, path, report.modules)
        floor = floor_of(name, package)
        if floor is None:
            report.unplaced.append(name)
            continue
        for target in sorted(report.edges[name]):
            target_floor = floor_of(target, package)
            if target_floor is not None and target_floor < floor:
                report.upward.append((name, target))
    report.cycles = strongly_connected(report.edges)
    return report


def first_docstring_line(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    return docstring.strip().splitlines()[0] if docstring.strip() else "(no docstring)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--tree", action="store_true", help="print the module tree with each module's purpose")
    args = parser.parse_args(argv)
    report = check(args.root)
    if args.tree:
        for name, path in report.modules.items():
            print(f"{name:<48} {first_docstring_line(path)}")
        print()
    for name in report.unplaced:
        print(f"unplaced module (add it to a floor in scripts/check_layers.py): {name}")
    for source, target in report.upward:
        print(f"upward import: {source} -> {target}")
    for cycle in report.cycles:
        print(f"import cycle: {' <-> '.join(cycle)}")
    print(
        f"{len(report.modules)} modules, {sum(map(len, report.edges.values()))} imports: "
        f"{len(report.cycles)} import cycles, {len(report.upward)} upward imports, {len(report.unplaced)} unplaced"
    )
    return 1 if report.cycles or report.upward or report.unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
