"""Can a learner find the gist in noised embeddings, and in how many steps? A CPU proxy beside the LM grid (issue 33).

Question. On the gist task at Gaussian eps 100, projected training of SmolLM2 reached 0.675 while noise-aware
training stayed at chance for all 94 steps, though a naive-Bayes decoder that knows the generator reads 0.97 of the
classes from the same noised tokens (``gist_information_bound.py``). Is the information out of a learner's reach in
raw noised embeddings, or did 94 steps of fine-tuning a pretrained LM not find it?

Hypothesis. Under heavy Gaussian noise the Bayes evidence of a token is nearly linear in its noised embedding
(``log p(z | c) = logsumexp_v [log P_c(v) - |z - e_v|^2 / 2 sigma^2]``, and ``z . e_v / sigma^2`` is small), and the
evidence of a review is the sum over its tokens. So a linear probe on the *mean* noised embedding, trained on fresh
noise each step, should approach the bound within a few hundred steps; if it does, the LM's failure is optimisation
(its steps, learning rate, pretrained input layer), not information.

Method. SmolLM2-135M-Instruct's embedding table, clipped to norm 3 (the grid's clip norm); each review's tokens (the
private span: what a ``tokens: spans`` run noises) as in the bound script. Learners, trained on the training split
with fresh noise every step (noise-aware), batch 64, AdamW (lr 1e-2 probe, 3e-3 MLP), seeds 1-3 (the seed sets
initialisation, batch order and training noise): ``probe`` (linear on the mean noised embedding) and ``mlp`` (a
per-token two-layer MLP, width 128, mean-pooled, then linear: it can also learn non-linear per-token evidence).
Test accuracy on one fixed noise draw (seed 777, as the grid) after 94 steps (the LM grid's budget at batch 64),
300, 1000 and 3000; beside it the same learner trained clean and scored under the same noise (the plain baseline).

    python benchmarks/gist_learnability.py --hf-path "$(python scripts/fetch_smollm2.py)" \\
        --json benchmarks/results/private_tasks/gist_learnability.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gist_information_bound import CLIP_NORM, gaussian_sigma, review_tokens  # noqa: E402

CHECKPOINTS = (94, 300, 1000, 3000)
BATCH = 64
EVAL_NOISE_SEED = 777
LEVELS = {"sentiment": (100.0, 50.0), "sentiment_long": (50.0, 40.0)}
"""Gaussian per-token eps per family: the short family where projection works (100) and where the tokens hide (50);
the long family at eps 50 (nearest neighbour recovers 9.7 %) and 40 (5.4 %)."""


def padded(reviews: list[tuple[list[int], str]], labels: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids ``[n, L]`` (0-padded), a float mask ``[n, L]``, class indices ``[n]``."""
    width = max(len(ids) for ids, _ in reviews)
    ids = torch.zeros(len(reviews), width, dtype=torch.long)
    mask = torch.zeros(len(reviews), width)
    for row, (tokens, _) in enumerate(reviews):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1.0
    return ids, mask, torch.tensor([labels.index(label) for _, label in reviews])


class Posterior(torch.nn.Module):
    """Each token's posterior over ``rows`` (uniform prior) under the Gaussian density of scale ``sigma``."""

    def __init__(self, rows: torch.Tensor, sigma: float) -> None:
        super().__init__()
        self.register_buffer("rows", rows)
        self.sigma = sigma

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        flat = inputs.reshape(-1, inputs.size(-1))
        scores = -torch.cdist(flat, self.rows).pow(2) / (2 * self.sigma**2)
        return scores.softmax(-1).reshape(*inputs.shape[:-1], -1)


