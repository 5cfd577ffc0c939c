"""Tasks that NeMo-Run executors run in the tests: each rank is a torchrun process (``RANK``/``WORLD_SIZE`` set).

Kept here rather than in a test module so the worker process imports only what the task needs.
"""

from __future__ import annotations

import os

import torch

NOISE_ITERATION = 3


def noisy_model_noise_under_tp(out_dir: str) -> None:
    """Build a ``NoisyGPTModel`` with TP = world size on gloo, write this rank's decoder-input noise to ``out_dir``.

    The embedding weights are zeroed, so the decoder input is exactly the noise; the test compares the ranks'
    tensors with each other and with the single-process noise.
    """
    from nemo_noise_plugin.jobs.cpu import destroy_cpu_parallel, init_cpu_parallel
    from nemo_noise_plugin.model import NoisyGPTModel
    from nemo_noise_plugin.noise.config import NoiseConfig
    from tests.support.models import build_tiny_gpt, tiny_gpt_config

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_cpu_parallel(
        rank=rank, world_size=world_size, port=int(os.environ["MASTER_PORT"]), tensor_model_parallel_size=world_size
    )
    try:
        model = build_tiny_gpt(
            tiny_gpt_config(tensor_model_parallel_size=world_size),
            model_class=NoisyGPTModel,
            noise_config=NoiseConfig(alpha=5.0, seed=99),
        )
        with torch.no_grad():
            model.embedding.word_embeddings.weight.zero_()
        model.noise_clock.start_iteration(NOISE_ITERATION)
        tokens, loss_mask, positions = noise_batch()
        with torch.no_grad(), model.noise_batch_inputs(loss_mask):
            noise = model._preprocess(input_ids=tokens, position_ids=positions)[0]
        torch.save({"rank": rank, "world_size": world_size, "noise": noise}, os.path.join(out_dir, f"rank{rank}.pt"))
        print(f"rank {rank}/{world_size}: noise {tuple(noise.shape)} written")
    finally:
        destroy_cpu_parallel()


def noise_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, a loss mask over true lengths 16/12/9/5, and positions: a 4 x 16 batch."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(8, 256, (4, 16), generator=generator)
    loss_mask = torch.zeros(4, 16)
    for row, length in enumerate((16, 12, 9, 5)):
        loss_mask[row, :length] = 1.0
    positions = torch.arange(16).unsqueeze(0).expand(4, -1).contiguous()
    return tokens, loss_mask, positions


def recipe_needing_the_hub():
    """A recipe that cannot be built on this machine, as Bridge's HF-based recipes cannot without the hub."""
    raise OSError("huggingface.co unreachable")
