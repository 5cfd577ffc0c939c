"""The gist family: balanced four-way sentiment decided by the mean valence of several words, with no template
feature (length in characters, words or tokens) that tells the class."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

import pytest

from nemo_noise_plugin.data.tasks import sentiment_reviews as sentiment
from nemo_noise_plugin.data.tasks import task_examples, task_files
from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401  (the session fixture)

SPLITS = ("training", "validation", "test")
SHAPES = tuple(sentiment.SHAPES)
"""``sentiment`` (12-16 words) and ``sentiment_long`` (64-80): the tests marked with ``shape`` hold for both."""


@pytest.fixture(scope="module")
def lexicon():
    pytest.importorskip("vaderSentiment")
    return sentiment.read_lexicon()


def _reviews(split, family="sentiment"):
    for example in task_examples(family, split):
        span = example["private_spans"][0]
        yield example, example["messages"][1]["content"][span["start"] : span["end"]]


@pytest.mark.parametrize("family", SHAPES)
def test_every_split_is_balanced_over_the_four_label_words(family):
    assert tuple(sentiment.LABELS) == ("terrible", "bad", "good", "great")
    for split in SPLITS:
        assert Counter(example["label"] for example in task_examples(family, split)) == dict.fromkeys(
            sentiment.LABELS, sentiment.SHAPES[family].sizes[split]
        )


@pytest.mark.parametrize("family", SHAPES)
def test_the_instruction_and_prefix_are_the_same_for_every_class_and_the_span_is_the_whole_review(family):
    for split in SPLITS:
        for example, review in _reviews(split, family):
            assert example["messages"][0]["content"] == sentiment.SYSTEM
            assert example["messages"][1]["content"] == "Review: " + review
            assert len(example["private_spans"]) == 1 and example["private_spans"][0]["start"] == 8


@pytest.mark.parametrize(
    ("family", "total", "count"), [("sentiment", (12, 16), (5, 8)), ("sentiment_long", (64, 80), (36, 48))]
)
def test_each_review_has_its_shapes_words_and_lexicon_words_the_rest_shared_filler(lexicon, family, total, count):
    filler = set(sentiment.FILLER)
    assert not filler & set(lexicon)
    for split in SPLITS:
        for _, review in _reviews(split, family):
            words = review.split()
            sentiment_words = [word for word in words if word not in filler]
            assert total[0] <= len(words) <= total[1] and count[0] <= len(sentiment_words) <= count[1], review
            assert len(set(sentiment_words)) == len(sentiment_words) and all(w in lexicon for w in sentiment_words)


def test_the_filler_holds_no_vader_negation_or_booster():
    module = pytest.importorskip("vaderSentiment.vaderSentiment")
    assert not set(sentiment.FILLER) & (set(module.NEGATE) | set(module.BOOSTER_DICT))


@pytest.mark.parametrize("family", SHAPES)
def test_the_label_is_the_band_of_the_mean_valence_with_a_margin_of_0_9_and_one_polarity(lexicon, family):
    filler = set(sentiment.FILLER)
    means = defaultdict(list)
    for split in SPLITS:
        for example, review in _reviews(split, family):
            valences = [lexicon[word][0] for word in review.split() if word not in filler]
            polarity, intensity = sentiment.LABELS[example["label"]]
            assert all(polarity * valence > 0 for valence in valences), review
            mean = statistics.mean(valences)
            assert abs(mean - example["mean_valence"]) <= 0.0005 + 1e-9  # rounded to 3 places
            means[example["label"]].append(polarity * mean)
    assert max(means["bad"]) <= 1.2 + 1e-9 and max(means["good"]) <= 1.2 + 1e-9
    assert min(means["terrible"]) >= 2.1 - 1e-9 and min(means["great"]) >= 2.1 - 1e-9


def test_no_single_word_decides_the_intensity_a_third_of_the_words_stand_in_mild_and_strong_reviews(lexicon):
    filler = set(sentiment.FILLER)
    classes_of = defaultdict(set)
    occurrences = []
    for example, review in _reviews("training"):
        for word in review.split():
            if word not in filler:
                classes_of[word].add(example["label"])
                occurrences.append(word)
    both = sum(1 for word in occurrences if len(classes_of[word]) == 2)
    assert 0.25 <= both / len(occurrences) <= 0.75, both / len(occurrences)


def test_vaders_own_analyzer_separates_the_four_classes_exactly():
    analyzer = pytest.importorskip("vaderSentiment.vaderSentiment").SentimentIntensityAnalyzer()
    thresholds = (-0.935, 0.0, 0.935)
    for split in SPLITS:
        for example, review in _reviews(split):
            compound = analyzer.polarity_scores(review)["compound"]
            predicted = list(sentiment.LABELS)[sum(compound > t for t in thresholds)]
            assert predicted == example["label"], (review, compound)


def _template_features(example, review, word_tokens):
    """What a classifier could read off the template: characters, words, SmolLM2 tokens (from the shipped table)."""
    return (len(review) // 4, len(review.split()), sum(word_tokens[word] for word in review.split()))


def _majority_lookup_accuracy(feature, train, held_out):
    """Accuracy on ``held_out`` of predicting, per feature value, the training set's most common label there."""
    votes = defaultdict(Counter)
    for example, review in train:
        votes[feature(example, review)][example["label"]] += 1
    fallback = Counter(example["label"] for example, _ in train).most_common(1)[0][0]
    hits = [
        (votes[key].most_common(1)[0][0] if (key := feature(example, review)) in votes else fallback)
        == example["label"]
        for example, review in held_out
    ]
    return sum(hits) / len(hits)


