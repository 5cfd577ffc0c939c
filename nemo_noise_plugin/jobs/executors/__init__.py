"""NeMo-Run executors for the finetune flow: the task and its launch, and the executors' settings.

``task`` (the task, its job directory, the launch and dry run) and ``settings`` (the executor factories,
``executor.KEY=VALUE`` settings and their checks).
"""
