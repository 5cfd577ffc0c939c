"""The pieces copied from Megatron-Core 0.19.2: each one fails here when the installed original changes."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.upstream.copies import UPSTREAM_COPIES, resolve, upstream_source_sha256


@pytest.mark.parametrize("copy", UPSTREAM_COPIES, ids=lambda copy: copy.ours.rpartition(":")[2])
def test_the_upstream_original_is_the_one_our_copy_was_made_from(copy):
    assert callable(resolve(copy.ours))
    assert upstream_source_sha256(copy.upstream) == copy.sha256, (
        f"{copy.upstream} changed upstream: re-read it, carry the change into {copy.ours} "
        f"({copy.change}), then record the new digest in nemo_noise_plugin/upstream/copies.py."
    )


def test_every_copy_names_upstream_in_its_docstring_or_comments():
    import inspect

    for copy in UPSTREAM_COPIES:
        upstream_class, _, upstream_function = copy.upstream.rpartition(":")[2].rpartition(".")
        source = inspect.getsource(resolve(copy.ours))
        assert upstream_class in source or upstream_function in source, copy.ours


def test_a_changed_original_is_detected(monkeypatch):
    import inspect

    copy = UPSTREAM_COPIES[0]
    original = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: original(obj) + "    # changed upstream\n")
    assert upstream_source_sha256(copy.upstream) != copy.sha256
