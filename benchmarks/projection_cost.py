"""What nearest-row projection costs: one ``[tokens x vocabulary]`` distance pass over an embedding table.

Times ``noise.projection.nearest_rows`` on ``--tokens`` noised rows of a table: SmolLM2-135M-Instruct's
``model.embed_tokens.weight`` (49152 x 576) from a ``model.safetensors`` file, or a random table of that shape.
Prints one JSON line: wall time (median and spread of ``--repeats`` timed calls after one warm-up), the median
process CPU time (all threads; on a shared machine the wall time also holds the waits), and the recovery.

    python benchmarks/projection_cost.py --table "$(python scripts/fetch_smollm2.py)/model.safetensors"
    python benchmarks/projection_cost.py --device cuda --tokens 65536
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nemo_noise_plugin.noise.projection import DEFAULT_MAX_ELEMENTS, nearest_rows


def _table(path: str | None) -> torch.Tensor:
    if path is None:
        return torch.randn(49152, 576, generator=torch.Generator().manual_seed(0)) * 0.1
    from safetensors.torch import load_file

    return load_file(path)["model.embed_tokens.weight"].float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default=None, help="a model.safetensors (default: a random 49152 x 576 table)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--metric", choices=("l2", "cosine"), default="l2")
    parser.add_argument("--noise-std", type=float, default=0.05, help="per-coordinate Gaussian noise std")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-elements", type=int, default=DEFAULT_MAX_ELEMENTS)
    args = parser.parse_args()

    table = _table(args.table).to(args.device)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, table.size(0), (args.tokens,), generator=generator).to(args.device)
    noise = torch.randn(args.tokens, table.size(1), generator=generator).to(args.device) * args.noise_std
    queries = table[ids] + noise

    def timed() -> tuple[float, torch.Tensor]:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        found = nearest_rows(queries, table, metric=args.metric, max_elements=args.max_elements)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start, time.process_time() - cpu_start, found

    timed()  # warm-up
    seconds, cpu_seconds, found = zip(*(timed() for _ in range(args.repeats)), strict=True)
    print(
        json.dumps(
            {
                "table": list(table.shape),
                "tokens": args.tokens,
                "metric": args.metric,
                "device": args.device,
                "threads": torch.get_num_threads(),
                "median_s": round(statistics.median(seconds), 4),
                "min_s": round(min(seconds), 4),
                "max_s": round(max(seconds), 4),
                "median_cpu_s": round(statistics.median(cpu_seconds), 4),
                "recovery": round(float((found[0] == ids).float().mean()), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
