"""TRL's ``SFTTrainer`` as a runner of ``benchmarks/sft_throughput.py`` (the interface of ``benchmarks/sft_runners.py``:
``steps(n)`` returns each step's wall time, ``losses`` every step's loss), on the same rows as the other runners.
"""

from __future__ import annotations

import os
import queue
import threading
import time

from benchmarks.sft_runners import ADAM, CLIP_GRAD, Batches, hf_labels, sync


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
                sync(outer.device)
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
        sync(self.device)
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
