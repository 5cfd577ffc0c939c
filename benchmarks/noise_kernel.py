"""Time the fused noise kernel against the memory-bandwidth floor, naive torch noise and HF's NEFTune hook.

On one CUDA GPU, for bf16 ``[s, b, h]`` embedding outputs, prints per call (microseconds, and as a ratio to the
measured floor): the floor (bytes / datasheet bandwidth, and a measured ``out.copy_(x)`` of the same bytes), ours
(``fused_add_noise``, uniform NEFTune with a per-token scale), naive ``x + zeros_like(x).uniform_(-m, m)`` and
HF transformers' NEFTune hook body. Then times forward+backward of one microbatch of a ~1B Megatron-Core GPT
(plain torch transformer if megatron-core cannot run) and prints the noise kernel's share of that step.

Every method is timed the same way: a CUDA graph of many calls cycling over several input/output buffer sets (so
the L2 cache holds none of them and no launch gap is counted), replayed many times; median of the replays.

    python benchmarks/noise_kernel.py [--json PATH] [--sweep] [--skip-step]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_noise_plugin.noise.fused_noise import fused_add_noise  # noqa: E402
from nemo_noise_plugin.noise.triton_kernel import _default_config, launch_add_noise  # noqa: E402

SHAPES = [(4096, 2, 2048), (4096, 2, 4096), (8192, 1, 8192)]
DATASHEET_TBPS = {"H200": 4.8, "H100": 3.35}  # vendor HBM bandwidth, for the theoretical floor
ALPHA = 5.0
SWEEP_CONFIGS = [
    (1, 512, 4, 1),
    (4, 512, 4, 1),
    (1, 1024, 4, 1),
    (2, 1024, 4, 1),
    (4, 1024, 8, 1),
    (1, 2048, 4, 1),
    (2, 2048, 4, 1),
    (2, 2048, 8, 1),
    (4, 2048, 8, 1),
    (1, 4096, 4, 1),
    (1, 4096, 8, 1),
    (2, 4096, 8, 1),
    (1, 8192, 8, 1),
    (1, 8192, 16, 1),
]


def hf_neftune(module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
    """Body of transformers' ``neftune_post_forward_hook`` (src/transformers/integrations/neftune.py, v5.12.1),
    verbatim, on HF's ``[b, s, h]`` layout."""
    if module.training:
        dims = torch.tensor(output.size(1) * output.size(2))
        mag_norm = module.neftune_noise_alpha / torch.sqrt(dims)
        output = output + torch.zeros_like(output).uniform_(-mag_norm, mag_norm)
    return output


def time_per_call(make_call: Callable[[int], Callable[[], object]], n_sets: int, replays: int = 30) -> float:
    """Median microseconds per call; ``make_call(i)`` returns the call on buffer set ``i``."""
    calls = [make_call(i) for i in range(n_sets)]
    per_graph = max(n_sets * 4, 16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: compile, autotune, allocator
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(per_graph):
            calls[k % n_sets]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / per_graph)
    del graph
    return statistics.median(times)


