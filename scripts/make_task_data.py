"""Write the task families shipped with the package (gist: ``sentiment``; span: ``support``), fixed seeds.

    .venv/bin/python scripts/make_task_data.py                 # rewrites nemo_noise_plugin/data/tasks/<family>/
    .venv/bin/python scripts/make_task_data.py --out /tmp/out  # the same files into /tmp/out/<family>/
    .venv/bin/python scripts/make_task_data.py --word-tokens HF_DIR   # first rewrite sentiment/word_tokens.tsv

Deterministic: running it again gives the same bytes (with the pinned vadersentiment and faker). ``--word-tokens``
recounts each candidate word's tokens with the tokenizer in HF_DIR (SmolLM2-135M-Instruct:
``python scripts/fetch_smollm2.py``); the generator reads the shipped table, so it needs no tokenizer otherwise.
See docs/tasks.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nemo_noise_plugin.data.tasks import sentiment_reviews
from nemo_noise_plugin.data.tasks.generate import GENERATED_FAMILIES, write_family

OUT = Path(__file__).resolve().parent.parent / "nemo_noise_plugin" / "data" / "tasks"


def _write_word_tokens(hf_dir: Path) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    text = sentiment_reviews.word_token_table(
        sentiment_reviews.read_lexicon(), lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    )
    sentiment_reviews.word_tokens_path().write_text(text, encoding="utf-8", newline="\n")
    print(f"{len(text.splitlines())} words -> {sentiment_reviews.word_tokens_path()}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"parent folder of the family folders (default {OUT})")
    parser.add_argument("--family", choices=GENERATED_FAMILIES, action="append", help="only this family (repeatable)")
    parser.add_argument("--word-tokens", type=Path, metavar="HF_DIR", help="rewrite sentiment/word_tokens.tsv first")
    args = parser.parse_args(argv)
    if args.word_tokens is not None:
        _write_word_tokens(args.word_tokens)
    for family in args.family or GENERATED_FAMILIES:
        counts = write_family(family, args.out / family)
        print(
            f"{family}: " + ", ".join(f"{name} {count}" for name, count in counts.items()) + f" -> {args.out / family}"
        )


if __name__ == "__main__":
    main()
