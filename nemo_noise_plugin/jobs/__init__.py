"""The jobs wing: what runs the library, and nothing a Bridge or Megatron user needs to import.

- ``launch``: the launcher (Bridge's GPU loop or the CPU loop), the finetune flow of ``nemo llm finetune``, Bridge's
  console output, the weight hand-over between runs;
- ``main_job``: the main job's orchestration (clean pre-training, control run, noise training, reports);
- ``cpu``: the CPU loop, its checkpoints, the CPU substitutes and gloo process groups;
- ``reports``: the robustness and task reports, the audit targets, provenance, output folders;
- ``executors``: NeMo-Run executors and their settings;
- ``progress`` (the per-step line and the non-finite-loss stop) and ``batches`` (the recipe's data as Bridge's loop
  has it), used by all of them.

The library (``noise``, ``model``, ``schedule_plan``, ``distillation``, ``privacy``, ``providers``, ``recipes``,
``training``, ``data``) never imports this wing; ``scripts/check_import_floors.py`` fails when it does.
"""
