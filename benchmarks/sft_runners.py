"""The three SFT runners of ``benchmarks/sft_throughput.py``: the plugin through Bridge's loop, TRL, a plain loop.

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

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

HF_IGNORE = -100
ADAM = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
CLIP_GRAD = 1.0


def _sync(device: str) -> None:
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
        _sync(self.device)
        mark, times = time.perf_counter(), []
        for _ in range(count):
            loss = self._step(self.done)
            _sync(self.device)
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


class TrlRunner:
    """TRL's ``SFTTrainer.train()`` in a worker thread, let through ``n`` optimizer steps at a time by a callback.

    The trainer's own loop does the work (its dataloader over the shared rows, in order; its loss over the global
    batch's answer tokens; NEFTune through ``neftune_noise_alpha``); the callback only records each step's end
    (after a device sync) and the loss ``training_step`` returned, and waits at a step end until it is let on.
    """

    def __init__(self, model, tokenizer, batches: Batches, total_steps: int, lr: float, alpha: float | None, device):
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import SFTConfig, SFTTrainer

        self.device, self.losses, self.batches = device, [], batches
        rows = []
        for index in range(total_steps):
            for batch in batches.step(index):
                labels = hf_labels(batch)
                rows += [
                    dict(input_ids=t.tolist(), labels=y.tolist()) for t, y in zip(batch["tokens"], labels, strict=True)
                ]
        self._gate: queue.Queue[int | None] = queue.Queue()
        self._ends: queue.Queue[tuple[float, float] | BaseException] = queue.Queue()
        outer, pending = self, []

        class Trainer(SFTTrainer):
            def training_step(self, *args, **kwargs):
                loss = super().training_step(*args, **kwargs)
                pending.append(loss)
                return loss

        class Gate(TrainerCallback):
            def __init__(self) -> None:
                self.left = 0

            def on_step_end(self, args, state, control, **kwargs):
                _sync(outer.device)
                self._report(time.perf_counter(), float(sum(pending)))
                pending.clear()
                while self.left == 0:
                    got = outer._gate.get()
                    if got is None:
                        control.should_training_stop = True
                        return control
                    self.left = got
                return control

            def _report(self, at: float, loss: float) -> None:
                self.left -= 1
                outer._ends.put((at, loss))

        config = SFTConfig(
            output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "sft_throughput_trl"),
            per_device_train_batch_size=batches.micro_batches[0]["tokens"].shape[0],
            gradient_accumulation_steps=batches.micro,
            max_steps=total_steps,
            learning_rate=lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=ADAM["weight_decay"],
            adam_beta1=ADAM["betas"][0],
            adam_beta2=ADAM["betas"][1],
            adam_epsilon=ADAM["eps"],
            max_grad_norm=CLIP_GRAD,
            optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",
            bf16=device == "cuda",
            use_cpu=device != "cuda",
            gradient_checkpointing=False,  # SFTConfig's default is True; no other runner recomputes
            neftune_noise_alpha=alpha,
            train_sampling_strategy="sequential",
            dataset_kwargs={"skip_prepare_dataset": True},
            max_length=None,
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=1234,
        )
        # Megatron's process group (world size 1) and RANK/LOCAL_RANK would make accelerate wrap the model in DDP.
        saved = {name: os.environ.pop(name) for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE") if name in os.environ}
        try:
            self.gate = Gate()
            self.trainer = Trainer(
                model=model,
                args=config,
                train_dataset=Dataset.from_list(rows),
                processing_class=tokenizer,
                callbacks=[self.gate],
            )
        finally:
            os.environ.update(saved)
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        try:
            self.trainer.train()
        except BaseException as error:  # handed to the caller's thread
            self._ends.put(error)

    def steps(self, count: int) -> list[float]:
        """Let the trainer run ``count`` more steps; each step's wall time in seconds."""
        if count == 0:
            return []
        _sync(self.device)
        mark, times = time.perf_counter(), []
        if self._thread is None:
            self.gate.left = count
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        else:
            self._gate.put(count)
        for _ in range(count):
            got = self._ends.get()
            if isinstance(got, BaseException):
                raise RuntimeError("TRL's trainer stopped") from got
            at, loss = got
            times.append(at - mark)
            mark = at
            self.losses.append(loss)
        return times

    def close(self) -> None:
        """Let the trainer's loop finish (it stops at the next step end)."""
        if self._thread is not None:
            self._gate.put(None)
            self._thread.join(timeout=60)


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
