#!/usr/bin/env python3
"""Follow the recipe name from the command line through the package: its walk, stops, climbs back up and returns.

Runs a real front door in-process (default ``nemo llm finetune --factory tiny_noise_sft --dryrun``; ``--front-door
module``: ``python -m nemo_noise_plugin.cli.finetune``) under ``sys.setprofile`` and records each call of a function
defined inside the ``nemo_noise_plugin`` package whose frame, at call time, holds the recipe name among its arguments
and locals (free variables included). A value holds it when it is

* the name itself, the name with recipe arguments (``tiny_noise_sft(seq_length=64)``), the recipe function's name
  (``tiny_noise_sft_config``) or its import path (``nemo_noise_plugin.recipes.tiny:tiny_noise_sft_config``);
* a function of that name (the recipe function, or a wrapper named after it), or the recipe's own frame;
* one step away from such a value: an element of a list/tuple (``argv``), an attribute of an object (the
  ``Recipe`` registry entry, an ``argparse.Namespace``, a run context ``self``), a closure cell of a function
  (``lambda: _resolve_factory(factory)``) or an argument of a ``functools.partial``. Dictionaries are not searched
  (the ``RECIPES`` registry holds every name, not this one), nor anything two steps away (the ConfigContainer's
  ``checkpoint.save`` path, which contains the name as a folder).

The walk starts when the command line is parsed (``nemo``'s start-up, which imports the entry-point modules and
registers every recipe, is not part of it) and ends at the first call into a launcher module (``LAUNCHERS``) handed
the built ``ConfigContainer``, recorded as the last stop; in a dry run that is ``forward_step_for(config)`` of the
description. Calls to generator frames count when they start, not at each resume; module-level code, class bodies
and comprehensions do not count.

A real run (``--train-steps N``: ``nemo llm finetune --factory NAME -y train.train_iters=N`` in a scratch folder,
which holds the recipe's run folder, checkpoints and reports; a recipe on the embedded corpus trains on the CPU loop
without a GPU) is followed the same way with two changes: the walk does not end at the launcher but when the front
door returns (training, the report callbacks and what the command does after training included), and every call
into a launcher module handed the ``ConfigContainer`` is a call of the walk (a launcher holds the recipe's product,
not its name; consecutive ones are one stop as usual), the other calls counting by the rule above. So the name
reaching a report's provenance (``RunReport(folder, recipe=name)``: its methods' ``self`` holds it one step away)
counts, a report callback holding that ``RunReport`` (two steps) does not, and the training loop's frames, which hold
the ``ConfigContainer`` (the name only as a folder of ``checkpoint.save``), do not. Only calls of functions defined in
the package are looked at (the profile function returns at once for any other frame: Megatron's, torch's).

From the walk's modules (consecutive calls in one module are one stop):

* **stops**: the module visits in sequence (the number of times the walk enters a module, the first included);
* **climbs back up**: moves from a module on a lower import floor to one on a higher floor, the floors those of
  ``scripts/check_import_floors.py`` (``floor_of``). A module of the measured tree that today's layout does not
  have (an older commit's) is placed from that tree's own imports (``imported_modules``): on the highest floor among
  the modules it imports (the lowest floor from which none of its imports points up), the bottom floor if it imports
  none of the package;
* **returns**: visits to a module the walk had already left earlier.

Usage::

    python scripts/recipe_name_walk.py                                # nemo llm finetune --factory tiny_noise_sft
    python scripts/recipe_name_walk.py --front-door module --json     # python -m nemo_noise_plugin.cli.finetune
    PYTHONPATH=/tmp/old python scripts/recipe_name_walk.py            # another checkout's package, this script
    python scripts/recipe_name_walk.py --every-call                   # for comparison: every package call counts
    python scripts/recipe_name_walk.py --train-steps 2                # a real run: training and reports, to the end

The package measured is the one Python imports (``PYTHONPATH``); the floors are this script's checkout's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TODAY_ROOT = HERE.parent
PACKAGE = "nemo_noise_plugin"
LAUNCHERS = ("jobs.launch.launcher", "training.launch")
"""Modules (under the package) holding the launcher: today's, and its path before the jobs wing existed."""
SKIPPED_CODE = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")
_OPTIMIZED = 0x1  # CO_OPTIMIZED: a function's code, not a module's or a class body's
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x100 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ITERABLE_COROUTINE, CO_ASYNC_GENERATOR


