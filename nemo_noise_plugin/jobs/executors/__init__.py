"""NeMo-Run executors for the finetune flow: one table of executors, their checks, the task and its launch.

``kinds`` (``EXECUTORS``: name -> NeMo-Run class, factory, checks, job directory, dry-run text; ``kind_of``),
``factories`` (the ``run.Config`` factories), ``checks`` (the plugin's checks), ``describe`` (dry-run text),
``settings`` (``executor.KEY=VALUE`` settings, ``check_executor``) and ``task`` (the task, its launch and dry run).
"""
