"""What the task generators share: private parts become exact character spans; prompts are never drawn twice."""

from __future__ import annotations

import json
import random

import pytest

from nemo_noise_plugin.data.tasks.common import chat_row, compose, draw_unique, write_jsonl


def test_compose_marks_each_private_part_by_its_character_offsets():
    text, spans = compose([("From ", False), ("Ann Lee", True), (", account ", False), ("1234", True), (".", False)])
    assert text == "From Ann Lee, account 1234."
    assert spans == [{"message": 1, "start": 5, "end": 12}, {"message": 1, "start": 22, "end": 26}]
    assert [text[s["start"] : s["end"]] for s in spans] == ["Ann Lee", "1234"]


def test_compose_rejects_an_empty_or_a_touching_private_part():
    with pytest.raises(ValueError, match="private part is empty"):
        compose([("a", False), ("", True)])
    with pytest.raises(ValueError, match="touches the previous one"):
        compose([("Ann", True), ("Lee", True)])


def test_a_chat_row_is_system_user_assistant_then_task_spans_and_fields():
    row = chat_row("sys", "user", "answer", "name", [{"message": 1, "start": 0, "end": 2}], label="answer")
    assert list(row) == ["messages", "task", "private_spans", "label"]
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]


def test_draw_unique_skips_seen_prompts_and_gives_up_on_too_few():
    rng = random.Random(0)
    seen = {"q0"}
    rows = draw_unique(lambda: chat_row("s", f"q{rng.randrange(5)}", "a", "t"), 4, seen)
    assert sorted(row["messages"][1]["content"] for row in rows) == ["q1", "q2", "q3", "q4"]
    with pytest.raises(RuntimeError, match="could not draw 2 distinct prompts: only 1 after"):
        draw_unique(lambda: chat_row("s", "same", "a", "t"), 2, set(), max_tries_per_row=10)


def test_write_jsonl_writes_one_ascii_object_a_line(tmp_path):
    rows = [chat_row("s", "Zoë", "a", "t"), chat_row("s", "b", "c", "t")]
    assert write_jsonl(tmp_path / "x" / "f.jsonl", rows) == 2
    data = (tmp_path / "x" / "f.jsonl").read_bytes()
    assert data.count(b"\n") == 2 and data.isascii()
    assert [json.loads(line) for line in data.splitlines()] == rows
