"""The main job on the embedded default: the tiny recipe trained on the shipped corpus, then a robustness report.

The run uses the tiny recipe's Bridge ``ConfigContainer`` (``nemo_noise_plugin.recipes``), its provider and model,
the shipped corpus through Bridge's GPT data pipeline, and the plugin's Bridge forward step and loss. With a GPU it
is Bridge's real training loop (``launch``: checkpoints under the output directory, resumable with the same noise),
with the report computed by Bridge callbacks at the start and end of training. Without one, a single-process CPU
loop drives those same pieces, clearly labelled: float32 instead of bf16, torch's AdamW instead of Megatron's
optimizer, Megatron's CUDA-only pieces replaced by the substitutes in ``nemo_noise_plugin.testing.cpu_substitutes``
(listed at start). Each step prints
the loss (and the KD loss when distilling) and tokens/s; at the end a robustness report compares the model before
and after training: held-out loss and KL(clean || noisy) against the noise scale, as a table, JSON and PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence

import torch

from nemo_noise_plugin.noise.config import MECHANISMS, SCALINGS, NoiseConfig, load_noise_config

RECIPES = ("tiny_noise_sft", "tiny_noise_distillation")
REPORT_SCALES = (0.0, 2.5, 5.0, 10.0, 20.0, 40.0)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nemo_noise_plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=RECIPES, default="tiny_noise_sft", help="default tiny_noise_sft")
    parser.add_argument("--steps", type=int, default=30, help="training iterations (default 30)")
    parser.add_argument(
        "--stop-after",
        type=int,
        help="GPU only: save a checkpoint and stop at this iteration, as an interrupted run would; running the same "
        "command without it resumes there from the checkpoint in --output-dir",
    )
    parser.add_argument("--output-dir", default="outputs/main_job", help="report, plot and data (default %(default)s)")
    parser.add_argument("--noise-config", help="YAML of NoiseConfig fields, e.g. configs/noise/gaussian.yaml")
    parser.add_argument("--mechanism", choices=MECHANISMS, help="overrides the config (default uniform)")
    parser.add_argument("--alpha", type=float, help="NEFTune alpha of uniform noise (default 10)")
    parser.add_argument("--sigma", type=float, help="gaussian noise multiplier")
    parser.add_argument("--scaling", choices=SCALINGS, help="overrides the config (default true_length)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} is invalid: expected an integer >= 1.")
    if args.stop_after is not None and not 1 <= args.stop_after < args.steps:
        parser.error(f"--stop-after={args.stop_after} is invalid: expected an integer in [1, --steps={args.steps}).")
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

    from nemo_noise_plugin import recipes

    os.makedirs(args.output_dir, exist_ok=True)
    config = getattr(recipes, f"{args.recipe}_config")(
        dir=args.output_dir, train_iters=args.steps, lr=args.lr, noise=noise
    )
    config.train.exit_interval = args.stop_after
    config.rng.seed = args.seed
    return train_with_report(config, output_dir=args.output_dir, label=f"recipe {args.recipe}")


def train_with_report(config, *, output_dir: str, label: str) -> int:
    """Train ``config`` (a tiny recipe's ``ConfigContainer``) and print and write the robustness report.

    With a GPU: Bridge's training loop (``launch``) with the report computed by callbacks. Without one: the CPU loop,
    which says so. Steps, learning rate and seed are the config's (``train.train_iters``, ``optimizer.lr``,
    ``rng.seed``); the report goes to ``output_dir/robustness.{json,png}``.
    """
    os.makedirs(output_dir, exist_ok=True)
    if torch.cuda.is_available():
        return _run_on_gpu(config, output_dir, label)
    if config.train.exit_interval is not None:
        print(
            "error: --stop-after needs Bridge's training loop (a GPU); the CPU loop writes no checkpoint.",
            file=sys.stderr,
        )
        return 2

    from nemo_noise_plugin.testing.cpu_substitutes import CPU_SUBSTITUTES
    from nemo_noise_plugin.testing.harness import destroy_cpu_parallel, init_cpu_parallel

    print(f"== nemo-noise-plugin main job: {label} on the embedded corpus ==")
    print("CPU loop (Bridge's training loop needs CUDA): the recipe's provider, model, data pipeline, forward step")
    print("and loss, driven by a single-process loop; float32 instead of bf16, torch AdamW instead of Megatron's")
    print("optimizer. CPU substitutes in use:")
    for name, role in CPU_SUBSTITUTES.items():
        print(f"  - {name}: {role}")
    init_cpu_parallel(seed=config.rng.seed)
    try:
        return _run(config, output_dir)
    finally:
        from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

        destroy_num_microbatches_calculator()
        destroy_cpu_parallel()


def held_out_batches(config, count: int, attention_mask: torch.Tensor | None, device) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of the recipe's validation split (its dataset config already has its tokenizer)."""
    from nemo_noise_plugin.bridge_imports import import_bridge

    data = import_bridge("megatron.bridge.data.utils")
    size = config.train.micro_batch_size
    _, valid, _ = data.pretrain_train_valid_test_datasets_provider([0, count * size, 0], config.dataset)
    return collate(valid, count, size, attention_mask, device)


