"""`nemo llm finetune --help` offers only what the command does (NeMo-Run's generic command also lists --yaml,
--load, --repl, --to-toml, --to-json and gives -y to both --yaml and --yes)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

NEMO = pathlib.Path(sys.executable).with_name("nemo")


@pytest.mark.slow
def test_finetune_help_lists_only_the_options_that_work():
    result = subprocess.run(
        [str(NEMO), "llm", "finetune", "--help"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.strip("│ ").split() for line in result.stdout.splitlines() if line.startswith("│ -")]
    options = [word for row in rows for word in row[:2] if word.startswith("-")]
    expected = {"--factory", "-f", "--config-file", "-c", "--dryrun", "--to-yaml", "--yes", "-y", "--verbose"}
    assert expected <= set(options), options
    assert not set(options) & {"--yaml", "--load", "--repl", "--to-toml", "--to-json", "--rich-theme", "--direct"}
    assert options.count("-y") == 1
