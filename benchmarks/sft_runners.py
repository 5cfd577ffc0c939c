"""The SFT runners of ``benchmarks/sft_throughput.py``: the plugin through Bridge's loop and a plain loop (TRL's is
``benchmarks/sft_trl_runner.py``), with what they share.

The end of the module reads what a plugin runner built (``core_attention_of``, ``noise_path_of``) for the report.

Every runner trains on the same micro-batches (``Batches``: Megatron-style ``tokens``/``labels``/``loss_mask``/
``position_ids``, made once, on the host) in the same order, with AdamW (betas 0.9/0.999, eps 1e-8, no weight
decay), a constant learning rate, gradients clipped at 1.0 and bf16, and exposes the same interface:
``steps(n)`` runs n optimizer steps and returns each step's wall time (seconds, the interval between consecutive
step ends after a device sync, so data loading and the loop's own bookkeeping count), ``losses`` holds every step's
loss. ``HF_IGNORE`` rows of the HF runners: position ``t`` of ``labels`` is the target predicted from position
``t - 1`` (the HF convention), so the last target of a row (a pad in all but a micro-batch's longest row) is not
scored there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

HF_IGNORE = -100
ADAM = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
CLIP_GRAD = 1.0


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class Batches:
    """``micro`` micro-batches per step, the list long enough for every step any runner takes (Megatron format)."""

    micro_batches: list[dict[str, Any]]
    micro: int

    def step(self, index: int) -> list[dict[str, Any]]:
        """The micro-batches of step ``index`` (0-based; wraps around the list)."""
        start = (index * self.micro) % len(self.micro_batches)
        return self.micro_batches[start : start + self.micro]

    def tokens(self, index: int) -> tuple[int, int]:
        """(all tokens, answer tokens) of step ``index``: the padded batch and its loss-mask ones."""
        chunk = self.step(index)
        return sum(b["tokens"].numel() for b in chunk), int(sum(b["loss_mask"].sum() for b in chunk))


def hf_labels(batch: dict[str, Any]) -> torch.Tensor:
    """HF-convention labels of a Megatron micro-batch: ``labels[t - 1]`` at ``t`` where the loss mask is on."""
    out = torch.full_like(batch["tokens"], HF_IGNORE)
    keep = batch["loss_mask"][:, :-1] > 0
    out[:, 1:] = torch.where(keep, batch["labels"][:, :-1], torch.full_like(out[:, 1:], HF_IGNORE))
    return out


def synthetic_batches(count: int, size: int, seq: int, vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` micro-batches of random tokens over the whole sequence, every target scored (the 1B comparison)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        row = torch.randint(0, vocab, (size, seq + 1), generator=generator)
        batches.append(
            dict(
                tokens=row[:, :-1].contiguous(),
                labels=row[:, 1:].contiguous(),
                loss_mask=torch.ones(size, seq),
                position_ids=torch.arange(seq).unsqueeze(0).expand(size, -1).contiguous(),
                attention_mask=None,
            )
        )
    return batches


class Timed:
    """The timing shared by the runners: ``steps(n)`` calls ``_step(index)`` n times, timing step end to step end."""

    device = "cuda"

    def __init__(self, batches: Batches) -> None:
        self.batches, self.losses, self.done = batches, [], 0

    def _step(self, index: int) -> float:
        raise NotImplementedError

    def steps(self, count: int) -> list[float]:
        """Run ``count`` more steps; each one's wall time in seconds."""
        sync(self.device)
        mark, times = time.perf_counter(), []
        for _ in range(count):
            loss = self._step(self.done)
            sync(self.device)
            now = time.perf_counter()
            times.append(now - mark)
            mark = now
            self.losses.append(float(loss))
            self.done += 1
        return times


