"""The span family: the answer is a function of the public text alone, the spans hold the customer's identity, and
the canaries' span strings occur nowhere in the splits."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from nemo_noise_plugin.data.tasks import support_tickets as support
from nemo_noise_plugin.data.tasks import task_examples

SPLITS = ("training", "validation", "test")
PER_CATEGORY = {"training": 500, "validation": 50, "test": 50}
SHAPES = {"account": r"\d{4}-\d{4}-\d{4}", "name": r"[A-Z][\w.' -]+", "address": r"\d+ [\w.' -]+, [A-Z][\w ]+"}


def _masked(example):
    """The user prompt with every private span replaced by its kind: what remains public."""
    user, kinds = example["messages"][1]["content"], example["span_kinds"]
    for span, kind in sorted(zip(example["private_spans"], kinds, strict=True), key=lambda p: -p[0]["start"]):
        user = user[: span["start"]] + f"<{kind}>" + user[span["end"] :]
    return user


def test_tickets_are_balanced_over_the_four_categories_and_questions_are_half_of_each_split():
    assert support.CATEGORIES == ("payment", "delivery", "password", "returns")
    for split in SPLITS:
        examples = task_examples("support", split)
        assert Counter(e["label"] for e in examples if e["task"] == "ticket") == dict.fromkeys(
            support.CATEGORIES, PER_CATEGORY[split]
        )
        assert sum(e["task"] == "question" for e in examples) == 4 * PER_CATEGORY[split]


def test_each_span_is_a_name_an_account_number_or_an_address_of_its_shape():
    kinds = Counter()
    for split in (*SPLITS, "canaries"):
        for example in task_examples("support", split):
            user = example["messages"][1]["content"]
            assert len(example["span_kinds"]) == len(example["private_spans"]) in (2, 3)
            for span, kind in zip(example["private_spans"], example["span_kinds"], strict=True):
                assert re.fullmatch(SHAPES[kind], user[span["start"] : span["end"]]), (kind, user)
                kinds[kind] += 1
    assert kinds["name"] == kinds["account"] == 4864 and 1500 < kinds["address"] < 3300


def test_the_answer_is_a_function_of_the_public_text_alone():
    answers = defaultdict(set)
    for split in SPLITS:
        for example in task_examples("support", split):
            public = _masked(example)
            answers[public].add(example["label"])
            if example["task"] == "question":
                a, op, b = re.search(r"What is (\d+) ([+-]) (\d+)\?", public).groups()
                assert example["label"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
    assert all(len(labels) == 1 for labels in answers.values())


def test_the_canaries_span_strings_and_invented_words_occur_in_no_split():
    text = "\n".join(e["messages"][1]["content"] for split in SPLITS for e in task_examples("support", split))
    words = set(re.findall(r"[A-Za-z]+", text))
    canaries = task_examples("support", "canaries")
    strings = [e["messages"][1]["content"][s["start"] : s["end"]] for e in canaries for s in e["private_spans"]]
    assert len(canaries) == 64 and len(strings) == len(set(strings))
    assert not [string for string in strings if string in text]
    invented = {w for e in canaries for w in re.findall(r"[A-Z][a-z]+", " ".join(strings)) if w != "Street"}
    assert len(invented) > 100 and not invented & words
    assert Counter(e["task"] for e in canaries) == {"ticket": 32, "question": 32}
