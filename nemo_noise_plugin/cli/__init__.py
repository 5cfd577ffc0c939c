"""The command lines, each a thin parser over one function in ``jobs/`` or ``privacy/``.

- ``main_job``: ``python -m nemo_noise_plugin`` (the main job on the embedded default);
- ``nemo_llm``: ``nemo llm finetune`` (NeMo-Run's ``nemo`` command, entry point ``llm``), and ``finetune``, its
  ``python -m nemo_noise_plugin.cli.finetune`` form for torchrun;
- ``nemo_noise``: ``nemo noise ...``, the plugin's own tools (``nemo noise ledger``).
"""
