"""A stand-in for NeMo 2's ``nemo.collections.llm`` package: its ``llm finetune`` entrypoint and nothing else.

NeMo 2 (``nemo-toolkit``) needs megatron-core 0.16 and cannot be installed next to this plugin's 0.19; what the
plugin does when it is importable (its command moves to ``nemo noise finetune``) is tested with this package on
``PYTHONPATH``, which registers ``finetune`` in NeMo-Run's ``llm`` namespace as NeMo 2 does.
"""

from __future__ import annotations

import pathlib


def write_nemo2_llm(root: pathlib.Path) -> pathlib.Path:
    """Write the stand-in package under ``root`` (put ``root`` on ``PYTHONPATH``); returns ``root``."""
    llm = root / "nemo" / "collections" / "llm"
    llm.mkdir(parents=True)
    (root / "nemo" / "__init__.py").write_text("")
    (root / "nemo" / "collections" / "__init__.py").write_text("")
    (llm / "__init__.py").write_text(
        "import nemo_run as run\n\n@run.cli.entrypoint(namespace='llm')\ndef finetune(model: str = 'm') -> None:\n"
        "    pass\n"
    )
    return root
