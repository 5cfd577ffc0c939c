"""The gist family ``sentiment``: four-way review sentiment whose label is spread over several words of the prompt.

Why this task. Per-token embedding noise hides each token; an exact-answer task needs every question token, so it
dies with them (``benchmarks/PRIVACY_FRONTIER.md``). Here no single word decides the label: each review holds 5-8
sentiment words of one polarity whose *intensities* overlap between the mild and the strong class, so the class is a
function of their mean. A model that sees only a noisy version of every word (in the limit, a noisy average of the
words' embeddings) can still read the polarity and the intensity, because the noise is independent per token and the
signal is repeated over many tokens.

Data source: the VADER sentiment lexicon (``vader_lexicon.txt`` of PyPI ``vadersentiment`` 3.3.2, MIT licence,
C.J. Hutto; read from the installed package's folder without importing it): each entry is a word, its mean valence
on [-4, 4] over ten human raters, and the raters' standard deviation. Only the generator reads it; the package ships
the generated JSONL.

Construction (``generate``, fixed seed):

- Word pools: lower-case alphabetic entries of 5-11 letters with rater SD <= 1.0 (raters agree), minus slang,
  profanity and violence (``EXCLUDED_PARTS``) and the label words. Mild words have |valence| in [0.5, 1.9], strong
  words in [1.5, 3.5]: a word of |valence| 1.5-1.9 can stand in either class.
- Classes (``LABELS``, the one-word answers): ``terrible`` (negative, strong), ``bad`` (negative, mild), ``good``
  (positive, mild), ``great`` (positive, strong). A review's class is decided by the mean valence of its sentiment
  words, with a margin: a mild review's mean |valence| is in [0.5, 1.2], a strong one's in [2.1, 3.5]; while a draw is
  outside, one of its words is redrawn at the same letter count (kept when the mean gets no farther from the band;
  the polarity is never mixed). So the clean label is unambiguous, yet one word of the overlap band
  says nothing about intensity.
- No template leakage: the system prompt and the ``Review: `` prefix are the same for every class; the review is a
  bag of 12-16 lower-case words (sentiment words and neutral filler from one shared list, ``FILLER``, in random
  order); the number of words, the number of sentiment words and each sentiment word's *letter count* are drawn
  from one distribution shared by the classes, and so is each sentiment word's *token count* under SmolLM2's
  tokenizer (a word is picked from its class's pool at a drawn (letters, tokens) pair): the review's length in
  characters, words and tokens has the same distribution in every class. The token counts come from
  ``sentiment/word_tokens.tsv`` (each candidate word and filler word with a leading space, as it stands in the
  review; written by ``scripts/make_task_data.py --word-tokens HF_DIR``; a slow test checks it against the
  tokenizer), so generating needs no tokenizer.
- ``private_spans`` marks the review (everything after ``Review: ``): the words a ``tokens="spans"`` run noises.

Two shapes (``SHAPES``): ``sentiment`` (12-16 words, 5-8 of them sentiment words; 4000 training examples) and
``sentiment_long`` (64-80 words, 36-48 sentiment words: about 6.5x the label-bearing words; 2000 training). The long
shape exists because of ``benchmarks/gist_information_bound.py``: at a noise level that hides the tokens (nearest
neighbour recovers <= 10 %), a decoder that knows the generator reads the short review's class only 58 % of the
time, and needs about 8x its sentiment words to reach 97 %. Everything else (pools, bands, filler) is the same.
"""

from __future__ import annotations

import importlib.util
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from nemo_noise_plugin.data.tasks.common import SPLITS, chat_row, compose, draw_unique, shuffled

__all__ = [
    "FAMILY",
    "FILLER",
    "LABELS",
    "SHAPES",
    "SIZES",
    "SYSTEM",
    "ReviewShape",
    "candidate_words",
    "generate",
    "lexicon_path",
    "read_lexicon",
    "read_word_tokens",
    "word_pools",
    "word_token_table",
    "word_tokens_path",
]

FAMILY = "sentiment"
SEED = 20261203
SYSTEM = "Rate the sentiment of the review. Reply with one word: terrible, bad, good or great."
PREFIX = "Review: "
LABELS: dict[str, tuple[int, str]] = {
    "terrible": (-1, "strong"),
    "bad": (-1, "mild"),
    "good": (1, "mild"),
    "great": (1, "strong"),
}
"""Each answer word: (polarity, intensity)."""
WORD_WINDOW = {"mild": (0.5, 1.9), "strong": (1.5, 3.5)}
"""The |valence| range of a class's words (the two overlap on [1.5, 1.9])."""
MEAN_BAND = {"mild": (0.5, 1.2), "strong": (2.1, 3.5)}
"""The range of a review's mean |valence| per intensity: the margin between the classes is 0.9."""
SIZES = {"test": 100, "validation": 100, "training": 1000}
"""Examples per class and split: 400 / 400 / 4000 in all."""
LENGTHS = range(5, 12)
"""The letter counts of the sentiment words."""
REVIEW_WORDS, SENTIMENT_WORDS = range(12, 17), range(5, 9)


