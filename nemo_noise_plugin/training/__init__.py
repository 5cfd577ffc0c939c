"""Training with the plugin on Megatron-Bridge: the forward steps, and run configs in and out (overrides, YAML).

``forward_step`` (Bridge forward steps for noise and distillation) and ``overrides`` (Hydra overrides and YAML with
the plugin's settings validated): what a Bridge user passes to Bridge's own ``pretrain``/``finetune``. Running a
config (the launcher, the CPU loop, the main job) is the jobs wing's (``nemo_noise_plugin.jobs``).
"""
