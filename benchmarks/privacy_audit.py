"""Privacy-audit throughput: nearest-neighbour attacks on N noised tokens against a [V, h] table (default 49152 x 576).

Usage (CPU or GPU; the table is random, the SmolLM2 shape; ``--table smollm2`` reads the real one on a machine that
has it)::

    python benchmarks/privacy_audit.py --tokens 20000 --device cpu
    python benchmarks/privacy_audit.py --tokens 100000 --device cuda --dtypes float32,bfloat16

Prints one line per (dtype, attack): seconds, tokens/s, recovery, and peak memory (CUDA: max allocated; CPU: the
process's peak RSS, ``ru_maxrss``, which includes the table and the noised queries).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.audit import nearest_neighbour_attack, noised_embeddings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--table", default="random", choices=("random", "smollm2"))
    parser.add_argument("--vocab-chunk", type=int, default=4096)
    parser.add_argument("--query-chunk", type=int, default=1024)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.table == "smollm2":
        from safetensors import safe_open

        from nemo_noise_plugin.jobs.models.smollm2_folder import ensure_smollm2_hf

        with safe_open(str(ensure_smollm2_hf() / "model.safetensors"), framework="pt") as handle:
            base = handle.get_tensor("model.embed_tokens.weight").float()
    else:
        base = 0.05 * torch.randn(args.vocab, args.hidden, generator=torch.Generator().manual_seed(0))
    seq = 500
    tokens = torch.randint(0, base.size(0), (args.tokens // seq, seq), generator=torch.Generator().manual_seed(1))
    config = NoiseConfig(alpha=5.0)  # NEFTune alpha 5, true length 500
    print(
        f"table {list(base.shape)} ({args.table}), {tokens.numel()} tokens, device {device}, "
        f"chunks vocab {args.vocab_chunk} x query {args.query_chunk}, torch {torch.__version__}"
    )
    for dtype_name in args.dtypes.split(","):
        table = base.to(device=device, dtype=getattr(torch, dtype_name))
        start = time.perf_counter()
        padding = torch.zeros_like(tokens, dtype=torch.bool)
        noised = noised_embeddings(table, tokens, config, padding_mask=padding).reshape(-1, table.size(1))
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"{dtype_name:>9} noised inputs      {time.perf_counter() - start:7.2f} s")
        for metric in ("l2", "cosine"):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            ids = nearest_neighbour_attack(
                noised, table, metric, vocab_chunk=args.vocab_chunk, query_chunk=args.query_chunk
            ).ids
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            rate = float((ids.cpu() == tokens.reshape(-1)).float().mean())
            memory = (
                f"peak CUDA allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB"
                if device.type == "cuda"
                else f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
            )
            print(
                f"{dtype_name:>9} nn_{metric:<7} {seconds:7.2f} s  {tokens.numel() / seconds:10.0f} tokens/s  "
                f"recovery {100 * rate:.2f}%  {memory}"
            )


if __name__ == "__main__":
    main()