class Learner(torch.nn.Module):
    """``probe``: linear on the masked mean of the inputs; ``mlp``: a per-token MLP, masked mean, then linear;
    ``posterior``: each token's posterior over the training split's token rows (the structure the Bayes bound
    knows: a noised table row), masked mean, then linear (multinomial naive Bayes with learned weights)."""

    def __init__(self, kind: str, hidden: int, classes: int, rows: torch.Tensor | None = None, sigma: float = 1.0):
        super().__init__()
        if kind == "mlp":
            self.token = torch.nn.Sequential(torch.nn.Linear(hidden, 128), torch.nn.GELU(), torch.nn.Linear(128, 128))
            width = 128
        elif kind == "posterior":
            self.token, width = Posterior(rows, sigma), rows.size(0)
        else:
            self.token, width = torch.nn.Identity(), hidden
        self.head = torch.nn.Linear(width, classes)

    def forward(self, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooled = (self.token(inputs) * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


def train_and_score(
    kind: str,
    table: torch.Tensor,
    train,
    test_inputs: torch.Tensor,
    test,
    sigma: float,
    *,
    noisy: bool,
    seed: int,
    checkpoints: tuple[int, ...] = CHECKPOINTS,
) -> dict[str, float]:
    """Accuracy on ``test_inputs`` (already noised) after each of ``checkpoints`` steps."""
    ids, mask, labels = train
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    rows = table[torch.unique(ids[mask.bool()])] if kind == "posterior" else None
    learner = Learner(kind, table.size(1), int(labels.max()) + 1, rows, sigma)
    optimizer = torch.optim.AdamW(learner.parameters(), lr=3e-3 if kind == "mlp" else 1e-2)
    scores = {}
    for step in range(1, max(checkpoints) + 1):
        rows = torch.randint(0, ids.size(0), (BATCH,), generator=generator)
        inputs = table[ids[rows]]
        if noisy:
            inputs = inputs + sigma * torch.randn(inputs.shape, generator=generator)
        loss = torch.nn.functional.cross_entropy(learner(inputs, mask[rows]), labels[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in checkpoints:
            with torch.no_grad():
                predicted = learner(test_inputs, test[1]).argmax(-1)
            scores[str(step)] = float((predicted == test[2]).float().mean())
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-path", required=True)
    parser.add_argument("--json")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--families", default=",".join(LEVELS))
    parser.add_argument("--learners", default="probe,mlp")
    parser.add_argument("--max-steps", type=int, default=max(CHECKPOINTS))
    parser.add_argument("--levels", help="only these eps (comma-separated)")
    args = parser.parse_args()
    import safetensors.torch
    import transformers

    from nemo_noise_plugin.data.tasks.shipped import task_examples

    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.hf_path)
    weights = safetensors.torch.load_file(str(Path(args.hf_path) / "model.safetensors"))
    table = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight")).float()
    clipped = table * (CLIP_NORM / table.norm(dim=1, keepdim=True)).clamp(max=1.0)
    seeds = [int(s) for s in args.seeds.split(",")]
    summary = {"clip_norm": CLIP_NORM, "batch": BATCH, "seeds": seeds, "eval_noise_seed": EVAL_NOISE_SEED}
    results = json.loads(Path(args.json).read_text())["results"] if args.json and Path(args.json).exists() else []

    def done(family: str, epsilon: float, kind: str, training: str, steps: tuple[int, ...]) -> bool:
        """Whether the JSON already holds this run at these steps (a rerun adds only what is missing)."""
        return any(
            (r["family"], r["epsilon"], r["learner"], r["training"]) == (family, epsilon, kind, training)
            and set(map(str, steps)) <= set(r["accuracy_by_step"])
            for r in results
        )

    for family in args.families.split(","):
        train_reviews = review_tokens(tokenizer, task_examples(family, "training"))
        test_reviews = review_tokens(tokenizer, task_examples(family, "test"))
        labels = sorted({label for _, label in train_reviews})
        train, test = padded(train_reviews, labels), padded(test_reviews, labels)
        wanted = [float(e) for e in args.levels.split(",")] if args.levels else LEVELS[family]
        checkpoints = tuple(step for step in CHECKPOINTS if step <= args.max_steps)
        for epsilon in wanted:
            sigma = gaussian_sigma(epsilon, CLIP_NORM)
            noise = torch.randn(*test[0].shape, table.size(1), generator=torch.Generator().manual_seed(EVAL_NOISE_SEED))
            test_noised = clipped[test[0]] + sigma * noise
            for kind in args.learners.split(","):
                for noisy in (True, False):
                    training = "noise-aware" if noisy else "clean (plain baseline)"
                    if done(family, epsilon, kind, training, checkpoints):
                        continue
                    started = time.perf_counter()
                    runs = [
                        train_and_score(
                            kind, clipped, train, test_noised, test, sigma, noisy=noisy, seed=s, checkpoints=checkpoints
                        )
                        for s in seeds
                    ]
                    entry = {
                        "family": family,
                        "epsilon": epsilon,
                        "sigma": sigma,
                        "learner": kind,
                        "training": training,
                        "accuracy_by_step": {
                            step: {
                                "mean": statistics.fmean(r[step] for r in runs),
                                "sd": statistics.stdev(r[step] for r in runs) if len(runs) > 1 else 0.0,
                                "seeds": [r[step] for r in runs],
                            }
                            for step in runs[0]
                        },
                        "seconds": time.perf_counter() - started,
                    }
                    results.append(entry)
                    print(json.dumps(entry), flush=True)
                    if args.json:  # after every run: an interrupted sweep keeps what it measured
                        Path(args.json).write_text(json.dumps({**summary, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
