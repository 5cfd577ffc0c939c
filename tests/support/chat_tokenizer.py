"""A tiny Hugging Face chat tokenizer for CPU tests of the instruction (SFT) path, made in a second.

A byte-level BPE trained on the shipped instruction set, with SmolLM2's special tokens (``<|endoftext|>`` 0,
``<|im_start|>`` 1, ``<|im_end|>`` 2 as EOS and PAD) and a ChatML chat template, saved as an ordinary HF folder
that Bridge's ``HuggingFaceTokenizer`` and its finetuning data pipeline (chat template, answer-only loss mask) read
as they read SmolLM2's. Tests use it with a tiny GPT instead of the 135M model.
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 384
"""Size of the trained vocabulary (a tiny model's ``vocab_size`` must be at least this)."""


def write_chat_tokenizer(folder: str | Path) -> Path:
    """Train the tokenizer on the shipped instruction texts and save it as an HF folder; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from nemo_noise_plugin.instructions import instruction_examples

    examples = instruction_examples("training") + instruction_examples("validation")
    texts = [message["content"] for example in examples for message in example["messages"]]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts + ["system", "user", "assistant"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    folder = Path(folder)
    fast.save_pretrained(folder)
    return folder
