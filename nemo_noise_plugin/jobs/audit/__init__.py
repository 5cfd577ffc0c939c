"""The privacy audit's run machinery, ``nemo noise audit``: settings, data, run folder, targets, report.

Reading order: ``settings`` (the command's ``key=value`` arguments checked), ``run_folder`` (a training run folder's
export and noise, for ``run=``), ``data`` (what is audited: named sources and JSONL files), ``spans`` (a
``tokens='spans'`` run: its private spans and canaries), ``targets`` (the models attacked: the tiny GPT, SmolLM2
from the HF folder it is given), ``report`` (the sweep run and written). The attacks and the sweep themselves are
the library's (``privacy.audit``); the audit during training is a report callback (``jobs.reports.audit_callback``).
"""
