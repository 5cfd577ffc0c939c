"""Build step of the wheel: ship the top-level ``configs/`` (the noise and KD presets' one source) inside the package.

Everything else is declared in pyproject.toml. Package data must live inside the package folder, and the presets
live at the top level (``configs/noise/*.yaml``, ``configs/kd/*.yaml``), so ``build_py`` copies them into the built
package as ``nemo_noise_plugin/configs/``, where ``nemo_noise_plugin.presets`` reads them after ``pip install``; the
sdist carries ``configs/`` so a wheel built from it has them too. An editable install (``pip install -e .``, ``make
setup``) copies nothing: the package runs from the checkout and ``nemo_noise_plugin.presets`` reads ``configs/``
there.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONFIGS = Path("configs")
PACKAGE = "nemo_noise_plugin"


class BuildPyWithConfigs(build_py):
    """``build_py`` that also copies ``configs/*/*.yaml`` to ``<build_lib>/nemo_noise_plugin/configs/``."""

    def _configs(self) -> list[Path]:
        return sorted(CONFIGS.glob("*/*.yaml"))

    def _targets(self) -> list[str]:
        return [str(Path(self.build_lib, PACKAGE, source)) for source in self._configs()]

    def run(self) -> None:
        if not self.editable_mode:
            # setuptools keeps build/lib between builds of a checkout and ships whatever is left there: without
            # this, a file moved or deleted (the presets once lived in nemo_noise_plugin/presets/) stays in wheels.
            shutil.rmtree(Path(self.build_lib, PACKAGE), ignore_errors=True)
        super().run()
        if self.editable_mode:
            return
        for source, target in zip(self._configs(), self._targets(), strict=True):
            self.mkpath(str(Path(target).parent))
            self.copy_file(str(source), target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return super().get_outputs(include_bytecode) + ([] if self.editable_mode else self._targets())

    def get_source_files(self) -> list[str]:
        """Also the sdist's list: ``configs/`` ships in it."""
        return super().get_source_files() + [str(source) for source in self._configs()]


setup(cmdclass={"build_py": BuildPyWithConfigs})