def neftune_scale(seq: int, batch: int, hidden: int, device: torch.device) -> torch.Tensor:
    """Per-token NEFTune scale alpha / sqrt(L * h) from each sample's true length; padded tokens get 0."""
    lengths = torch.linspace(seq // 2, seq, batch).round().to(device)
    positions = torch.arange(seq, device=device).view(seq, 1)
    return torch.where(positions < lengths.view(1, batch), ALPHA / torch.sqrt(lengths * hidden), 0.0).float()


def bench_shape(shape: tuple[int, int, int], sweep: bool) -> dict:
    """All methods on one ``[s, b, h]`` bf16 shape."""
    seq, batch, hidden = shape
    device = torch.device("cuda")
    x_bytes = seq * batch * hidden * 2
    n_sets = max(3, math.ceil(1.0e9 / (2 * x_bytes)))  # >= 1 GB of buffers: far beyond the 60 MB L2
    xs = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(n_sets)]
    outs = [torch.empty_like(x) for x in xs]
    positions = torch.arange(seq, device=device)
    samples = torch.arange(batch, device=device) + 1000
    scale = neftune_scale(seq, batch, hidden, device)
    magnitude = ALPHA / math.sqrt(seq * hidden)
    embedding = torch.nn.Module()
    embedding.neftune_noise_alpha = ALPHA
    kernel_args = {"seed": 1234, "iteration": 7, "sample_index": samples, "token_position": positions}

    def ours(i: int) -> Callable[[], object]:
        return lambda: fused_add_noise(xs[i], noise_scale=scale, **kernel_args)

    row = {
        "shape": list(shape),
        "bytes": 2 * x_bytes,
        "buffer_sets": n_sets,
        "floor_copy_us": time_per_call(lambda i: lambda: outs[i].copy_(xs[i]), n_sets),
        "ours_us": time_per_call(ours, n_sets),
        "naive_us": time_per_call(
            lambda i: lambda: xs[i] + torch.zeros_like(xs[i]).uniform_(-magnitude, magnitude), n_sets
        ),
        "hf_neftune_us": time_per_call(lambda i: lambda: hf_neftune(embedding, xs[i].transpose(0, 1)), n_sets),
        "ours_config": list(_default_config(hidden)),
    }
    row["ours_repeat_us"] = time_per_call(ours, n_sets)
    if sweep:
        row["sweep"], row["sweep_tl_philox"] = {}, {}
        for config in SWEEP_CONFIGS:
            if config[1] > 2 * hidden:
                continue
            for tl_philox, table in ((False, row["sweep"]), (True, row["sweep_tl_philox"])):

                def swept(i: int, config=config, tl_philox=tl_philox) -> Callable[[], object]:
                    return lambda: launch_add_noise(
                        xs[i],
                        outs[i],
                        noise_scale=scale,
                        input_scale=None,
                        distribution="uniform",
                        config=config,
                        tl_philox=tl_philox,
                        **kernel_args,
                    )

                table[str(config)] = time_per_call(swept, n_sets)
    row["ours_gaussian_us"] = time_per_call(
        lambda i: lambda: fused_add_noise(xs[i], noise_scale=scale, distribution="gaussian", **kernel_args), n_sets
    )
    return row


def _megatron_model(layers: int, hidden: int, ffn: int, heads: int, seq: int, vocab: int) -> torch.nn.Module:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The local spec's attention is unfused (no TE/flash here): a bf16 softmax keeps 16 layers' [b, heads, s, s]
        # probabilities within the card's memory.
        attention_softmax_in_fp32=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=seq,
    )
    return Float16Module(config, model).cuda()  # as Megatron's training loop wraps it: all parameters bf16


class _TorchGPT(torch.nn.Module):
    """Fallback: a pre-norm torch transformer of the same size (SDPA attention), embedding to logits."""

    def __init__(self, layers: int, hidden: int, ffn: int, heads: int, vocab: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        layer = torch.nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, activation="gelu", norm_first=True)
        self.decoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = tokens.size(1)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device, dtype=torch.bfloat16)
        hidden = self.decoder(self.embedding(tokens).transpose(0, 1), mask=mask, is_causal=True)
        logits = self.head(hidden).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.transpose(0, 1).flatten())