@dataclass(frozen=True)
class ReviewShape:
    """One family of reviews: its name, words per review, sentiment words per review, examples per class and split."""

    family: str
    review_words: range
    sentiment_words: range
    sizes: dict[str, int]
    seed: int


SHAPES: dict[str, ReviewShape] = {
    FAMILY: ReviewShape(FAMILY, REVIEW_WORDS, SENTIMENT_WORDS, SIZES, SEED),
    "sentiment_long": ReviewShape(
        "sentiment_long", range(64, 81), range(36, 49), {"test": 100, "validation": 100, "training": 500}, SEED + 1
    ),
}
"""The review families this module writes (the module docstring says why there are two)."""
MAX_RATER_SD = 1.0
MIN_STRATUM = 10
"""A (letters, tokens) pair is drawn only where every class has at least this many words (8 distinct at most)."""
EXCLUDED_PARTS = (
    "fuck fuk shit bitch bastard cock dick fag slut whore twat wank piss rape rapist tard asshole jackass smartass "
    "wiseass douche crap damn goddam scumbag nigg sexy orgasm kill murder suicid terror slave cancer nazi racis "
    "rofl lmao lulz lolz xoxo haha bwah dumbhead lamebrain pervert bomb weapon prison crime criminal"
).split()
"""Substrings that remove a lexicon entry: profanity, slurs, violence, slang (the data ship with the package)."""
FILLER = tuple(
    """
the this our my a and with for after before then at on in of to from about around during
room staff food service price delivery package screen battery menu table order hotel hallway breakfast dinner lunch
coffee window door kitchen bathroom parking manager waiter driver product box cable phone laptop camera charger
jacket shoes size colour fabric weekend evening morning trip visit week month city street station airport flight
seat ticket website checkout receipt shop counter shelf bottle garden pool lift floor corridor desk bag
""".split()
)
"""Neutral words shared by every class (none is a VADER lexicon entry; no negation, no booster)."""


def lexicon_path() -> Path:
    """``vader_lexicon.txt`` inside the installed ``vaderSentiment`` package (found without importing it)."""
    spec = importlib.util.find_spec("vaderSentiment")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the sentiment generator needs the VADER lexicon: pip install vadersentiment==3.3.2 (requirements/ci.txt)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "vader_lexicon.txt"


def read_lexicon(path: Path | None = None) -> dict[str, tuple[float, float]]:
    """``{entry: (mean valence, rater SD)}`` of the VADER lexicon file (tab-separated: token, mean, SD, ratings)."""
    lexicon = {}
    for line in (path or lexicon_path()).read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        if len(fields) >= 3:
            lexicon[fields[0]] = (float(fields[1]), float(fields[2]))
    return lexicon


def candidate_words(lexicon: dict[str, tuple[float, float]]) -> list[str]:
    """The lexicon entries a review may use (sorted): letters only, 5-11 of them, raters agreeing, none excluded."""
    words = []
    for word, (valence, sd) in sorted(lexicon.items()):
        if not re.fullmatch(r"[a-z]+", word) or len(word) not in LENGTHS or sd > MAX_RATER_SD:
            continue
        if any(part in word for part in EXCLUDED_PARTS) or any(word.startswith(label) for label in LABELS):
            continue
        if any(WORD_WINDOW[i][0] <= abs(valence) <= WORD_WINDOW[i][1] for i in WORD_WINDOW):
            words.append(word)
    return words


def word_tokens_path() -> Path:
    """The shipped table of SmolLM2 token counts (``word<TAB>tokens``, each word with a leading space)."""
    return Path(str(resources.files("nemo_noise_plugin") / "data" / "tasks" / FAMILY / "word_tokens.tsv"))


def read_word_tokens(path: Path | None = None) -> dict[str, int]:
    """``{word: SmolLM2 token count of " " + word}`` from the shipped table."""
    rows = (line.split("\t") for line in (path or word_tokens_path()).read_text(encoding="utf-8").splitlines())
    return {word: int(count) for word, count in rows}


def word_token_table(lexicon: dict[str, tuple[float, float]], count_tokens: Callable[[str], int]) -> str:
    """The text of ``word_tokens.tsv``: every candidate and filler word with ``count_tokens(" " + word)``."""
    words = sorted(set(candidate_words(lexicon)) | set(FILLER))
    return "".join(f"{word}\t{count_tokens(' ' + word)}\n" for word in words)


Stratum = tuple[int, int]
"""A sentiment word's (letter count, token count)."""


