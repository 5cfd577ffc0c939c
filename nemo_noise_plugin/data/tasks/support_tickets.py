"""The span family ``support``: support messages that carry a customer's identity, which the answer never needs.

Why this task. Under ``tokens="spans"`` only the private spans are noised; the content the answer needs stays clean.
Each prompt here holds a private part (the customer's name, account number and, in half of the headers, street
address) and a public part the answer is computed from: a support ticket whose category is the answer (task
``ticket``, four categories, ``CATEGORIES``) or a small arithmetic question (task ``question``, an exact answer).
The private part is drawn independently of the answer, so a model loses nothing when it is hidden, and an attacker
who reads the noised span is the only one who learns it: the canary set measures that.

Data source: Faker (PyPI ``faker``, pinned in requirements/ci.txt, MIT licence), locale ``en_US``, seeded with
``seed_instance``: names (``name``), street addresses (``street_address`` + ``city``), account numbers
(``numerify("####-####-####")``). The ticket sentences and the header templates are written here. Only the
generator needs Faker; the package ships the generated JSONL.

Fields of a row (beyond ``messages``, ``task``, ``private_spans``): ``label`` (the answer) and ``span_kinds`` (one of
``name``, ``account``, ``address`` per span, in span order). The header templates (``HEADERS``) are shared by both
tasks and all categories; each ticket body has one product (``PRODUCTS``, shared by the categories).

Canaries (``canaries.jsonl``, ``CANARIES`` rows, half of each task): the same templates with span strings that never
occur in the splits: invented names and street/city names built from syllables (each checked absent, as a word, from
every split), and account numbers checked absent too. The audit noises them and measures how many it recovers.
"""

from __future__ import annotations

import random
from typing import Any

from nemo_noise_plugin.data.tasks.common import SPLITS, chat_row, compose, draw_unique, shuffled

__all__ = ["CANARIES", "CATEGORIES", "FAMILY", "HEADERS", "PRODUCTS", "SIZES", "SYSTEMS", "generate", "make_canaries"]

