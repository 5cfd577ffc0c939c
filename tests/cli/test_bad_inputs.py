"""Every catalogued bad input ends in one clear error naming the setting and the value (tests/support/bad_inputs.py).

The catalogue covers the Python API (NoiseConfig, KDConfig, preset YAML), the main job's flags, `nemo llm finetune`
overrides and config files, and `nemo noise ledger`; docs/bad_inputs.md tabulates the same cases.
"""

from __future__ import annotations

import pytest

from tests.support.bad_inputs import all_cases, run_case

CASES = all_cases()


def test_the_catalogue_covers_at_least_164_inputs_on_every_surface():
    assert len(CASES) >= 164
    surfaces = {case.surface for case in CASES}
    assert {"NoiseConfig", "KDConfig", "python -m nemo_noise_plugin", "nemo noise ledger"} <= surfaces
    assert any(surface.startswith("nemo llm finetune") for surface in surfaces)


@pytest.mark.parametrize("case", CASES, ids=[f"{case.surface}: {case.text}" for case in CASES])
def test_a_bad_input_is_one_clear_error(case):
    outcome = run_case(case)
    assert outcome.kind == "clear error", (outcome.kind, outcome.message, case.must_mention)
