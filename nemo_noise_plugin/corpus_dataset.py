"""The embedded corpus as a Megatron indexed dataset, so Bridge's own GPT data pipeline can train on it.

Each non-empty line of the shipped corpus is one document of byte tokens (0-255) followed by the
end-of-document token 256, written with Megatron-Core's ``IndexedDatasetBuilder`` (``.bin``/``.idx``). Bridge's
``GPTDatasetConfig(data_path=...)`` with the null tokenizer (vocabulary 257, end-of-document 256) reads it.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from nemo_noise_plugin.corpus import corpus_bytes

CORPUS_VOCAB_SIZE = 257
"""Byte tokens plus the end-of-document token."""
END_OF_DOCUMENT = 256


def corpus_documents() -> list[list[int]]:
    """The shipped corpus split into lines, each as byte tokens plus the end-of-document token."""
    lines = [line.strip() for line in corpus_bytes().splitlines()]
    return [[*line, END_OF_DOCUMENT] for line in lines if line]


def build_corpus_dataset(directory: str | os.PathLike[str]) -> str:
    """Write the indexed dataset under ``directory`` (once per corpus content) and return its path prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    documents = corpus_documents()
    digest = hashlib.sha256(repr(documents).encode()).hexdigest()[:12]
    prefix = os.path.join(os.fspath(directory), f"corpus_bytes_{digest}")
    if os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx"):
        return prefix
    os.makedirs(os.fspath(directory), exist_ok=True)
    partial = prefix + f".partial{os.getpid()}"
    builder = IndexedDatasetBuilder(partial + ".bin", dtype=np.uint16)
    for document in documents:
        builder.add_document(torch.tensor(document, dtype=torch.int64), [len(document)])
    builder.finalize(partial + ".idx")
    for suffix in (".bin", ".idx"):  # atomic: a reader never sees a half-written dataset
        os.replace(partial + suffix, prefix + suffix)
    return prefix