FAMILY = "support"
SEED = 20261204
SYSTEMS = {
    "ticket": "Name the category of the support ticket: payment, delivery, password or returns. Reply with one word.",
    "question": "Reply with the exact answer only.",
}
"""The system prompt of each task (the same for every example of the task)."""
SIZES = {"test": 50, "validation": 50, "training": 500}
"""Examples per split of each ticket category, and of the question task four times over: 400 / 400 / 4000 in all."""
CANARIES = 64
PRODUCTS = (
    *"kettle blender laptop headphones jacket backpack lamp printer camera mattress toaster monitor".split(),
    *"keyboard speaker watch tent bicycle helmet sofa cushion rug".split(),
    "phone case",
    "vacuum cleaner",
    "coffee maker",
)
BODIES: dict[str, tuple[str, ...]] = {
    "payment": (
        "I was charged twice for my {product} order.",
        "My card was declined when I tried to pay for the {product}.",
        "The invoice for the {product} shows the wrong amount.",
        "Why does my statement show an extra fee for the {product}?",
        "I paid for the {product} but the order still says payment pending.",
        "Please cancel the second charge for the {product} on my card.",
    ),
    "delivery": (
        "My {product} has not arrived and the tracking has not moved for a week.",
        "The courier left my {product} at the wrong house.",
        "When will my {product} be shipped? It was due on Monday.",
        "The tracking says the {product} was delivered but I never got it.",
        "Can you change the delivery date for my {product}?",
        "My {product} is stuck at the depot since Friday.",
    ),
    "password": (
        "I cannot log in to order a {product}: the reset link never comes.",
        "My password stopped working while I was buying a {product}.",
        "The site locked me out after I checked my {product} order.",
        "How do I reset my password? I need to see my {product} receipt.",
        "The login code does not arrive, so I cannot track the {product}.",
        "I forgot my password and want to review my {product} order.",
    ),
    "returns": (
        "I want to send back the {product}: it is the wrong size.",
        "How do I return the {product}? It stopped working after a day.",
        "Please send me a return label for the {product}.",
        "The {product} arrived broken and I would like to return it.",
        "Can I exchange the {product} for a different colour?",
        "I returned the {product} two weeks ago; has it been received?",
    ),
}
"""The ticket sentences of each category (``CATEGORIES``); ``{product}`` is drawn from ``PRODUCTS``."""
CATEGORIES = tuple(BODIES)
HEADERS = (
    ("Customer ", "name", " (account ", "account", ") writes: ", "body"),
    ("From ", "name", ", account ", "account", ", ", "address", ": ", "body"),
    ("body", " Sent by ", "name", ", account ", "account", "."),
    ("Ticket from ", "name", " at ", "address", " (account ", "account", "): ", "body"),
    ("name", " (", "address", ") writes: ", "body", " Account ", "account", "."),
    ("Message from ", "name", ", account number ", "account", ": ", "body"),
)
"""How a prompt is put together: literal text, the private slots ``name``/``account``/``address``, the ``body``."""
PRIVATE = ("name", "account", "address")
SYLLABLES = tuple(f"{c}{v}" for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u", "ar", "el", "on"))


def _question(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", str(a + b)
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", str(a - b)


def _ticket(rng: random.Random, category: str) -> str:
    return rng.choice(BODIES[category]).format(product=rng.choice(PRODUCTS))


def _row(rng: random.Random, task: str, body: str, answer: str, identity: dict[str, str]) -> dict[str, Any]:
    parts, kinds = [], []
    for piece in rng.choice(HEADERS):
        if piece in PRIVATE:
            parts.append((identity[piece], True))
            kinds.append(piece)
        else:
            parts.append((body if piece == "body" else piece, False))
    user, spans = compose(parts)
    return chat_row(SYSTEMS[task], user, answer, task, spans, label=answer, span_kinds=kinds)


def _faker(seed: int):
    try:
        from faker import Faker
    except ModuleNotFoundError as error:  # only the generator needs it
        raise ModuleNotFoundError(
            "the support generator needs Faker: pip install faker (requirements/ci.txt)"
        ) from error
    fake = Faker("en_US")
    fake.seed_instance(seed)
    return fake


def generate(seed: int = SEED) -> dict[str, list[dict[str, Any]]]:
    """The rows of each split: tickets balanced over ``CATEGORIES``, as many questions as tickets; no prompt twice."""
    fake, rng = _faker(seed), random.Random(seed)

    def identity() -> dict[str, str]:
        return {
            "name": fake.name(),
            "account": fake.numerify("####-####-####"),
            "address": f"{fake.street_address()}, {fake.city()}",
        }

    def ticket(category: str) -> dict[str, Any]:
        return _row(rng, "ticket", _ticket(rng, category), category, identity())

    def question() -> dict[str, Any]:
        return _row(rng, "question", *_question(rng), identity())

    seen: set[str] = set()
    result: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    draws = [lambda c=category: ticket(c) for category in CATEGORIES] + [question] * len(CATEGORIES)
    for draw in draws:
        rows = draw_unique(draw, sum(SIZES.values()), seen)
        start = 0
        for split in ("test", "validation", "training"):
            result[split] += rows[start : start + SIZES[split]]
            start += SIZES[split]
    return {split: shuffled(rows, rng) for split, rows in result.items()}


def _invented(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()


def make_canaries(splits: dict[str, list[dict[str, Any]]], seed: int = SEED + 1) -> list[dict[str, Any]]:
    """``CANARIES`` rows whose span strings occur in none of ``splits`` (nor their invented words, as words)."""
    rng = random.Random(seed)
    prompts = [row["messages"][1]["content"] for rows in splits.values() for row in rows]
    words = {word.strip(".,:()") for prompt in prompts for word in prompt.split()}
    text = "\n".join(prompts)
    used: set[str] = set()

    def invented() -> str:
        while True:
            word = _invented(rng, rng.choice((2, 3)))
            if word not in words and word not in used:
                used.add(word)
                return word

    def account() -> str:
        while True:
            value = "-".join(f"{rng.randrange(10_000):04d}" for _ in range(3))
            if value not in text and value not in used:
                used.add(value)
                return value

    rows = []
    for index in range(CANARIES):
        name = f"{invented()} {invented()}"
        street = f"{rng.randint(10, 9999)} {invented()} Street, {invented()}"
        identity = {"name": name, "account": account(), "address": street}
        if index % 2 == 0:
            category = CATEGORIES[(index // 2) % len(CATEGORIES)]
            rows.append(_row(rng, "ticket", _ticket(rng, category), category, identity))
        else:
            rows.append(_row(rng, "question", *_question(rng), identity))
    return rows
