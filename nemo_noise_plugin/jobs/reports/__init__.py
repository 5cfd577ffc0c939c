"""The reports a run writes, and what they stand on: output folders, provenance, the audit during training.

``robustness`` (loss and KL under noise, before and after training), ``task_report`` (held-out exact match, the HF
export and the privacy frontier of the instruction recipes), ``audit_callback`` (the privacy audit of the
embedding table during training; ``nemo noise audit`` itself is ``jobs.audit``), ``provenance`` (what a run was),
``artifacts`` (folders written all at once), ``callbacks`` (the report callbacks a recipe names, built for a run).
"""