def word_pools(
    lexicon: dict[str, tuple[float, float]], word_tokens: dict[str, int]
) -> dict[str, dict[Stratum, list[tuple[str, float]]]]:
    """Per label, ``{(letters, tokens): [(word, valence), ...]}`` (sorted) of the words its reviews draw from."""
    pools: dict[str, dict[Stratum, list[tuple[str, float]]]] = {label: {} for label in LABELS}
    for word in candidate_words(lexicon):
        valence = lexicon[word][0]
        for label, (polarity, intensity) in LABELS.items():
            low, high = WORD_WINDOW[intensity]
            if low <= polarity * valence <= high:
                pools[label].setdefault((len(word), word_tokens[word]), []).append((word, valence))
    return pools


def _feasible(label: str, words: list[tuple[str, float]]) -> bool:
    """Whether ``words`` hold one whose |valence| lies in the label's mean band (so every draw can reach the band)."""
    polarity, intensity = LABELS[label]
    low, high = MEAN_BAND[intensity]
    return any(low <= polarity * valence <= high for _, valence in words)


def _strata(pools: dict[str, dict[Stratum, list[tuple[str, float]]]]) -> tuple[list[Stratum], list[int]]:
    """The (letters, tokens) pairs at which every class has a word inside its mean band, each weighted by the
    smallest class pool there."""
    shared = sorted(
        set.intersection(
            *({k for k, words in pool.items() if _feasible(label, words)} for label, pool in pools.items())
        )
    )
    weights = [min(len(pools[label][stratum]) for label in LABELS) for stratum in shared]
    kept = [(stratum, weight) for stratum, weight in zip(shared, weights, strict=True) if weight >= MIN_STRATUM]
    return [stratum for stratum, _ in kept], [weight for _, weight in kept]


def _band_distance(picked: list[tuple[str, float]], polarity: int, low: float, high: float) -> float:
    """How far the words' mean |valence| is from ``[low, high]`` (0 inside), plus 1 per repeated word."""
    mean = polarity * sum(valence for _, valence in picked) / len(picked)
    return max(low - mean, mean - high, 0.0) + len(picked) - len({word for word, _ in picked})


def _in_band(picked: list[tuple[str, float]], polarity: int, low: float, high: float) -> bool:
    return _band_distance(picked, polarity, low, high) == 0.0


def _review(
    rng: random.Random, label: str, pools, strata: tuple[list[Stratum], list[int]], shape: ReviewShape
) -> dict[str, Any]:
    polarity, intensity = LABELS[label]
    total, count = rng.choice(shape.review_words), rng.choice(shape.sentiment_words)
    lengths = rng.choices(strata[0], weights=strata[1], k=count)  # drawn before the class matters
    low, high = MEAN_BAND[intensity]
    picked = [rng.choice(pools[label][n]) for n in lengths]
    while not _in_band(picked, polarity, low, high):  # redraw one word at a time, keeping its letter count
        slot = rng.randrange(count)
        candidate = picked[:slot] + [rng.choice(pools[label][lengths[slot]])] + picked[slot + 1 :]
        if _band_distance(candidate, polarity, low, high) <= _band_distance(picked, polarity, low, high):
            picked = candidate
    mean = sum(valence for _, valence in picked) / count
    words = [word for word, _ in picked] + rng.choices(FILLER, k=total - count)
    rng.shuffle(words)
    user, spans = compose([(PREFIX, False), (" ".join(words), True)])
    return chat_row(SYSTEM, user, label, shape.family, spans, label=label, mean_valence=round(mean, 3))


def generate(
    seed: int | None = None, lexicon_file: Path | None = None, *, family: str = FAMILY
) -> dict[str, list[dict[str, Any]]]:
    """The rows of each split (``training``, ``validation``, ``test``) of ``family`` (a ``SHAPES`` key), balanced
    over ``LABELS``; no prompt twice. ``seed`` defaults to the family's own."""
    shape = SHAPES[family]
    seed = shape.seed if seed is None else seed
    lexicon = read_lexicon(lexicon_file)
    if overlap := sorted(set(FILLER) & set(lexicon)):
        raise RuntimeError(f"filler words {overlap} are VADER lexicon entries")
    pools = word_pools(lexicon, read_word_tokens())
    weights = _strata(pools)
    rng = random.Random(seed)
    seen: set[str] = set()
    result: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    for label in LABELS:
        rows = draw_unique(
            lambda label=label: _review(rng, label, pools, weights, shape), sum(shape.sizes.values()), seen
        )
        start = 0
        for split in ("test", "validation", "training"):
            result[split] += rows[start : start + shape.sizes[split]]
            start += shape.sizes[split]
    return {split: shuffled(rows, rng) for split, rows in result.items()}