class PlainRunner(Timed):
    """The floor: a transformers model, torch AdamW, bf16 autocast, Megatron's loss (per-microbatch token means)."""

    def __init__(self, model: torch.nn.Module, batches: Batches, lr: float, device: str) -> None:
        super().__init__(batches)
        self.device, self.model = device, model.to(device).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        fused = device == "cuda"
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, fused=fused, **ADAM)
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def _step(self, index: int) -> torch.Tensor:
        chunk = self.batches.step(index)
        total = torch.zeros((), device=self.device)
        for batch in chunk:
            tokens = batch["tokens"].to(self.device, non_blocking=True)
            labels = batch["labels"].to(self.device, non_blocking=True)
            mask = batch["loss_mask"].to(self.device, non_blocking=True).float()
            with torch.autocast(self.device, dtype=self.dtype, enabled=self.device == "cuda"):
                logits = self.model(input_ids=tokens).logits
            losses = torch.nn.functional.cross_entropy(
                logits.float().view(-1, logits.shape[-1]), labels.view(-1), reduction="none"
            )
            loss = (losses * mask.view(-1)).sum() / mask.sum().clamp(min=1) / len(chunk)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP_GRAD)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def full_iteration_graph_holders() -> tuple[dict, dict, dict]:
    """Megatron's process-wide full-iteration graph state, keyed by stage: the graphs, their output tensors and the
    step counts that decide the capture (``FullCudaGraphWrapper``'s class attributes)."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper as Wrapper

    return Wrapper.cuda_graph, Wrapper.result, Wrapper.curr_iteration


class PluginGpuRunner:
    """The plugin's recipe in Bridge's loop (``BridgeRun``: Bridge's ``setup``, ``train`` re-entered), its train
    iterator the shared micro-batches (wrapped in Megatron's ``RerunDataIterator``, as Bridge's own are)."""

    device = "cuda"

    def __init__(self, name: str, total_steps: int, model_and_step: Callable, config_for: Callable, batches: Batches):
        import itertools

        from megatron.core.rerun_state_machine import RerunDataIterator

        from benchmarks.distillation_step import BridgeRun
        from nemo_noise_plugin.training.noise_step_publisher import PublishNoiseStep
        from nemo_noise_plugin.upstream.bridge_imports import import_bridge

        self.run = BridgeRun(name, total_steps, model_and_step, config_for)
        iterator = RerunDataIterator(itertools.cycle(batches.micro_batches))
        self.run.setup = self.run.setup._replace(train_data_iterator=iterator)
        self.ends: list[float] = []
        ends = self.ends
        base = import_bridge("megatron.bridge.training.callbacks").Callback

        class EndMarker(base):
            def on_train_step_end(self, context) -> None:
                torch.cuda.synchronize()
                ends.append(time.perf_counter())

        self.graph_state = (None, None, 0)  # no graph yet, no outputs, no step taken
        runner = self

        class StepGraphKeeper(base):
            """Keeps this runner's full-iteration graph: Megatron holds one per process in class attributes (the
            graph, its output tensors, the step count that decides the capture) and Bridge's ``train()`` deletes
            the graph on return, so each re-entered loop puts its own runner's state back (``steps``): two graph
            runners (noise on and off) interleave in one process, each replaying the graph it captured."""

            def on_train_step_end(self, context) -> None:
                runner.graph_state = tuple(holder["training"] for holder in full_iteration_graph_holders())

        self.run.callbacks.add([PublishNoiseStep(), EndMarker(), StepGraphKeeper()])  # publisher: as the launchers

    @property
    def losses(self) -> list[float]:
        return self.run.losses

    @property
    def step_graph(self):
        """This runner's captured full-iteration graph, or None (an eager runner, or one not captured yet)."""
        return self.graph_state[0]

    def steps(self, count: int) -> list[float]:
        """Run ``count`` more steps of Bridge's loop; each step's wall time (step end to step end) in seconds."""
        torch.cuda.synchronize()
        self.ends.clear()
        for holder, value in zip(full_iteration_graph_holders(), self.graph_state, strict=True):
            holder["training"] = value  # this runner's graph or none yet (an eager runner never reads them)
        mark = time.perf_counter()
        self.run.steps(count)
        marks = [mark, *self.ends]
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]


class PluginCpuRunner(Timed):
    """The plugin's model and forward step on the CPU, as the plugin's CPU loop drives them (Bridge's loop needs
    CUDA): the recipe's provider built in float32, ``noise_forward_step``, torch AdamW and the recipe's clipping."""

    device = "cpu"

    def __init__(self, config: Any, forward_step: Callable, batches: Batches, lr: float) -> None:
        from nemo_noise_plugin.jobs.cpu import causal_attention_mask, init_cpu_parallel
        from nemo_noise_plugin.upstream.bridge_imports import import_bridge

        super().__init__(batches)
        init_cpu_parallel(seed=config.rng.seed)
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.state = import_bridge("megatron.bridge.training.state").GlobalState()
        self.state.cfg = config
        config.dataset.skip_getting_attention_mask_from_dataset = False  # the CPU needs the explicit causal mask
        provider = config.model
        provider.bf16, provider.params_dtype, provider.pipeline_dtype = False, torch.float32, torch.float32
        provider.finalize()
        provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.model = provider.provide_distributed_model(
            use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
        )[0]
        self.forward_step, self.mask = forward_step, causal_attention_mask(provider.seq_length)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, **ADAM)

    def _step(self, index: int) -> torch.Tensor:
        chunk, total = self.batches.step(index), torch.zeros(())
        for batch in chunk:
            width = batch["tokens"].shape[-1]
            batch = dict(batch, attention_mask=self.mask[..., :width, :width])
            output, loss_function = self.forward_step(self.state, iter([batch]), self.model)
            loss_sum, num_tokens, _ = loss_function(output)
            loss = loss_sum / num_tokens / len(chunk)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP_GRAD)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def model_chunks(runner) -> list[torch.nn.Module]:
    """The models a runner trains, as a list: a plugin runner's chunks (its own model on the CPU, its Bridge run's on
    a GPU), the plain runner's transformers model, [] for TRL's (its trainer holds the model)."""
    model = getattr(runner, "model", None) or getattr(getattr(runner, "run", None), "model", None)
    return model if isinstance(model, list) else [model] if model is not None else []


def core_attention_of(runner) -> list[str]:
    """The classes of the attention modules a plugin runner's model really holds (what was built, not what was
    asked for: Bridge's ``provide`` resets a local spec's core attention); [] for the HF runners."""
    chunks = model_chunks(runner)
    names = {type(m).__name__ for chunk in chunks for m in chunk.modules() if type(m).__name__.endswith("Attention")}
    return sorted(name for name in names if "DotProduct" in name)


def noise_path_of(runner) -> str | None:
    """Where a plugin runner's model adds its noise: "lookup" (one pass, ``model/noised_lookup.py``) or "output:
    <why not the lookup>"; None for the HF runners and noise-off models."""
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.model.noised_lookup import lookup_fusion_blocker

    chunks = model_chunks(runner)
    for chunk in chunks:
        inner = unwrap_model(chunk)
        if getattr(inner, "noise_config", None) is not None and inner.noise_active:
            blocker = lookup_fusion_blocker(inner)
            return "lookup" if blocker is None else f"output: {blocker}"
    return None
