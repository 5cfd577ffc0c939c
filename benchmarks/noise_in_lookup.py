"""Time the embedding lookup with the noise in one pass against the noise-off lookup and the copy floors (issue 34).

On one CUDA GPU, for bf16 tables and Megatron's ``[s, b, h]`` decoder input, per call (CUDA graph of many calls over
buffer sets larger than L2, median of replays; ``noise_kernel.time_per_call``):

- ``copy``: ``out.copy_(x)`` of the output's bytes, the bandwidth floor of one read and one write;
- ``gather``: ``F.embedding(ids.t(), table)``, the lookup written straight into ``[s, b, h]`` (the floor of a lookup);
- ``noise_off``: Megatron-Core's noise-off embedding forward, ``F.embedding(ids, table).transpose(0, 1).contiguous()``
  (the lookup, then the transposed copy), and ``noise_off_again``, the same measured again (the A/A control);
- ``two_step_<family>``: today's noisy path, ``noise_off`` then ``fused_add_noise`` (a second pass);
- ``one_pass_<family>``: ``fused_gather_add_noise``, the lookup with the noise in one kernel;
- ``one_pass_<gaussian|laplace>_fast_math``: the same kernel with ``NoiseConfig.fast_math`` (the logarithm from the
  hardware ``lg2.approx``, contracted multiply-adds: other bits than the exact kernel's);
- with ``--against FILE`` (an earlier ``noise/triton_kernel.py`` holding ``launch_add_noise``, e.g. ``git show
  08dc745:nemo_noise_plugin/noise/triton_kernel.py > FILE``): ``earlier_one_pass_<variant>``, that kernel's one pass
  timed in the same run, and whether its outputs equal this kernel's bit for bit (``same_bits_as_earlier``), for
  every family and, where the earlier file has the setting, the fast-math variants;
- with ``--sweep``: the one-pass kernel at other launch configurations (rows, hidden per step, warps, steps).

Aims (issue 34, item 3): ``one_pass`` <= 1.02x ``noise_off``; every family <= 1.10x the copy floor. The JSON also
holds each one-pass variant's static PTX instruction counts, the account of where an arithmetic-bound family's time
goes.

    python benchmarks/noise_in_lookup.py [--json PATH] [--against FILE] [--sweep]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.noise_kernel import ALPHA, neftune_scale, time_per_call  # noqa: E402
from nemo_noise_plugin.noise.fused_noise import _kernel_arguments, fused_add_noise, fused_gather_add_noise  # noqa: E402
from nemo_noise_plugin.noise.triton_kernel import launch_add_noise  # noqa: E402

SHAPES = {  # name: (seq, micro-batch, hidden, vocab)
    "SmolLM2-135M, s 128, mb 64": (128, 64, 576, 49152),
    "Llama-3.2-1B, s 4096, mb 2": (4096, 2, 2048, 128256),
    "Llama-3.1-8B, s 4096, mb 2": (4096, 2, 4096, 128256),
    "Llama-3.1-70B, s 8192, mb 1": (8192, 1, 8192, 128256),
}
FAMILIES = ("uniform", "gaussian", "laplace")
FAST_MATH_FAMILIES = ("gaussian", "laplace")
SWEEP_CONFIGS = [(4, 512, 4, 1), (4, 512, 4, 2), (4, 512, 4, 4), (8, 512, 8, 4), (2, 512, 4, 4), (16, 128, 4, 8)]
PTX_INSTRUCTION = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9]*)[.\s;]", re.MULTILINE)


def one_pass(
    table: torch.Tensor,
    ids: torch.Tensor,
    family: str,
    noise: dict,
    fast_math: bool = False,
    config=None,
    launch=launch_add_noise,
):
    """The one-pass noised lookup through ``launch`` (this kernel's ``launch_add_noise`` or an earlier file's);
    returns the output and Triton's compiled kernel."""
    batch, seq = ids.shape
    out = torch.empty((seq, batch, table.size(1)), dtype=table.dtype, device=table.device)
    arguments = _kernel_arguments(out.shape, table.device, distribution=family, fast_math=fast_math, **noise)
    if not fast_math:  # an earlier kernel file may predate the setting
        del arguments["fast_math"]
    if config is not None:
        arguments["config"] = config
    compiled = launch(table, out, input_ids=ids, input_scale=None, **arguments)
    return out, compiled


