"""Writing the shipped task files: each family's generator, run with its fixed seed, into JSONL.

``scripts/make_task_data.py`` calls ``write_family`` for every generated family; the tests call it into a temporary
folder and compare bytes with the shipped files. Needs the generators' sources: VADER's lexicon (``vadersentiment``)
for ``sentiment``, Faker for ``support`` (both pinned in requirements/ci.txt).
"""

from __future__ import annotations

from pathlib import Path

from nemo_noise_plugin.data.tasks import sentiment_reviews, support_tickets
from nemo_noise_plugin.data.tasks.common import write_jsonl
from nemo_noise_plugin.data.tasks.shipped import CANARY_SPLIT
from nemo_noise_plugin.validation import SettingError

__all__ = ["GENERATED_FAMILIES", "write_family"]

GENERATED_FAMILIES = (*sentiment_reviews.SHAPES, support_tickets.FAMILY)
"""The families written here (``instructions`` has its own script, ``scripts/make_instruction_data.py``)."""


def write_family(family: str, folder: Path) -> dict[str, int]:
    """Write ``family``'s ``{training,validation,test}.jsonl`` (and ``canaries.jsonl``) into ``folder``.

    Returns the row count of each file. Deterministic: the same bytes on every run.
    """
    if family in sentiment_reviews.SHAPES:
        splits = sentiment_reviews.generate(family=family)
        extra = {}
    elif family == support_tickets.FAMILY:
        splits = support_tickets.generate()
        extra = {CANARY_SPLIT: support_tickets.make_canaries(splits)}
    else:
        raise SettingError("family", family, f"one of {', '.join(GENERATED_FAMILIES)}")
    return {name: write_jsonl(Path(folder) / f"{name}.jsonl", rows) for name, rows in {**splits, **extra}.items()}