def time_training_step(
    megatron: bool, layers=16, hidden=2048, ffn=8192, heads=32, seq=4096, micro_batch=2, vocab=32000
) -> dict:
    """Median forward+backward time of one microbatch of a ~1B GPT: Megatron-Core (plain torch if that fails), or
    the plain torch transformer, whose SDPA flash attention gives the shorter step a fused-attention stack takes."""
    tokens = torch.randint(0, vocab, (micro_batch, seq), device="cuda")
    labels = torch.roll(tokens, -1, dims=1)
    info = {"layers": layers, "hidden": hidden, "ffn": ffn, "heads": heads, "seq": seq, "micro_batch": micro_batch}
    info["model"] = "plain torch transformer (nn.TransformerEncoder, SDPA flash attention)"
    if megatron:
        try:
            model = _megatron_model(layers, hidden, ffn, heads, seq, vocab)
            position_ids = torch.arange(seq, device="cuda").unsqueeze(0).expand(micro_batch, -1)
            info["model"] = "megatron-core GPTModel, local layer spec (unfused attention, no Transformer Engine)"

            def step() -> None:
                model(tokens, position_ids, None, labels=labels).float().mean().backward()

            step()
        except Exception as error:  # any failure to build or run megatron selects the fallback
            info["model"] = f"plain torch transformer (megatron-core failed: {type(error).__name__}: {error})"
    if info["model"].startswith("plain"):  # outside the except block, whose traceback would pin GPU memory
        model = None
        gc.collect()
        torch.cuda.empty_cache()
        model = _TorchGPT(layers, hidden, ffn, heads, vocab).cuda().to(torch.bfloat16)

        def step() -> None:
            model(tokens, labels).backward()

    info["parameters"] = sum(p.numel() for p in model.parameters())
    model.train()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for index in range(8):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if index >= 3:
            times.append((time.perf_counter() - start) * 1e6)
    info["step_us"] = statistics.median(times)
    info["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel at several block configurations")
    parser.add_argument("--skip-step", action="store_true", help="skip the 1B training-step measurement")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")

    import triton

    name = torch.cuda.get_device_name()
    peak = next((tbps for key, tbps in DATASHEET_TBPS.items() if key in name), None)
    results = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "datasheet_tbps": peak}
    results["shapes"] = [bench_shape(shape, args.sweep) for shape in SHAPES]
    torch.cuda.empty_cache()

    print(f"\n{name}, torch {torch.__version__}, triton {triton.__version__}; bf16 [s, b, h]; per call, CUDA graph")
    print("(x) = ratio to the measured floor (out.copy_(x)); theoretical floor = bytes / datasheet bandwidth\n")
    header = f"{'shape':>16} {'MB r+w':>7} {'theory':>7} {'copy':>7} {'ours':>15} {'naive':>15} {'HF NEFTune':>15}"
    print(header + f" {'copy TB/s':>9} {'ours TB/s':>9} {'gauss':>15}")
    for row in results["shapes"]:
        floor = row["floor_copy_us"]
        theory = row["bytes"] / (peak * 1e12) * 1e6 if peak else float("nan")
        row["floor_theory_us"] = theory

        def cell(us: float, floor: float = floor) -> str:
            return f"{us:8.1f} ({us / floor:4.2f}x)"

        print(
            f"{str(tuple(row['shape'])):>16} {row['bytes'] / 1e6:7.1f} {theory:7.1f} {floor:7.1f}"
            f" {cell(row['ours_us'])}"
            f" {cell(row['naive_us'])} {cell(row['hf_neftune_us'])} {row['bytes'] / floor / 1e6:9.2f}"
            f" {row['bytes'] / row['ours_us'] / 1e6:9.2f} {cell(row['ours_gaussian_us'])}"
        )
    print("times in microseconds; ours repeated:", ", ".join(f"{r['ours_repeat_us']:.1f}" for r in results["shapes"]))
    if args.sweep:
        print("sweep of (rows, hidden, warps) per program, microseconds; ours = kernel's rounds, tl = tl.philox:")
        for row in results["shapes"]:
            for label, table in (("ours", row["sweep"]), ("tl", row["sweep_tl_philox"])):
                best = min(table, key=table.get)
                cells = "  ".join(f"{key}:{us:.1f}" for key, us in table.items())
                print(f"{str(tuple(row['shape'])):>16} {label:>4}: {cells}  best {best}")

    if not args.skip_step:
        results["training_steps"] = []
        for megatron in (True, False):
            step = time_training_step(megatron)
            gc.collect()
            torch.cuda.empty_cache()
            results["training_steps"].append(step)
            shape = [step["seq"], step["micro_batch"], step["hidden"]]
            noise = next(r for r in results["shapes"] if r["shape"] == shape)
            print(f"\n1B-class training step: {step['model']}")
            print(
                f"  {step['parameters'] / 1e9:.2f}B parameters, {step['layers']} layers, h={step['hidden']}, "
                f"ffn={step['ffn']}, {step['heads']} heads, s={step['seq']}, micro-batch {step['micro_batch']}, "
                f"bf16; forward+backward {step['step_us'] / 1e3:.1f} ms (peak {step['peak_memory_gib']:.1f} GiB)"
            )
            for label, key in (("ours", "ours_us"), ("naive", "naive_us"), ("HF NEFTune", "hf_neftune_us")):
                share = noise[key] / step["step_us"] * 100
                step[f"{key[:-3]}_share_percent"] = share
                print(f"  noise {label:>10} on {tuple(shape)}: {noise[key]:7.1f} us = {share:.4f}% of the step")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