def earlier_variants(earlier) -> list[tuple[str, bool]]:
    """The (family, fast_math) variants an earlier kernel file can run: fast math only where its
    ``launch_add_noise`` takes the setting (08dc745 on)."""
    variants = [(family, False) for family in FAMILIES]
    if "fast_math" in inspect.signature(earlier.launch_add_noise).parameters:
        variants += [(family, True) for family in FAST_MATH_FAMILIES]
    return variants


def variant_name(family: str, fast_math: bool) -> str:
    return f"{family}_fast_math" if fast_math else family


def load_kernel_file(path: Path):
    """An earlier ``noise/triton_kernel.py`` as a module of its own (up to 08dc745 it imports only torch and
    ``noise.philox``; e.g. ``git show 08dc745:nemo_noise_plugin/noise/triton_kernel.py > FILE``)."""
    spec = importlib.util.spec_from_file_location("earlier_triton_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_counts(compiled) -> dict:
    """Static instruction counts of a compiled kernel's PTX, by opcode (``lg2``, ``sin``, ``cos``, ``sqrt`` are the
    special-function instructions; libdevice's ``logf`` shows as ``fma``/``setp``/``selp`` sequences)."""
    ptx = Counter(PTX_INSTRUCTION.findall(compiled.asm["ptx"]))
    return {"ptx_total": sum(ptx.values()), "ptx": dict(ptx.most_common(24))}


def bench(seq: int, batch: int, hidden: int, vocab: int, earlier=None, sweep: bool = False) -> dict:
    """Every method on one shape; microseconds per call."""
    device = torch.device("cuda")
    out_bytes = seq * batch * hidden * 2
    n_sets = max(3, math.ceil(1.0e9 / (2 * out_bytes)))  # >= 1 GB of outputs and copy sources: far beyond L2
    table = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16)
    ids = [torch.randint(0, vocab, (batch, seq), device=device) for _ in range(n_sets)]
    ids_t = [i.t().contiguous() for i in ids]
    sources = [torch.randn(seq, batch, hidden, device=device, dtype=torch.bfloat16) for _ in range(n_sets)]
    outs = [torch.empty_like(x) for x in sources]
    noise = {
        "seed": 1234,
        "iteration": 7,
        "sample_index": torch.arange(batch, device=device) + 1000,
        "token_position": torch.arange(seq, device=device),
        "noise_scale": neftune_scale(seq, batch, hidden, device),
    }

    def noise_off(i: int) -> torch.Tensor:
        return torch.nn.functional.embedding(ids[i], table).transpose(0, 1).contiguous()

    row = {
        "shape": [seq, batch, hidden, vocab],
        "output_bytes": out_bytes,
        "buffer_sets": n_sets,
        "copy": time_per_call(lambda i: lambda: outs[i].copy_(sources[i]), n_sets),
        "gather": time_per_call(lambda i: lambda: torch.nn.functional.embedding(ids_t[i], table), n_sets),
        "noise_off": time_per_call(lambda i: lambda: noise_off(i), n_sets),
    }
    for family in FAMILIES:
        row[f"two_step_{family}"] = time_per_call(
            lambda i, family=family: lambda: fused_add_noise(noise_off(i), distribution=family, **noise), n_sets
        )
        row[f"one_pass_{family}"] = time_per_call(
            lambda i, family=family: lambda: fused_gather_add_noise(table, ids[i], distribution=family, **noise),
            n_sets,
        )
    for family in FAST_MATH_FAMILIES:
        row[f"one_pass_{family}_fast_math"] = time_per_call(
            lambda i, family=family: lambda: one_pass(table, ids[i], family, noise, fast_math=True)[0], n_sets
        )
    if earlier is not None:
        row["same_bits_as_earlier"] = {}
        for family, fast in earlier_variants(earlier):
            name = variant_name(family, fast)
            row[f"earlier_one_pass_{name}"] = time_per_call(
                lambda i, family=family, fast=fast: lambda: one_pass(
                    table, ids[i], family, noise, fast_math=fast, launch=earlier.launch_add_noise
                )[0],
                n_sets,
            )
            ours = one_pass(table, ids[0], family, noise, fast_math=fast)[0]
            theirs = one_pass(table, ids[0], family, noise, fast_math=fast, launch=earlier.launch_add_noise)[0]
            row["same_bits_as_earlier"][name] = bool(torch.equal(ours, theirs))
    if sweep:
        row["sweep"] = {}
        for config in SWEEP_CONFIGS:
            for family, fast in (("uniform", False), ("gaussian", True), ("laplace", True), ("gaussian", False)):
                row["sweep"][f"{family}{'_fast_math' if fast else ''} {config}"] = time_per_call(
                    lambda i, family=family, fast=fast, config=config: lambda: one_pass(
                        table, ids[i], family, noise, fast_math=fast, config=config
                    )[0],
                    n_sets,
                )
    row["noise_off_again"] = time_per_call(lambda i: lambda: noise_off(i), n_sets)
    return row


