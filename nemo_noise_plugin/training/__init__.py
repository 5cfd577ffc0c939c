"""Training with the plugin on Megatron-Bridge: forward steps, overrides and YAML, the launcher and the loops.

``forward_step`` (Bridge forward steps for noise and distillation), ``overrides`` (Hydra overrides and YAML with
the plugin's settings validated), ``launch`` (Bridge's GPU loop or the CPU loop), ``cpu_loop``, ``progress`` (the
per-step progress line), ``finetune`` (the flow behind ``nemo llm finetune``).
"""