def _floors_module() -> types.ModuleType:
    """``scripts/check_import_floors.py`` of this checkout (its floors and import reader)."""
    name = "check_import_floors"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "check_import_floors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# -- the figures ------------------------------------------------------------------------------------------------


@dataclass
class Figures:
    stops: int
    climbs: int
    returns: int


def collapse(modules: Sequence[str]) -> list[str]:
    """The walk's stops: ``modules`` with consecutive repeats merged."""
    stops: list[str] = []
    for module in modules:
        if not stops or stops[-1] != module:
            stops.append(module)
    return stops


def figures(modules: Sequence[str], floor: Callable[[str], int]) -> Figures:
    """Stops, climbs back up (to a higher floor: a smaller ``floor`` number, 0 = top) and returns of a walk."""
    stops = collapse(modules)
    climbs = sum(1 for before, after in zip(stops, stops[1:], strict=False) if floor(after) < floor(before))
    returns = sum(1 for index, module in enumerate(stops) if module in stops[:index])
    return Figures(len(stops), climbs, returns)


# -- the floors -------------------------------------------------------------------------------------------------


def floor_table(root: Path, today_root: Path = TODAY_ROOT) -> dict[str, int]:
    """``module -> floor number`` for every module of the package under ``root``.

    ``check_import_floors.floor_of`` for a module today's layout (``today_root``) has; a module it lacks sits on the
    highest floor among the modules it imports in ``root``'s tree (``check_import_floors.imported_modules``), the
    bottom floor if none (cycles cut where they close).
    """
    checker = _floors_module()
    today = checker.module_names(today_root, PACKAGE)
    modules = checker.module_names(root, PACKAGE)
    bottom = len(checker.FLOORS) - 1
    floors: dict[str, int] = {}
    for name in modules:
        if name in today:
            placed = checker.floor_of(name, PACKAGE)
            floors[name] = bottom if placed is None else placed
    visiting: set[str] = set()

    def place(name: str) -> int:
        if name in floors:
            return floors[name]
        if name in visiting:
            return bottom
        visiting.add(name)
        imported = checker.imported_modules(name, modules[name], modules)
        floors[name] = min((place(target) for target in sorted(imported)), default=bottom)
        visiting.discard(name)
        return floors[name]

    for name in modules:
        place(name)
    return floors


def floor_name(number: int) -> str:
    return _floors_module().FLOORS[number][1]


# -- following the name -----------------------------------------------------------------------------------------


def name_pattern(recipe: str) -> re.Pattern[str]:
    """Strings that name the recipe: the name, ``name(args)``, its function's name, its import path."""
    name = re.escape(recipe)
    return re.compile(rf"(?:[\w.]+[:.])?{name}(?:_config)?(?:\(.*\))?", re.DOTALL)


def _function_names_it(value: Any, pattern: re.Pattern[str]) -> bool:
    name = getattr(value, "__name__", None)
    return isinstance(name, str) and pattern.fullmatch(name) is not None


def holds(value: Any, pattern: re.Pattern[str], steps: int = 1) -> bool:
    """Whether ``value`` is the recipe name (or its function), or holds it ``steps`` steps away (see the module)."""
    if isinstance(value, str):
        return len(value) < 500 and pattern.fullmatch(value) is not None
    if isinstance(value, (int, float, bool, bytes, type(None), dict, type, types.ModuleType)):
        return False
    if isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        if _function_names_it(value, pattern):
            return True
        if steps <= 0:
            return False
        function = getattr(value, "__func__", value)
        cells = getattr(function, "__closure__", None) or ()
        return any(_cell_holds(cell, pattern, steps - 1) for cell in cells)
    if steps <= 0:
        return False
    if isinstance(value, functools.partial):
        return any(holds(v, pattern, steps - 1) for v in (value.func, *value.args, *value.keywords.values()))
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds(item, pattern, steps - 1) for item in list(value)[:256])
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return any(holds(item, pattern, steps - 1) for item in list(attributes.values())[:256])
    return False


def _cell_holds(cell: Any, pattern: re.Pattern[str], steps: int) -> bool:
    try:
        return holds(cell.cell_contents, pattern, steps)
    except ValueError:  # an empty cell
        return False


def _has_config_container(values: Any) -> bool:
    for value in values:
        kind = type(value)
        if kind.__name__ == "ConfigContainer" and kind.__module__.startswith("megatron.bridge"):
            return True
    return False


@dataclass
class Call:
    module: str
    function: str
    handed_to_launcher: bool = False