def kernel_code(seq: int, batch: int, hidden: int, vocab: int) -> dict:
    """Each one-pass variant's instruction counts, and the fast-math outputs' largest difference from the exact
    kernel's (same counters), in units of the noise scale."""
    device = torch.device("cuda")
    table = torch.zeros(vocab, hidden, device=device, dtype=torch.float32)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    noise = {
        "seed": 1234,
        "iteration": 7,
        "sample_index": torch.arange(batch, device=device) + 1000,
        "token_position": torch.arange(seq, device=device),
        "noise_scale": torch.ones(seq, batch, device=device),
    }
    code = {}
    for family in FAMILIES:
        exact, compiled = one_pass(table, ids, family, noise)
        code[family] = code_counts(compiled)
        if family in FAST_MATH_FAMILIES:
            fast, compiled = one_pass(table, ids, family, noise, fast_math=True)
            code[f"{family}_fast_math"] = code_counts(compiled)
            code[f"{family}_fast_math"]["max_abs_difference"] = (fast - exact).abs().max().item()
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument(
        "--against",
        type=Path,
        help="an earlier noise/triton_kernel.py (holding launch_add_noise) to time and compare with",
    )
    parser.add_argument("--sweep", action="store_true", help="also time the one pass at other launch configurations")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import triton

    name = torch.cuda.get_device_name()
    results = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "alpha": ALPHA, "rows": {}}
    earlier = load_kernel_file(args.against) if args.against else None
    for label, shape in SHAPES.items():
        results["rows"][label] = bench(*shape, earlier=earlier, sweep=args.sweep)
        torch.cuda.empty_cache()
    results["kernel_code"] = kernel_code(*SHAPES["Llama-3.1-8B, s 4096, mb 2"])
    print(f"\n{name}, torch {torch.__version__}, triton {triton.__version__}; bf16 table; microseconds per call")
    print("(x) = ratio to noise_off (Megatron's noise-off embedding forward); [c] = ratio to the copy floor\n")
    for label, row in results["rows"].items():
        off = row["noise_off"]
        print(f"{label}  {tuple(row['shape'])}  {row['output_bytes'] / 1e6:.1f} MB out")
        print(
            f"  copy {row['copy']:.1f}  gather {row['gather']:.1f} [{row['gather'] / row['copy']:.2f}c]"
            f"  noise_off {off:.1f} [{off / row['copy']:.2f}c]"
            f"  noise_off_again {row['noise_off_again']:.1f} ({row['noise_off_again'] / off:.3f}x)"
        )
        for family in FAMILIES:
            one, two = row[f"one_pass_{family}"], row[f"two_step_{family}"]
            print(
                f"  {family:>8}: one pass {one:8.1f} ({one / off:.3f}x) [{one / row['copy']:.2f}c]"
                f"   two steps {two:8.1f} ({two / off:.3f}x) [{two / row['copy']:.2f}c]"
            )
        for family in FAST_MATH_FAMILIES:
            fast = row[f"one_pass_{family}_fast_math"]
            print(f"  {family:>8}, fast math: one pass {fast:8.1f} ({fast / off:.3f}x) [{fast / row['copy']:.2f}c]")
        for name, same in row.get("same_bits_as_earlier", {}).items():
            then = row[f"earlier_one_pass_{name}"]
            print(
                f"  {name:>18}, earlier kernel: one pass {then:8.1f} [{then / row['copy']:.2f}c];"
                f" this kernel / earlier {row[f'one_pass_{name}'] / then:.3f}x; same bits: {same}"
            )
        for variant, micros in row.get("sweep", {}).items():
            print(f"  sweep {variant}: {micros:8.1f} [{micros / row['copy']:.2f}c]")
    print("\ninstructions per one-pass kernel (8B shape's compile; fp32 table):")
    for variant, counts in results["kernel_code"].items():
        extra = f"; max |fast - exact| {counts['max_abs_difference']:.2e}" if "max_abs_difference" in counts else ""
        special = {op: counts["ptx"].get(op, 0) for op in ("lg2", "sqrt", "sin", "cos")}
        print(f"  {variant:>18}: PTX {counts['ptx_total']} instructions, special functions {special}{extra}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
