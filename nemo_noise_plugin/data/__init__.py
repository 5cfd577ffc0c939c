"""The data the shipped recipes train on: the embedded corpus and the instruction set.

``corpus`` (the tiny recipes' byte-level corpus) and ``instruction_set`` (the SmolLM2 recipes' chat data through
Bridge's finetuning path). The SmolLM2 model itself is the jobs wing's to fetch and convert (``jobs.models``); the
recipes take its folder as ``hf_path``. The text files themselves (``corpus.txt``, ``instructions/*.jsonl``) sit beside
them as package data.
"""
