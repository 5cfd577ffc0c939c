"""How much of the gist survives per-token noise? A naive-Bayes decoder that knows the generator (issue 33).

Any model that reads a noised review can do at most what the best decoder of the release can. This script measures
one strong decoder: naive Bayes over the review's tokens with the *true* per-class token distributions (counted on
the training split, add-one smoothed over the tokens of the family) and the *true* noise density, i.e.
``log p(z_1..n | c) = sum_i logsumexp_v [log P_c(v) + log p(z_i | clip(e_v))]``, on SmolLM2's clipped embedding table.
It is near the Bayes-optimal classifier for this data (it ignores only which tokens form a word), so where it
fails no trained model will succeed by much, and where it succeeds the information is there for training to find.
Beside it: nearest-neighbour token recovery of the same draws (how hidden the tokens are), and the same decoder on
reviews ``k`` times as long (``k`` reviews of one class scored together: naive Bayes adds their evidence), which says
how many label-bearing tokens a level needs.

    python benchmarks/gist_information_bound.py --hf-path "$(python scripts/fetch_smollm2.py)" \\
        --json benchmarks/results/private_tasks/information_bound.json
    python benchmarks/gist_information_bound.py --family sentiment_long --hf-path ... \
        --json benchmarks/results/private_tasks/information_bound_long.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLIP_NORM = 3.0
GAUSSIAN_EPS = (100.0, 50.0, 40.0, 30.0, 20.0, 10.0)
METRIC_ETA = (100.0, 50.0, 30.0, 20.0)
LENGTHS = (1, 2, 4, 8, 16)


def gaussian_sigma(epsilon: float, clip_norm: float, delta: float = 1e-5) -> float:
    """The Gaussian mechanism's sigma as the plugin's ledger computes it (``NoiseConfig.dp_sigma``)."""
    from nemo_noise_plugin.noise.config import NoiseConfig

    config = NoiseConfig(mechanism="gaussian_mechanism", epsilon=epsilon, delta=delta, clip_norm=clip_norm)
    return float(config.dp_sigma)


def review_tokens(tokenizer, family_split: list[dict]) -> list[tuple[list[int], str]]:
    """Each example's private span (the review) as SmolLM2 tokens, with its label."""
    out = []
    for row in family_split:
        span = row["private_spans"][0]
        text = row["messages"][span["message"]]["content"][span["start"] : span["end"]]
        out.append((tokenizer(" " + text, add_special_tokens=False)["input_ids"], row["label"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-path", required=True)
    parser.add_argument("--json")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--family", default="sentiment", choices=("sentiment", "sentiment_long"))
    args = parser.parse_args()
    import safetensors.torch
    import transformers

    from nemo_noise_plugin.data.tasks.shipped import task_examples

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.hf_path)
    weights = safetensors.torch.load_file(str(Path(args.hf_path) / "model.safetensors"))
    table = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight")).float()
    clipped = table * (CLIP_NORM / table.norm(dim=1, keepdim=True)).clamp(max=1.0)
    train = review_tokens(tokenizer, task_examples(args.family, "training"))
    test = review_tokens(tokenizer, task_examples(args.family, "test"))
    labels = sorted({label for _, label in train})
    index = {label: i for i, label in enumerate(labels)}
    vocab = sorted({t for ids, _ in train + test for t in ids})
    column = {t: i for i, t in enumerate(vocab)}
    counts = torch.ones(len(labels), len(vocab))
    for ids, label in train:
        for token in ids:
            counts[index[label], column[token]] += 1
    log_prior = (counts / counts.sum(1, keepdim=True)).log()
    rows = clipped[torch.tensor(vocab)]
    flat = torch.cat([torch.tensor(ids) for ids, _ in test])
    owner = torch.cat([torch.full((len(ids),), i) for i, (ids, _) in enumerate(test)])
    truth = torch.tensor([index[label] for _, label in test])
    generator = torch.Generator().manual_seed(args.seed)
    results = []
    levels = [("gaussian_mechanism", e) for e in GAUSSIAN_EPS] + [("metric_dp", e) for e in METRIC_ETA]
    for mechanism, value in levels:
        clean = clipped[flat]
        if mechanism == "gaussian_mechanism":
            sigma = gaussian_sigma(value, CLIP_NORM)
            noised = clean + sigma * torch.randn(clean.shape, generator=generator)
        else:
            direction = torch.randn(clean.shape, generator=generator)
            direction = direction / direction.norm(dim=1, keepdim=True)
            radius = torch._standard_gamma(torch.full((clean.size(0),), float(clean.size(1))), generator=generator)
            noised = clean + (radius / value).unsqueeze(1) * direction
        distances = torch.cdist(noised, rows)
        if mechanism == "gaussian_mechanism":
            log_likelihood = -distances.pow(2) / (2 * sigma**2)
        else:
            log_likelihood = -value * distances
        token_scores = torch.logsumexp(log_prior.unsqueeze(1) + log_likelihood.unsqueeze(0), dim=-1)
        example_scores = torch.zeros(len(labels), len(test)).index_add_(1, owner, token_scores)
        recovered = torch.cat([torch.cdist(noised[i : i + 2048], clipped).argmin(1) for i in range(0, len(flat), 2048)])
        accuracy = {}
        for length in LENGTHS:
            hits = 0
            for i in range(len(test)):
                same = (truth == truth[i]).nonzero().flatten()
                picked = same[(torch.arange(length) * 7 + i) % len(same)]
                picked[0] = i
                hits += int(example_scores[:, picked].sum(1).argmax() == truth[i])
            accuracy[f"x{length}"] = hits / len(test)
        entry = {
            "mechanism": mechanism,
            "level": value,
            "nn_l2_recovery": float((recovered == flat).float().mean()),
            "naive_bayes_accuracy": accuracy,
        }
        results.append(entry)
        print(json.dumps(entry), flush=True)
    summary = {
        "family": args.family,
        "test_examples": len(test),
        "mean_review_tokens": len(flat) / len(test),
        "chance": 1 / len(labels),
        "clip_norm": CLIP_NORM,
        "seed": args.seed,
        "levels": results,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
