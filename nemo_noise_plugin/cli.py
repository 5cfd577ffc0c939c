"""Entry point of the ``noise`` command group of NeMo-Run's ``nemo`` command line.

Registered under the ``nemo_run.cli`` entry-point group in ``pyproject.toml``; ``nemo`` imports this module to
build the group, so importing it must stay cheap and must not need Transformer Engine, a GPU or Megatron-Bridge.
The group's commands (``nemo noise ...`` and ``nemo llm finetune`` with the plugin's recipes) are registered here
as they are built; until then the group is empty and ``nemo --help`` lists it.
"""
