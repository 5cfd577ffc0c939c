"""What a token prior buys the posterior-mean denoiser on the long gist family (issue 33), measured on CPU.

Hypothesis (from the learnability proxy in ``PRIVACY_FRONTIER.md``): the plugin's denoiser explains each noised
review token by *any* of SmolLM2's 49,152 rows, so at Gaussian eps 50 (nearest-row recovery ~10 %) its output is a
blur of unrelated rows; with a prior over the task's vocabulary (``NoiseConfig.projection_prior``: the private-span
tokens of the training split, ``data.span_token_prior``) the same release is explained by the ~2,500 tokens reviews
use, so the denoised input is nearer the clean one and keeps more of the gist. If the prior does not move the token
metrics and a clean reader's accuracy, the prior is not what the trained SmolLM2 cells lack.

Everything is the plugin's own code on SmolLM2-135M-Instruct's real table: the release is ``noised_embeddings`` of
the test split's rendered chats with the training ``private_mask`` (``tokens='spans'``, Gaussian mechanism,
``clip_norm`` 3, delta 1e-5), the denoisers are ``nearest_rows`` and ``posterior_mean_rows`` (uniform prior, the
frequency prior, the support prior). Per noise seed (the ``NoiseConfig.seed``): MAP-row recovery of the review
tokens, the squared error and cosine of the denoised embedding against the clean row, and the accuracy of a clean
reader: a nearest-centroid classifier of the mean review embedding, its centroids from the clean training reviews
(so it stands for a model fine-tuned without noise, the "plain + denoiser" baseline). Seeds 1-3; mean, sd and the
paired difference (task prior - uniform) with its range over seeds.

    python benchmarks/denoiser_prior.py --hf-path "$(python scripts/fetch_smollm2.py)" \\
        --json benchmarks/results/private_tasks/denoiser_prior.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLIP_NORM = 3.0
"""The shipped private recipes' clip norm (``recipes.smollm2_private.PRIVATE_CLIP_NORM``)."""


def rendered_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[b, s]`` token ids, padding mask and private mask of the rendered chats (padding with id 0)."""
    from nemo_noise_plugin.data.private_spans import private_token_mask, read_private_spans, rendered_chat_ids

    ids, masks = [], []
    for index, row in enumerate(rows):
        spans = read_private_spans(row, row["messages"], f"row {index}")
        ids.append(rendered_chat_ids(tokenizer, row["messages"]))
        masks.append(private_token_mask(tokenizer, row["messages"], spans, f"row {index}"))
    length = max(len(row) for row in ids)
    tokens = torch.zeros(len(ids), length, dtype=torch.int64)
    padding = torch.ones(len(ids), length, dtype=torch.bool)
    private = torch.zeros(len(ids), length, dtype=torch.bool)
    for row, (row_ids, mask) in enumerate(zip(ids, masks, strict=True)):
        tokens[row, : len(row_ids)] = torch.tensor(row_ids)
        padding[row, : len(row_ids)] = False
        private[row, : len(row_ids)] = mask
    return tokens, padding, private


def review_means(rows: torch.Tensor, owner: torch.Tensor, count: int) -> torch.Tensor:
    """``[count, h]`` mean of each review's token embeddings (``owner``: the review of each row)."""
    sums = torch.zeros(count, rows.size(1)).index_add_(0, owner, rows)
    return sums / torch.bincount(owner, minlength=count).clamp_min(1).unsqueeze(1).to(rows.dtype)


