# ruff: noqa: E402  (imports after putting the repository on sys.path)
"""Does a clean teacher make the noisy student more robust than noise alone? A side-by-side run on the tiny model.

1. Pretrain a tiny Megatron-Core GPT (local spec, CPU, gloo) on the embedded corpus without noise: the "pretrained"
   weights, and the clean teacher.
2. From those weights fine-tune two students on the same batches with the same noise (NEFTune, true length):
   ``noise`` trains on CE alone; ``noise+KD`` on CE + KL(teacher || student) against the frozen clean teacher.
3. On held-out text (the corpus tail, never trained on) report, for the pretrained model and both students: clean CE
   and KL(clean || noisy) = the KL between the model's own predictions without and with noise, averaged over tokens,
   at several noise scales. Lower KL means the predictions move less when the embeddings are noised.

    python benchmarks/distillation_robustness.py [--pretrain-steps 600] [--finetune-steps 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))  # benchmarks.*: the shared builders, importable from a checkout

from benchmarks.tiny_gpt import (
    build_tiny_gpt,
    causal_attention_mask,
    destroy_cpu_parallel,
    init_cpu_parallel,
    sample_padded_batch,
)
from nemo_noise_plugin.data.corpus import BYTE_VOCAB_SIZE, load_corpus_tokens
from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.distillation.losses import combined_distillation_loss
from nemo_noise_plugin.distillation.teacher import build_clean_teacher
from nemo_noise_plugin.jobs.reports.robustness import robustness_curve
from nemo_noise_plugin.model import NoisyGPTModel, make_noisy
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.utils import deepcopy_module_with_process_groups

SEQ, BATCH = 64, 16


def _logits(model, batch, mask) -> torch.Tensor:
    return model(batch.tokens, batch.position_ids, mask)


def _train(model, batches, mask, steps: int, lr: float, teacher=None, kd: KDConfig | None = None) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        batch = batches[step]
        if isinstance(model, NoisyGPTModel):
            model.noise_clock.start_iteration(step)
        optimizer.zero_grad(set_to_none=True)
        with (
            model.noise_batch_inputs(batch.loss_mask) if isinstance(model, NoisyGPTModel) else contextlib.nullcontext()
        ):
            logits = _logits(model, batch, mask)
        teacher_logits = None
        if teacher is not None:
            with torch.no_grad():
                teacher_logits = _logits(teacher, batch, mask)
        config = kd if kd is not None and teacher is not None else KDConfig(enabled=False)
        result = combined_distillation_loss(config, logits, teacher_logits, batch.loss_mask, labels=batch.labels)
        result.loss.backward()
        optimizer.step()


def _evaluate(model, batches, mask, scales: list[float]) -> dict[str, float]:
    """Held-out clean CE, and KL(clean || noisy) of the model's own predictions at each NEFTune alpha."""
    as_dicts = [
        {"labels": b.labels, "loss_mask": b.loss_mask, "tokens": b.tokens, "pos": b.position_ids} for b in batches
    ]
    points = robustness_curve(
        model,
        as_dicts,
        NoiseConfig(),
        [0.0, *scales],
        lambda module, batch: module(batch["tokens"], batch["pos"], mask),
    )
    return {"clean_ce": points[0].loss, **{f"kl_alpha_{p.scale:g}": p.kl for p in points[1:]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--finetune-steps", type=int, default=300)
    parser.add_argument("--alpha", type=float, default=15.0, help="NEFTune alpha used in fine-tuning")
    parser.add_argument("--kd-weight", type=float, default=1.0, help="weight of KL(teacher || student)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    init_cpu_parallel(seed=1234)
    try:
        corpus = load_corpus_tokens()
        split = int(corpus.numel() * 0.9)
        train_text, held_out_text = corpus[:split], corpus[split:]
        generator = torch.Generator().manual_seed(0)
        pretrain_batches = [
            sample_padded_batch(train_text, BATCH, SEQ, generator, SEQ // 2) for _ in range(args.pretrain_steps)
        ]
        finetune_batches = [  # the same fresh batches, in the same order, for both students
            sample_padded_batch(train_text, BATCH, SEQ, generator, SEQ // 4) for _ in range(args.finetune_steps)
        ]
        held_out = [sample_padded_batch(held_out_text, BATCH, SEQ, generator, SEQ // 2) for _ in range(8)]
        mask = causal_attention_mask(SEQ)
        scales = [5.0, args.alpha, 30.0]

        started = time.perf_counter()
        torch.manual_seed(0)
        pretrained = build_tiny_gpt(vocab_size=BYTE_VOCAB_SIZE, max_sequence_length=SEQ)
        _train(pretrained, pretrain_batches, mask, args.pretrain_steps, lr=2e-3)
        print(f"pretrained {args.pretrain_steps} steps in {time.perf_counter() - started:.0f} s")

        rows = {"pretrained": _evaluate(pretrained, held_out, mask, scales)}
        noise = NoiseConfig(alpha=args.alpha, seed=42)
        kd = KDConfig(loss="forward_kl", ce_weight=1.0, kd_weight=args.kd_weight, tokens="response")
        for name, teacher in (("noise", None), ("noise+KD", build_clean_teacher(pretrained))):
            student = make_noisy(deepcopy_module_with_process_groups(pretrained), noise)
            _train(student, finetune_batches, mask, args.finetune_steps, lr=1e-3, teacher=teacher, kd=kd)
            rows[name] = _evaluate(student, held_out, mask, scales)
            print(f"fine-tuned '{name}' {args.finetune_steps} steps")

        columns = list(rows["pretrained"])
        print(
            f"\nheld-out text, {sum(int(b.loss_mask.sum()) for b in held_out)} tokens; KL(clean || noisy) in nats/token"
        )
        print(f"{'model':<12}" + "".join(f"{c:>16}" for c in columns))
        for name, values in rows.items():
            print(f"{name:<12}" + "".join(f"{values[c]:>16.5f}" for c in columns))
        for column in columns[1:]:
            ratio = rows["noise+KD"][column] / rows["noise"][column]
            print(f"{column}: noise+KD / noise = {ratio:.3f}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"args": vars(args), "results": rows}, handle, indent=2)
    finally:
        destroy_cpu_parallel()


if __name__ == "__main__":
    main()
