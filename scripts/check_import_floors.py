#!/usr/bin/env python3
"""Check the package's import floors: two wings, imports pointing down only, no cycles, no floor too wide.

The package has two wings under the command line. The **library** (``noise``, ``model``, ``schedule_plan``,
``distillation``, ``privacy``, ``providers``, ``recipes``, ``training``, ``data``, ``presets``, the utilities) is what
a Bridge or Megatron user imports; the **jobs** wing (``jobs/``: launcher, main job, CPU loop, reports, executors)
runs it; ``cli/`` parses arguments over the jobs. The library imports neither the jobs wing nor ``cli/``.

Every ``import`` statement in the package counts, including those inside functions and under ``TYPE_CHECKING``:
a lazy import upward is still an upward import. ``from package import name`` counts as an import of
``package.name`` when that is a module. A floor lists dotted prefixes under the package; a module belongs to the
floor of its longest matching prefix, so a wide folder can be ordered into sub-floors without moving files.
A module's wing is its first folder under the package: ``jobs/`` is the jobs wing, ``cli/`` (and ``__main__``) the
command line, every other folder and root module the library; the floors table cannot move a module across wings.
Folders import each other one way only: two sibling folders (``noise/`` and ``model/``, ``jobs/launch/`` and
``jobs/reports/``) that import each other, directly or round a ring of folders, are a folder cycle, even when no
module cycle joins them. The check fails on an import cycle, a folder cycle, an upward import, a library -> jobs or
library -> cli import, a module on no floor, more than ``MAX_ROOT_MODULES`` modules at the package root (besides
``__init__`` and ``__main__``), or a floor of more than ``MAX_FLOOR_WIDTH`` modules. Usage::

    python scripts/check_import_floors.py          # figures and each violation; exit 1 on any
    python scripts/check_import_floors.py --tree   # also the module tree: module, wing, first docstring line
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "nemo_noise_plugin"

CLI, JOBS, LIBRARY = "cli", "jobs", "library"
"""The wings, top first: ``cli`` may import both others, ``jobs`` the library, the library neither."""

MAX_ROOT_MODULES = 5
"""Modules directly under the package, besides ``__init__`` and ``__main__``."""
MAX_FLOOR_WIDTH = 8
"""Modules on one floor: they import each other in no fixed order, so a reader takes them in at once."""

WING_FOLDERS = {"cli": CLI, "jobs": JOBS}
"""First folder under the package -> wing; any other folder, and every root module but ``__main__``, is the library."""

FLOORS: list[tuple[str, str, tuple[str, ...]]] = [
    (CLI, "front doors", ("__main__", "cli.main_job", "cli.nemo_llm", "cli.finetune", "cli.nemo_noise")),
    (CLI, "command-line support", ("cli",)),
    (JOBS, "executors", ("jobs.executors",)),
    (JOBS, "main job", ("jobs.main_job",)),
    (JOBS, "launch", ("jobs.launch",)),
    (JOBS, "audit", ("jobs.audit",)),
    (JOBS, "reports", ("jobs.reports",)),
    (
        JOBS,
        "report measures",
        (
            "jobs.reports.robustness_statistics",
            "jobs.reports.task_metric",
            "jobs.reports.task_frontier",
            "jobs.reports.hf_export",
        ),
    ),
    (JOBS, "report files", ("jobs.reports.artifacts", "jobs.reports.provenance")),
    (JOBS, "CPU loop", ("jobs.cpu",)),
    (JOBS, "models", ("jobs.models",)),
    (JOBS, "progress, batches", ("jobs",)),
    (LIBRARY, "package", ("",)),
    (LIBRARY, "forward steps, overrides", ("training",)),
    (LIBRARY, "recipes", ("recipes",)),
    (LIBRARY, "task data", ("data.tasks",)),
    (LIBRARY, "provider conversion", ("providers.conversion",)),
    (LIBRARY, "providers, data", ("providers", "data")),
    (
        LIBRARY,
        "distillation: teacher",
        ("distillation", "distillation.plan_loss", "distillation.teacher", "distillation.teacher_weights"),
    ),
    (
        LIBRARY,
        "distillation: losses",
        (
            "distillation.pipeline_teacher",
            "distillation.losses",
            "distillation.divergences",
            "distillation.kd_kernel",
            "distillation.vocab_parallel",
            "distillation.config",
        ),
    ),
    (LIBRARY, "model", ("model",)),
    (LIBRARY, "schedule plan", ("schedule_plan",)),
    (LIBRARY, "privacy audit", ("privacy.audit", "privacy.audit.run", "privacy.audit.sweep")),
    (LIBRARY, "privacy ledger", ("privacy",)),
    (
        LIBRARY,
        "privacy attacks",
        (
            "privacy.audit.attacks",
            "privacy.audit.beam",
            "privacy.audit.noised",
            "privacy.audit.search",
            "privacy.audit.statistics",
            "privacy.audit.checks",
        ),
    ),
    (LIBRARY, "noise layer", ("noise", "noise.layer", "noise.replayable", "noise.hf_inference", "noise.hf_inputs")),
    (
        LIBRARY,
        "noise draws",
        ("noise.mechanisms", "noise.schedule", "noise.geometry", "noise.projection", "noise.denoise"),
    ),
    (
        LIBRARY,
        "noise config",
        ("noise.config", "noise.calibration", "noise.families", "noise.bounds", "noise.densities", "noise.token_prior"),
    ),
    (
        LIBRARY,
        "random streams",
        ("noise.sampling", "noise.fused_noise", "noise.triton_kernel", "noise.triton_math", "noise.philox"),
    ),
    (LIBRARY, "presets", ("presets",)),
    (LIBRARY, "utilities", ("utils", "validation", "yaml_files", "upstream")),
]
"""``(wing, floor, dotted prefixes)``, top floor first. A module's floor is that of its longest matching prefix
(``""`` = the package ``__init__`` only). The wing column says which wing the floor's modules must lie in (by their
folder, ``wing_of_module``); a floor holding a module of another wing is a misplaced module."""


@dataclass
class Report:
    """What the check found."""

    modules: dict[str, Path] = field(default_factory=dict)
    edges: dict[str, set[str]] = field(default_factory=dict)
    unplaced: list[str] = field(default_factory=list)
    upward: list[tuple[str, str]] = field(default_factory=list)
    across_wings: list[tuple[str, str]] = field(default_factory=list)
    """Imports from the library into the jobs wing or ``cli/`` (each is also upward)."""
    cycles: list[list[str]] = field(default_factory=list)
    folder_cycles: list[list[str]] = field(default_factory=list)
    """Sibling folders that import each other (directly or round a ring), as dotted folder names."""
    misplaced: list[str] = field(default_factory=list)
    """Modules on a floor of another wing than their folder's."""
    root_modules: list[str] = field(default_factory=list)
    """Modules directly under the package, besides ``__init__`` and ``__main__``."""
    floor_widths: dict[str, int] = field(default_factory=dict)
    """Floor name -> how many modules it holds."""

    @property
    def widest_floor(self) -> tuple[str, int]:
        """The floor with the most modules, and that number."""
        return max(self.floor_widths.items(), key=lambda item: item[1], default=("", 0))

    @property
    def too_wide(self) -> list[tuple[str, int]]:
        """The floors wider than ``MAX_FLOOR_WIDTH``."""
        return [(name, width) for name, width in self.floor_widths.items() if width > MAX_FLOOR_WIDTH]

    @property
    def failed(self) -> bool:
        """Whether anything breaks the plan."""
        return bool(
            self.cycles
            or self.folder_cycles
            or self.misplaced
            or self.upward
            or self.across_wings
            or self.unplaced
            or self.too_wide
            or len(self.root_modules) > MAX_ROOT_MODULES
        )


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
    """Index of the floor holding ``name`` (0 = top): its longest matching prefix; None when no floor lists it."""
    relative = name[len(package) + 1 :] if name != package else ""
    best, best_length = None, -1
    for index, (_, _, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            matches = relative == prefix if prefix == "" else relative == prefix or relative.startswith(prefix + ".")
            if matches and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    return best


def wing_of(floor: int) -> str:
    """The wing of floor number ``floor``."""
    return FLOORS[floor][0]


def wing_of_module(name: str, package: str) -> str:
    """The wing of module ``name``, from its first folder under the package (``__main__``: the command line)."""
    parts = name.split(".")[1:]
    if parts == ["__main__"]:
        return CLI
    return WING_FOLDERS.get(parts[0], LIBRARY) if parts else LIBRARY


def folder_of(path: Path, root: Path, package: str) -> tuple[str, ...]:
    """The folders of ``path`` under the package, outermost first (``()`` for a root module or the package)."""
    return path.relative_to(root / package).parent.parts


def folder_edges(report: Report, root: Path, package: str) -> dict[str, set[str]]:
    """Folder -> the sibling folders it imports: an import from ``a/x/m`` into ``a/y/n`` is the edge ``a.x -> a.y``.

    A module directly in a folder importing one of the folder's own subfolders is no edge between siblings, and a
    root module is in no folder.
    """
    edges: dict[str, set[str]] = {}
    for name, targets in report.edges.items():
        source = folder_of(report.modules[name], root, package)
        for target_name in targets:
            target = folder_of(report.modules[target_name], root, package)
            shared = 0
            while shared < min(len(source), len(target)) and source[shared] == target[shared]:
                shared += 1
            if shared < len(source) and shared < len(target):
                from_folder, to_folder = ".".join(source[: shared + 1]), ".".join(target[: shared + 1])
                edges.setdefault(from_folder, set()).add(to_folder)
    return edges


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
    """Walk the package under ``root`` and report what breaks the plan, with the root and floor widths."""
    report = Report(modules=module_names(root, package))
    report.floor_widths = {name: 0 for _, name, _ in FLOORS}
    for name, path in report.modules.items():
        report.edges[name] = imported_modules(name, path, report.modules)
        if path.parent == root / package and path.stem not in ("__init__", "__main__"):
            report.root_modules.append(name)
        floor = floor_of(name, package)
        if floor is None:
            report.unplaced.append(name)
            continue
        report.floor_widths[FLOORS[floor][1]] += 1
        if wing_of(floor) != wing_of_module(name, package):
            report.misplaced.append(name)
        for target in sorted(report.edges[name]):
            target_floor = floor_of(target, package)
            if target_floor is not None and target_floor < floor:
                report.upward.append((name, target))
            if wing_of_module(name, package) == LIBRARY and wing_of_module(target, package) != LIBRARY:
                report.across_wings.append((name, target))
    report.cycles = strongly_connected(report.edges)
    report.folder_cycles = strongly_connected(folder_edges(report, root, package))
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
            wing = wing_of_module(name, PACKAGE)
            print(f"{name:<48} {wing:<8} {first_docstring_line(path)}")
        print()
    for name in report.unplaced:
        print(f"unplaced module (add it to a floor in scripts/check_import_floors.py): {name}")
    for name in report.misplaced:
        print(f"module on a floor of another wing than its folder's ({wing_of_module(name, PACKAGE)}): {name}")
    for source, target in report.across_wings:
        print(f"library imports the {wing_of_module(target, PACKAGE)} wing: {source} -> {target}")
    for source, target in report.upward:
        print(f"upward import: {source} -> {target}")
    for cycle in report.cycles:
        print(f"import cycle: {' <-> '.join(cycle)}")
    for cycle in report.folder_cycles:
        print(f"folder cycle: {' <-> '.join(cycle)}")
    for name, width in report.too_wide:
        print(f"floor too wide: {name!r} holds {width} modules (at most {MAX_FLOOR_WIDTH})")
    if len(report.root_modules) > MAX_ROOT_MODULES:
        print(f"root too wide: {', '.join(report.root_modules)} (at most {MAX_ROOT_MODULES} modules)")
    widest, width = report.widest_floor
    print(
        f"{len(report.modules)} modules, {sum(map(len, report.edges.values()))} imports: "
        f"{len(report.cycles)} import cycles, {len(report.upward)} upward imports, "
        f"{len(report.unplaced)} unplaced; "
        f"library -> jobs/cli imports {len(report.across_wings)} by folder, folder cycles {len(report.folder_cycles)}; "
        f"root {len(report.root_modules)} modules (max {MAX_ROOT_MODULES}), "
        f"widest floor {widest!r} {width} modules (max {MAX_FLOOR_WIDTH})"
    )
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