@pytest.mark.parametrize("family", SHAPES)
def test_a_classifier_on_template_features_is_at_chance_and_one_on_the_mean_valence_is_perfect(family):
    word_tokens = sentiment.read_word_tokens()
    train = list(_reviews("training", family))
    held_out = list(_reviews("validation", family)) + list(_reviews("test", family))
    for name, feature in {
        "characters": lambda e, r: len(r) // 4,
        "words": lambda e, r: len(r.split()),
        "tokens": lambda e, r: sum(word_tokens[w] for w in r.split()),
        "all three": lambda e, r: _template_features(e, r, word_tokens),
    }.items():
        accuracy = _majority_lookup_accuracy(feature, train, held_out)
        assert accuracy < 0.31, (name, accuracy)  # chance 0.25; 800 held out: 2 standard errors = 0.03
    assert _majority_lookup_accuracy(lambda e, r: round(e["mean_valence"]), train, held_out) == 1.0


def test_the_seed_decides_the_data():
    pytest.importorskip("vaderSentiment")
    shipped = task_files("sentiment")["test"].read_text().splitlines()
    other = sentiment.generate(seed=1)["test"]
    assert len(other) == 400 and other[0]["messages"][1]["content"] not in "\n".join(shipped)
    assert sentiment.generate(seed=1)["test"] == other


@pytest.mark.slow
def test_the_word_token_table_and_every_prompts_length_are_smollm2s(smollm2_hf_dir, lexicon):  # noqa: F811
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_hf_dir)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert sentiment.word_tokens_path().read_text() == sentiment.word_token_table(lexicon, count)
    word_tokens, prefix = sentiment.read_word_tokens(), count("Review:")
    lengths = defaultdict(list)
    for split in SPLITS:
        for example, review in _reviews(split):
            tokens = count(example["messages"][1]["content"])
            assert tokens == prefix + sum(word_tokens[word] for word in review.split())
            lengths[example["label"]].append(tokens)
    means = [statistics.mean(values) for values in lengths.values()]
    assert max(means) - min(means) < 0.3 and max(max(v) for v in lengths.values()) <= 40