def collate(dataset, count: int, size: int, attention_mask, device, start: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of ``size`` consecutive samples from ``start``, on ``device``."""
    items = [dataset[start + index] for index in range(count * size)]
    batches = []
    for index in range(count):
        batch = torch.utils.data.default_collate(items[index * size : (index + 1) * size])
        batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
        batch["attention_mask"] = attention_mask
        batches.append(batch)
    return batches


def logits_of(module, batch):
    """Logits ``[b, s, V]`` of a model chunk for a batch (no labels)."""
    return module(batch["tokens"], batch["position_ids"], batch["attention_mask"])


def write_report(curves, scale_name: str, output_dir: str) -> None:
    """Print the robustness table and write it as JSON and PNG under ``output_dir``."""
    from nemo_noise_plugin.robustness import format_report, plot_report

    print(f"\nrobustness report: held-out loss and KL(clean || noisy) in nats/token against {scale_name}")
    print(format_report(curves, scale_name))
    report_path = os.path.join(output_dir, "robustness.json")
    with open(report_path, "w") as handle:
        json.dump({name: [dataclasses.asdict(p) for p in points] for name, points in curves.items()}, handle, indent=2)
    plot_path = os.path.join(output_dir, "robustness.png")
    plotted = plot_report(curves, scale_name, plot_path)
    print(f"report: {report_path}" + (f"; plot: {plot_path}" if plotted else " (install matplotlib for the plot)"))


def _run_on_gpu(config, output_dir: str, label: str) -> int:
    """Bridge's real training loop on the recipe (checkpoints under the output directory), reported by callbacks."""
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.bridge_imports import import_bridge
    from nemo_noise_plugin.launch import launch
    from nemo_noise_plugin.robustness import robustness_curve, scale_field

    print(f"== nemo-noise-plugin main job: {label} on the embedded corpus, Bridge's training loop ==")
    callbacks = import_bridge("megatron.bridge.training.callbacks")
    noise = config.model.noise
    curves: dict = {}

    class RobustnessReport(callbacks.Callback):
        """Evaluates the first model chunk on held-out batches at the start and at the end of training."""

        def _curve(self, context):
            batches = held_out_batches(context.state.cfg, 4, None, torch.cuda.current_device())
            return robustness_curve(unwrap_model(context.model[0]), batches, noise, REPORT_SCALES, logits_of)

        def on_train_start(self, context) -> None:
            curves["before"] = self._curve(context)
            if context.state.train_state.step:
                print(f"resumed: the report's 'before' is the model at iteration {context.state.train_state.step}")

        def on_train_end(self, context) -> None:
            curves["after"] = self._curve(context)

    launch(config, callbacks=[RobustnessReport(), progress_line_callback(callbacks.Callback)()])
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        if "after" in curves:
            write_report(curves, scale_field(noise), output_dir)
        else:
            print("no robustness report: training ended before its last iteration")
    return 0


def progress_line_callback(base: type) -> type:
    """A Bridge callback class (subclass of ``base``) printing one line per step: loss, KD loss and tokens/s."""

    class ProgressLine(base):
        def __init__(self) -> None:
            self.step_started = 0.0

        def on_train_start(self, context) -> None:
            print(f"{'step':>9} {'loss':>9} {'kd loss':>9} {'tokens/s':>9}", flush=True)

        def on_train_step_start(self, context) -> None:
            self.step_started = time.perf_counter()

        def on_train_step_end(self, context) -> None:
            elapsed = time.perf_counter() - self.step_started
            train = context.state.cfg.train
            losses = {key: float(value) for key, value in (context.loss_dict or {}).items()}
            kd = f"{losses['kd loss']:>9.4f}" if "kd loss" in losses else f"{'-':>9}"
            tokens = train.global_batch_size * context.state.cfg.model.seq_length
            step = f"{context.state.train_state.step + 1}/{train.train_iters}"  # Bridge counts it after this event
            if losses and _is_last_rank():  # the loss exists on the last pipeline stage; print it once
                print(
                    f"{step:>9} {losses.get('lm loss', float('nan')):>9.4f} {kd} {tokens / elapsed:>9.0f}", flush=True
                )

    return ProgressLine


def _is_last_rank() -> bool:
    if not torch.distributed.is_initialized():
        return True
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def _run(config, output_dir: str) -> int:
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_noise_plugin.bridge_imports import import_bridge
    from nemo_noise_plugin.distillation.provider import NoisyDistillationProvider
    from nemo_noise_plugin.forward_step import distillation_forward_step, noise_forward_step
    from nemo_noise_plugin.robustness import robustness_curve, scale_field

    provider = config.model
    provider.bf16, provider.params_dtype, provider.pipeline_dtype = False, torch.float32, torch.float32
    config.dataset.skip_getting_attention_mask_from_dataset = False  # the CPU needs an explicit causal mask
    tokenizer = import_bridge("megatron.bridge.training.tokenizers.tokenizer").build_tokenizer(config.tokenizer)
    config.dataset.tokenizer = tokenizer
    config.dataset.finalize()
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    train_config = config.train
    micro_batches = train_config.global_batch_size // train_config.micro_batch_size
    init_num_microbatches_calculator(0, None, train_config.global_batch_size, train_config.micro_batch_size, 1)

    steps = train_config.train_iters
    torch.manual_seed(config.rng.seed)
    model = provider.provide_distributed_model(
        use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
    )[0]
    data = import_bridge("megatron.bridge.data.utils")
    eval_batches_count = 4
    train_ds, valid_ds, _ = data.pretrain_train_valid_test_datasets_provider(
        [steps * train_config.global_batch_size, eval_batches_count * train_config.micro_batch_size, 0],
        config.dataset,
    )
    state = import_bridge("megatron.bridge.training.state").GlobalState()
    state.cfg = config
    forward_step = distillation_forward_step if isinstance(provider, NoisyDistillationProvider) else noise_forward_step
    sequence = provider.seq_length
    mask = torch.triu(torch.ones(sequence, sequence, dtype=torch.bool), 1).view(1, 1, sequence, sequence)

    held_out = collate(valid_ds, eval_batches_count, train_config.micro_batch_size, mask, "cpu")
    scale_name = scale_field(provider.noise)
    before = robustness_curve(model, held_out, provider.noise, REPORT_SCALES, logits_of)

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=config.optimizer.lr,
        weight_decay=config.optimizer.weight_decay,
    )
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters ({type(model).__name__});")
    print(f"noise: {_non_default(provider.noise)}; {micro_batches} microbatches of {train_config.micro_batch_size}")
    print(f"{'step':>4} {'loss':>9} {'kd loss':>9} {'tokens/s':>9}")
    model.train()
    for step in range(steps):
        state.train_state.step = step
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        start = step * train_config.global_batch_size
        for batch in collate(train_ds, micro_batches, train_config.micro_batch_size, mask, "cpu", start):
            output, loss_function = forward_step(state, iter([batch]), model)
            loss_sum, num_tokens, report = loss_function(output)
            (loss_sum / num_tokens / micro_batches).backward()
            for key, value in report.items():
                totals[key] = totals.get(key, 0) + value.detach()
        optimizer.step()
        elapsed = time.perf_counter() - started
        lm = totals["lm loss"][0] / totals["lm loss"][1]
        kd = f"{float(totals['kd loss'][0] / totals['kd loss'][1]):>9.4f}" if "kd loss" in totals else f"{'-':>9}"
        tokens = float(totals["lm loss"][1])
        print(f"{step + 1:>4} {float(lm):>9.4f} {kd} {tokens / elapsed:>9.0f}", flush=True)

    after = robustness_curve(model, held_out, provider.noise, REPORT_SCALES, logits_of)
    write_report({"before": before, "after": after}, scale_name, output_dir)
    return 0


def _non_default(config) -> str:
    defaults = type(config)()
    changed = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(defaults, f.name)
    }
    return f"{type(config).__name__}({', '.join(f'{k}={v!r}' for k, v in changed.items())})"


if __name__ == "__main__":
    sys.exit(main())
