#!/usr/bin/env python3
"""Run every catalogued bad input (tests/support/bad_inputs.py) and write the table docs/bad_inputs.md.

.venv/bin/python scripts/bad_inputs_table.py [--output docs/bad_inputs.md]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
TEMPORARY_FOLDER = re.compile(re.escape(tempfile.gettempdir()) + r"/[\w.-]+")
"""A case's own temporary folder (``/tmp/tmpeecast3q``): written as ``<tmp>`` so the table does not change per run
(the checkout's own path is written ``<repo>/``)."""
sys.path.insert(0, str(REPOSITORY))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=REPOSITORY / "docs" / "bad_inputs.md")
    args = parser.parse_args()

    from nemo_noise_plugin.cli.console import quiet_third_party

    quiet_third_party()
    from tests.support.bad_inputs import all_cases, run_case

    rows, counts = [], collections.Counter()
    for number, case in enumerate(all_cases(), start=1):
        outcome = run_case(case)
        counts[outcome.kind] += 1
        message = TEMPORARY_FOLDER.sub("<tmp>", outcome.message).replace(f"{REPOSITORY}/", "<repo>/")
        message = message.replace("|", "\\|")
        rows.append(f"| {number} | {case.surface} | `{case.text}` | {outcome.kind} | {message} |")
    summary = ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))
    text = "\n".join(
        [
            "# Bad inputs and what they give",
            "",
            "Every input below was run by `scripts/bad_inputs_table.py` (the cases are `tests/support/bad_inputs.py`;",
            "`tests/cli/test_bad_inputs.py` asserts each one). A *clear error* names the setting, the value and",
            "what is allowed, in one line, before any model is built; commands exit with status 2 for these.",
            "",
            f"{len(rows)} inputs: {summary}.",
            "",
            "| # | where | input | outcome | message |",
            "|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    args.output.write_text(text)
    print(f"{args.output}: {len(rows)} inputs: {summary}")
    return 0 if set(counts) <= {"clear error"} else 1


if __name__ == "__main__":
    sys.exit(main())
