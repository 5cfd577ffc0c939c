"""The reports a run writes, and what they stand on: output folders, provenance, the audit targets.

``robustness`` (loss and KL under noise, before and after training), ``task_report`` (held-out exact match, the HF
export and the privacy frontier of the instruction recipes), ``audit_targets`` (the models ``nemo noise audit``
attacks), ``provenance`` (what a run was), ``artifacts`` (folders written all at once), ``callbacks`` (the report
callbacks a recipe names, built for a run).
"""
