"""A tiny instruction (SFT) run for tests: a tiny chat tokenizer (made in a second) and a tiny GPT recipe around it.

``write_chat_tokenizer``: a byte-level BPE trained on the shipped instruction set, with SmolLM2's special tokens
(``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2 as EOS and PAD) and a ChatML chat template, saved as an
ordinary HF folder that Bridge's ``HuggingFaceTokenizer`` and its finetuning data pipeline (chat template,
answer-only loss mask) read as they read SmolLM2's. ``tiny_chat_sft_config``: the SmolLM2 recipes' config
(``instruction_finetuning_config``) with a 2-layer GPT instead of the 135M model.
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

    from nemo_noise_plugin.data.instruction_set import instruction_examples

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


def tiny_chat_sft_config(run_dir: str | Path, tokenizer_dir: str | Path, *, train_iters: int = 4, **settings):
    """The instruction recipe's ``ConfigContainer`` around a 2-layer NEFTune GPT (alpha 5) and the tiny tokenizer."""
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.providers import NoisyGPTModelProvider
    from nemo_noise_plugin.recipes.common import local_spec_settings
    from nemo_noise_plugin.recipes.smollm2 import instruction_finetuning_config

    provider = NoisyGPTModelProvider(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB_SIZE,
        make_vocab_size_divisible_by=128,
        noise=NoiseConfig(alpha=5.0),
        **local_spec_settings(),
    )
    options = {
        **dict(seq_length=128, lr=1e-3, packed_sequence_size=None, global_batch_size=4, micro_batch_size=4),
        **settings,
    }
    return instruction_finetuning_config(
        provider, str(tokenizer_dir), run_dir=str(run_dir), train_iters=train_iters, **options
    )