def centroid_accuracy(means: torch.Tensor, labels: torch.Tensor, centroids: torch.Tensor) -> float:
    similarity = torch.nn.functional.normalize(means, dim=1) @ torch.nn.functional.normalize(centroids, dim=1).t()
    return float((similarity.argmax(1) == labels).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-path", required=True)
    parser.add_argument("--json")
    parser.add_argument("--family", default="sentiment_long")
    parser.add_argument("--epsilon", type=float, default=50.0)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--test-examples", type=int, default=400)
    args = parser.parse_args()
    import safetensors.torch
    import transformers

    from nemo_noise_plugin.data.span_token_prior import write_span_token_prior
    from nemo_noise_plugin.data.tasks.shipped import task_examples, task_files
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.noise.denoise import posterior_mean_rows
    from nemo_noise_plugin.noise.projection import nearest_rows
    from nemo_noise_plugin.noise.token_prior import read_token_prior
    from nemo_noise_plugin.privacy.audit.noised import noised_embeddings

    started = time.time()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.hf_path)
    weights = safetensors.torch.load_file(str(Path(args.hf_path) / "model.safetensors"))
    table = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight")).float()
    train_rows = task_examples(args.family, "training")
    test_rows = task_examples(args.family, "test")[: args.test_examples]
    label_names = sorted({row["label"] for row in train_rows})

    priors = {}
    folder = Path(tempfile.mkdtemp(prefix="denoiser_prior_"))
    for weighting in ("frequency", "support"):
        path = write_span_token_prior(task_files(args.family)["training"], tokenizer, folder / f"{weighting}.json",
                                      weighting=weighting)  # fmt: skip
        priors[weighting] = (str(path), read_token_prior(path).log_prior(table.size(0)))
    support = len(read_token_prior(priors["support"][0]).counts)

    # The clean reader: class centroids of the clean training reviews' mean embeddings.
    train_tokens, _, train_private = rendered_batch(tokenizer, train_rows)
    owner_train = torch.arange(len(train_rows)).unsqueeze(1).expand_as(train_tokens)[train_private]
    train_means = review_means(table[train_tokens[train_private]], owner_train, len(train_rows))
    train_labels = torch.tensor([label_names.index(row["label"]) for row in train_rows])
    centroids = torch.stack([train_means[train_labels == c].mean(0) for c in range(len(label_names))])

    tokens, padding, private = rendered_batch(tokenizer, test_rows)
    owner = torch.arange(len(test_rows)).unsqueeze(1).expand_as(tokens)[private]
    truth = tokens[private]
    labels = torch.tensor([label_names.index(row["label"]) for row in test_rows])
    clean = table[truth]
    in_support = float(torch.isfinite(priors["support"][1][truth]).float().mean())
    per_seed: dict[str, list[dict[str, float]]] = {}
    base = NoiseConfig(mechanism="gaussian_mechanism", epsilon=args.epsilon, delta=1e-5, clip_norm=CLIP_NORM,
                       tokens="spans")  # fmt: skip
    ceiling = centroid_accuracy(review_means(clean, owner, len(test_rows)), labels, centroids)
    for seed in [int(s) for s in args.seeds.split(",")]:
        config = dataclasses.replace(base, seed=seed)
        release = noised_embeddings(table, tokens, config, padding_mask=padding, private_mask=private)[private]
        sigma = float(config.dp_sigma)
        nearest = nearest_rows(release, table, clip_norm=CLIP_NORM)
        variants = {"raw": (release, None), "nearest_row": (table[nearest], nearest)}
        variants["posterior_uniform"] = posterior_mean_rows(release, table, density="gaussian", scale=sigma,
                                                            clip_norm=CLIP_NORM)  # fmt: skip
        for weighting, (_, log_prior) in priors.items():
            variants[f"posterior_{weighting}"] = posterior_mean_rows(
                release, table, density="gaussian", scale=sigma, clip_norm=CLIP_NORM, log_prior=log_prior
            )
        for name, (rows, ids) in variants.items():
            per_seed.setdefault(name, []).append(
                dict(
                    recovery=float((ids == truth).float().mean()) if ids is not None else None,
                    squared_error=float((rows - clean).pow(2).sum(1).mean()),
                    cosine=float(torch.nn.functional.cosine_similarity(rows, clean, dim=1).mean()),
                    reader_accuracy=centroid_accuracy(review_means(rows, owner, len(test_rows)), labels, centroids),
                )
            )
        print(f"seed {seed} done at {time.time() - started:.0f} s", flush=True)

    def summary(values: list[float | None]) -> dict[str, float] | None:
        if None in values:  # the raw release has no recovered id
            return None
        return dict(mean=statistics.fmean(values), sd=statistics.stdev(values) if len(values) > 1 else 0.0,
                    min=min(values), max=max(values))  # fmt: skip

    table_out = {
        name: {metric: summary([row[metric] for row in rows]) for metric in rows[0]} for name, rows in per_seed.items()
    }
    paired = {}
    for weighting in priors:
        paired[f"posterior_{weighting} - posterior_uniform"] = {
            metric: summary([a[metric] - b[metric] for a, b in
                             zip(per_seed[f"posterior_{weighting}"], per_seed["posterior_uniform"], strict=True)])
            for metric in ("recovery", "squared_error", "cosine", "reader_accuracy")
        }  # fmt: skip
    result = dict(
        family=args.family,
        epsilon=args.epsilon,
        clip_norm=CLIP_NORM,
        sigma=float(base.dp_sigma),
        seeds=args.seeds,
        test_examples=len(test_rows),
        review_tokens=int(truth.numel()),
        prior_support_tokens=support,
        test_tokens_in_prior_support=in_support,
        train_span_tokens=int(train_private.sum()),
        clean_reader_accuracy=ceiling,
        chance=1 / len(label_names),
        variants=table_out,
        per_seed=per_seed,
        paired=paired,
        seconds=time.time() - started,
        command=" ".join(["python", *sys.argv]),
    )
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
