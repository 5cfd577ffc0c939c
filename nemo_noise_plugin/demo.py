"""The main job on the embedded default: a tiny noisy GPT trained for a few steps on the shipped corpus (CPU).

Real Megatron-Core (GPTModel, local layer spec, gloo process group) with the plugin's noise layer; the CUDA-only
pieces are replaced by the substitutes in ``nemo_noise_plugin.testing.cpu_substitutes``, announced at start.
Each step prints the training loss (noise on), the loss of the same batch with and without noise, and tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from nemo_noise_plugin.corpus import BYTE_VOCAB_SIZE, load_corpus_tokens, sample_padded_batch
from nemo_noise_plugin.noise.config import MECHANISMS, SCALINGS, NoiseConfig, load_noise_config


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nemo_noise_plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps (default 12)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--noise-config", help="YAML of NoiseConfig fields, e.g. configs/noise/gaussian.yaml")
    parser.add_argument("--mechanism", choices=MECHANISMS, help="overrides the config (default uniform)")
    parser.add_argument("--alpha", type=float, help="NEFTune alpha of uniform noise (default 10)")
    parser.add_argument("--sigma", type=float, help="gaussian noise multiplier")
    parser.add_argument("--scaling", choices=SCALINGS, help="overrides the config (default true_length)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: expected an integer >= 1.")
    if args.lr <= 0:
        parser.error(f"--lr={args.lr} is invalid: expected a number > 0.")
    return args


def build_noise_config(args: argparse.Namespace) -> NoiseConfig:
    """The noise settings: the embedded default (NEFTune alpha 10) or a YAML preset, then the flags given."""
    flags = {name: getattr(args, name) for name in ("mechanism", "alpha", "sigma", "scaling")}
    overrides = {name: value for name, value in flags.items() if value is not None}
    overrides["seed"] = args.seed
    if args.noise_config:
        return load_noise_config(args.noise_config, **overrides)
    return NoiseConfig(**{"alpha": 10.0, **overrides})


def masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return (per_token_loss * loss_mask).sum() / loss_mask.sum().clamp_min(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        noise = build_noise_config(args)
    except OSError as error:
        print(f"error: --noise-config {args.noise_config!r} cannot be read: {error.strerror}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    from nemo_noise_plugin.noisy_gpt import NoisyGPTModel
    from nemo_noise_plugin.testing.cpu_substitutes import CPU_SUBSTITUTES
    from nemo_noise_plugin.testing.harness import (
        build_tiny_gpt,
        causal_attention_mask,
        destroy_cpu_parallel,
        init_cpu_parallel,
    )

    print("== nemo-noise-plugin main job: CPU loop on the embedded default (no GPU; Bridge's loop needs CUDA) ==")
    print("Real Megatron-Core GPTModel (local layer spec) on a single-process gloo group. CPU substitutes in use:")
    for name, role in CPU_SUBSTITUTES.items():
        print(f"  - {name}: {role}")
    init_cpu_parallel(seed=args.seed)
    try:
        model = build_tiny_gpt(
            vocab_size=BYTE_VOCAB_SIZE,
            max_sequence_length=args.seq_length,
            model_class=NoisyGPTModel,
            noise_config=noise,
        )
        corpus = load_corpus_tokens()
        generator = torch.Generator().manual_seed(args.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        mask = causal_attention_mask(args.seq_length)
        parameters = sum(p.numel() for p in model.parameters())
        print(f"model: {parameters / 1e3:.0f}k parameters, byte vocabulary; corpus: {corpus.numel()} tokens")
        print(f"noise: {noise}")
        print(
            f"{'step':>4} {'train loss':>10} {'clean loss':>10} {'noisy loss':>10} {'noise cost':>10} {'tokens/s':>9}"
        )
        for step in range(1, args.steps + 1):
            batch = sample_padded_batch(corpus, args.batch_size, args.seq_length, generator, args.seq_length // 4)
            started = time.perf_counter()
            model.train()
            model.noise_clock.start_iteration(step - 1)  # as Bridge's forward step does with train_state.step
            optimizer.zero_grad(set_to_none=True)
            per_token = model(batch.tokens, batch.position_ids, mask, labels=batch.labels, loss_mask=batch.loss_mask)
            loss = masked_mean(per_token, batch.loss_mask)
            loss.backward()
            optimizer.step()
            elapsed = time.perf_counter() - started
            with torch.no_grad():
                clean, noisy = _same_batch_losses(model, batch, mask)
            tokens_per_second = batch.loss_mask.sum().item() / elapsed
            print(
                f"{step:>4} {loss.item():>10.4f} {clean:>10.4f} {noisy:>10.4f} {noisy - clean:>+10.4f} "
                f"{tokens_per_second:>9.0f}"
            )
        print("train loss: noisy forward the step trained on; clean/noisy loss: the same batch after the step.")
    finally:
        destroy_cpu_parallel()
    return 0


def _same_batch_losses(model, batch, mask) -> tuple[float, float]:
    """Loss of one batch with the noise off (eval) and on (train mode, a fresh draw), without training."""
    losses = []
    for training in (False, True):
        model.train(training)
        per_token = model(batch.tokens, batch.position_ids, mask, labels=batch.labels, loss_mask=batch.loss_mask)
        losses.append(masked_mean(per_token, batch.loss_mask).item())
    model.train()
    return losses[0], losses[1]


if __name__ == "__main__":
    sys.exit(main())