@dataclass
class Walk:
    """What one run recorded."""

    recipe: str
    front_door: str
    command: str
    root: str
    commit: str
    reach: int = 1
    every_call: bool = False
    train_steps: int | None = None
    calls: list[Call] = field(default_factory=list)
    exit_status: Any = None
    output_tail: str = ""
    main_job_lines: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def handed_to_launcher(self) -> bool:
        return any(call.handed_to_launcher for call in self.calls)


class NameFollower:
    """A ``sys.setprofile`` function recording the package's calls that hold the recipe name."""

    def __init__(
        self, recipe: str, package_dir: Path, reach: int = 1, every_call: bool = False, to_the_end: bool = False
    ) -> None:
        self.pattern = name_pattern(recipe)
        self.reach, self.every_call, self.to_the_end = reach, every_call, to_the_end
        self.prefix = str(package_dir) + os.sep
        self.calls: list[Call] = []
        self.done = False
        self._started_generators: dict[int, types.FrameType] = {}
        self._module_of: dict[str, str] = {}

    def module_of(self, filename: str) -> str:
        if filename not in self._module_of:
            parts = [PACKAGE, *Path(filename[len(self.prefix) :]).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            self._module_of[filename] = ".".join(parts)
        return self._module_of[filename]

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.done:
            return
        code = frame.f_code
        if not code.co_filename.startswith(self.prefix) or code.co_name in SKIPPED_CODE:
            return
        if not code.co_flags & _OPTIMIZED:
            return
        if code.co_flags & _GENERATOR_FLAGS:
            if id(frame) in self._started_generators:  # a resume, not a call
                return
            self._started_generators[id(frame)] = frame
        module = self.module_of(code.co_filename)
        values = list(frame.f_locals.values())
        if module.removeprefix(PACKAGE + ".") in LAUNCHERS and _has_config_container(values):
            self.calls.append(Call(module, code.co_qualname, handed_to_launcher=True))
            self.done = not self.to_the_end  # a dry run's walk ends here; a real run's goes on to the command's end
            return
        if (
            self.every_call
            or self.pattern.fullmatch(code.co_name)
            or any(holds(value, self.pattern, self.reach) for value in values)
        ):
            self.calls.append(Call(module, code.co_qualname))


def _commit(root: Path) -> str:
    result = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() or "?"


def _front_door(front_door: str, argv: list[str]) -> tuple[str, Callable[[], Any]]:
    """``(command line, a function running it)``; what a front door does before parsing its line is done here."""
    if front_door == "nemo":
        sys.argv = ["nemo", *argv]
        from nemo_run.cli.api import create_cli

        app = create_cli()  # imports the entry-point modules and registers their factories: not part of the walk
        return "nemo " + " ".join(argv), lambda: app(args=argv, prog_name="nemo")
    sys.argv = ["python -m nemo_noise_plugin.cli.finetune", *argv]
    from nemo_noise_plugin.cli import finetune as finetune_cli

    return "python -m nemo_noise_plugin.cli.finetune " + " ".join(argv), lambda: finetune_cli.main(argv)


MAIN_JOB_LINE = re.compile(r"^.*(?:main job|on the embedded corpus|clean pre-training|-- control).*$", re.MULTILINE)
"""Lines of the main job's orchestration (``launch_with_report``'s banner and phases) in a command's output."""


def command_line(recipe: str, front_door: str = "nemo", train_steps: int | None = None) -> list[str]:
    """The front door's arguments: ``--factory recipe --dryrun``, or a real run of ``train_steps`` iterations."""
    head = ["llm", "finetune"] if front_door == "nemo" else []
    if train_steps is None:
        return [*head, "--factory", recipe, "--dryrun"]
    return [*head, "--factory", recipe, "-y", f"train.train_iters={train_steps}"]


def follow(
    recipe: str,
    front_door: str = "nemo",
    extra: Sequence[str] = (),
    reach: int = 1,
    every_call: bool = False,
    train_steps: int | None = None,
) -> Walk:
    """Run the front door on ``--factory recipe --dryrun`` (or a real run of ``train_steps`` iterations) in a scratch
    folder, following the recipe name."""
    import time

    import nemo_noise_plugin

    package_dir = Path(nemo_noise_plugin.__file__).resolve().parent
    argv = [*command_line(recipe, front_door, train_steps), *extra]
    output = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="recipe-name-walk-") as scratch:
        cwd = os.getcwd()
        os.chdir(scratch)  # the recipe's run folder (./nemo_experiments/<name>) lands here
        saved_argv = sys.argv
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                command, run = _front_door(front_door, argv)
                follower = NameFollower(recipe, package_dir, reach, every_call, to_the_end=train_steps is not None)
                status: Any = None
                started = time.monotonic()
                sys.setprofile(follower)
                try:
                    status = run()
                except SystemExit as stop:
                    status = stop.code
                finally:
                    sys.setprofile(None)
                    seconds = time.monotonic() - started
        finally:
            sys.argv = saved_argv
            os.chdir(cwd)
    root = package_dir.parent
    walk = Walk(recipe, front_door, command, str(root), _commit(root), reach, every_call, train_steps)
    walk.calls, walk.exit_status, walk.output_tail = follower.calls, status, output.getvalue()[-3000:]
    walk.main_job_lines = [line.strip() for line in MAIN_JOB_LINE.findall(output.getvalue())][:20]
    walk.seconds = round(seconds, 1)
    return walk


