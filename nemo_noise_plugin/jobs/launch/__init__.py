"""Launching a run: the launcher (Bridge's loop or the CPU loop) and the finetune flow of ``nemo llm finetune``.

``launcher`` (``launch``: overrides, forward step, entry, GPU or CPU loop), ``finetune`` (recipe + YAML + overrides,
then a dry run, a YAML export or training with the report callbacks the recipe names), ``bridge_console`` (Bridge's
console output in the run folder's ``bridge.log``), ``warm_start`` (weights handed from one run to the next).
"""
