"""A dry run reaches for no model hub: Hugging Face's offline mode while the recipe is built.

The model recipes (``llama31_8b_noise_sft``, ...) read their model's HF config when called; on a machine that cannot
reach the hub, a dry run used to spend two minutes in ~90 lines of retries first. Under ``hub_offline`` the config
comes from the local cache or not at all, at once; ``hub_miss`` tells that failure from the recipe's others, so the
command can say what happened in one line (``HUB_MISS``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["HUB_MISS", "hub_miss", "hub_offline"]

HUB_MISS = (
    "its model's HF config is not in the local Hugging Face cache, and a dry run reaches for no model hub; run once "
    "without --dryrun (or `hf download REPO config.json`) to cache it"
)
"""Why a recipe could not be built in a dry run, when ``hub_miss`` says the hub was the reason."""

_OFFLINE_ERRORS = ("LocalEntryNotFoundError", "OfflineModeIsEnabled")


def _offline_in(environment: dict[str, str] | os._Environ) -> bool:
    """huggingface_hub's own reading of its variables (``constants.HF_HUB_OFFLINE``)."""
    value = environment.get("HF_HUB_OFFLINE") or environment.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in {"1", "ON", "YES", "TRUE"}


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Hugging Face's offline mode while the block runs: the variable, and huggingface_hub's constant where it is
    imported already (``nemo`` imports Bridge at start-up; the hub client reads the constant at each call); both
    as they were afterwards (a Python caller may train in the same process)."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        if previous is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = previous
        constants = sys.modules.get("huggingface_hub.constants")  # also when first imported inside the block
        if constants is not None:
            constants.HF_HUB_OFFLINE = _offline_in(os.environ)


def hub_miss(error: BaseException) -> bool:
    """Whether ``error`` (or one it came from) is the hub client refusing to go online for a file it has not cached."""
    current: BaseException | None = error
    for _ in range(8):
        if current is None:
            return False
        if type(current).__name__ in _OFFLINE_ERRORS or "couldn't find them in the cached files" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False