# -- the report -------------------------------------------------------------------------------------------------


def summary(walk: Walk, today_root: Path = TODAY_ROOT) -> dict[str, Any]:
    floors = floor_table(Path(walk.root), today_root)
    bottom = len(_floors_module().FLOORS) - 1
    floor = lambda module: floors.get(module, bottom)  # noqa: E731
    modules = [call.module for call in walk.calls]
    stops: list[dict[str, Any]] = []
    for call in walk.calls:
        if not stops or stops[-1]["module"] != call.module:
            number = floor(call.module)
            stops.append(dict(module=call.module, floor=number, floor_name=floor_name(number), functions=[]))
        if call.function not in stops[-1]["functions"]:
            stops[-1]["functions"].append(call.function)
    seen: set[str] = set()
    for index, stop in enumerate(stops):
        stop["climb"] = index > 0 and stop["floor"] < stops[index - 1]["floor"]
        stop["return"] = stop["module"] in seen
        seen.add(stop["module"])
    return dict(
        recipe=walk.recipe,
        front_door=walk.front_door,
        command=walk.command,
        root=walk.root,
        commit=walk.commit,
        reach=walk.reach,
        every_call=walk.every_call,
        train_steps=walk.train_steps,
        exit_status=walk.exit_status,
        handed_to_launcher=walk.handed_to_launcher,
        main_job_lines=walk.main_job_lines,
        seconds=walk.seconds,
        calls=[asdict(call) for call in walk.calls],
        walk=stops,
        output_tail=walk.output_tail,
        **asdict(figures(modules, floor)),
    )


def print_summary(result: dict[str, Any]) -> None:
    print(f"{result['command']}  (package at {result['root']}, commit {result['commit']})")
    for number, stop in enumerate(result["walk"], 1):
        marks = ("^ climb " if stop["climb"] else "") + ("<- return" if stop["return"] else "")
        module = stop["module"].removeprefix(PACKAGE + ".")
        print(
            f"{number:>3}. {module:<32} floor {stop['floor']:>2} {stop['floor_name']:<26} {marks:<18} "
            f"{', '.join(stop['functions'])}"
        )
    if not result["handed_to_launcher"]:
        print(f"(the walk ended without reaching a launcher; exit status {result['exit_status']!r})")
    elif result["exit_status"] not in (0, None):
        print(f"(the command failed: exit status {result['exit_status']!r}; its output ends:\n{result['output_tail']})")
    for line in result["main_job_lines"]:
        print(f"main job's orchestration in the output: {line}")
    print(f"stops {result['stops']}, climbs back up {result['climbs']}, returns {result['returns']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factory", default="tiny_noise_sft", help="the recipe name to follow")
    parser.add_argument(
        "--front-door",
        choices=("nemo", "module"),
        default="nemo",
        help="nemo: `nemo llm finetune`; module: `python -m nemo_noise_plugin.cli.finetune`",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--reach", type=int, default=1, help="how many steps away from a frame's values the name counts (default 1)"
    )
    parser.add_argument(
        "--every-call", action="store_true", help="for comparison: record every package call, holding the name or not"
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        metavar="N",
        help="a real run of N iterations (train.train_iters=N, -y) instead of --dryrun, followed to the command's end",
    )
    args = parser.parse_args(argv)
    walk = follow(
        args.factory, args.front_door, reach=args.reach, every_call=args.every_call, train_steps=args.train_steps
    )
    result = summary(walk)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_summary(result)
    if not result["calls"]:
        print(f"nothing followed; the front door's output:\n{result.get('output_tail', '')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
