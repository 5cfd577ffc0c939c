"""How often the attacks recover a WHOLE noised prompt: the ceiling of exact match for exact-answer tasks (issue 25).

Every task of the shipped instruction set computes its answer from the question's words or digits, so a model under
noise can answer exactly only if the noised question still determines it. A decode-then-answer pipeline (decode each
noised prompt with the attack, then ask the clean model) gets exact match about P(whole question recovered) times
the clean model's exact match. The attacks are the frontier grid's (``benchmarks/noise_grid.py``): nearest
neighbour (L2) and the LM-prior beam (8 candidates, beam 4), on the same noise (the prompt's tokens, chat markers and
the answer clean, clip 3, the grid's levels), here on the pretrained SmolLM2-135M-Instruct table with the pretrained
model as the prior (the grid measured per-token recovery on its fine-tuned tables, equal across training variants
within 0.4 points). Per level: per-token recovery, and the fraction of chats whose user question (the tokens between
``<|im_start|>user\\n`` and ``<|im_end|>``) is recovered completely, overall and per task. CPU, a few minutes.

    python benchmarks/prompt_recovery_bound.py [--chats 48] [--levels gm_eps100,gm_eps50,gm_eps20,mdp_eta100,mdp_eta30]
        [--json benchmarks/results/noise_grid/prompt_recovery_bound.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.*, from a checkout

from benchmarks.noise_grid import ATTACK_CHATS, FRONTIER_LEVELS, level_config  # noqa: E402


def question_spans(tokenizer, examples):
    """Per chat: the prompt's ids (through the generation prompt) and the ``[start, end)`` span of the user's text."""
    rows = []
    for example in examples:
        messages = example["messages"][:-1]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        start_marker = tokenizer.convert_tokens_to_ids("<|im_start|>")
        end_marker = tokenizer.convert_tokens_to_ids("<|im_end|>")
        user = tokenizer("user\n", add_special_tokens=False)["input_ids"]
        starts = [i for i, t in enumerate(ids) if t == start_marker and ids[i + 1 : i + 1 + len(user)] == user]
        begin = starts[0] + 1 + len(user)
        end = ids.index(end_marker, begin)
        rows.append((ids, (begin, end), example.get("task", "all")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=ATTACK_CHATS)
    parser.add_argument("--levels", default=",".join(FRONTIER_LEVELS))
    parser.add_argument("--attacks", default="nn_l2,lm_beam", help="nn_l2 and/or lm_beam (the beam is slow on a CPU)")
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_noise_plugin.data.instruction_set import instruction_examples
    from nemo_noise_plugin.jobs.models.smollm2_folder import ensure_smollm2_hf
    from nemo_noise_plugin.privacy.audit import noised_embeddings
    from nemo_noise_plugin.privacy.audit.attacks import nearest_neighbour_attack
    from nemo_noise_plugin.privacy.audit.beam import lm_beam_attack

    torch.set_num_threads(2)
    folder = ensure_smollm2_hf()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        table = handle.get_tensor("model.embed_tokens.weight").float()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    rows = question_spans(tokenizer, instruction_examples("test")[: args.chats])
    width = max(len(ids) for ids, _, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    padding = torch.ones(len(rows), width, dtype=torch.bool)
    question = torch.zeros(len(rows), width, dtype=torch.bool)
    for row, (prompt, (begin, end), _) in enumerate(rows):
        ids[row, : len(prompt)] = torch.tensor(prompt)
        padding[row, : len(prompt)] = False
        question[row, begin:end] = True
    special = sorted(set(tokenizer.all_special_ids))

    def lm_log_probs(prefix: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=prefix).logits[:, -1].float().log_softmax(-1)

    report = {"chats": len(rows), "question_tokens": int(question.sum()), "attacks": args.attacks, "levels": {}}
    for level in args.levels.split(","):
        started = time.perf_counter()
        config = dataclasses.replace(level_config(level, inference=True), special_token_ids=special)
        loss_mask = torch.zeros(ids.shape)
        noised = noised_embeddings(table, ids, config, loss_mask=loss_mask, padding_mask=padding)
        got_noise = ((noised - table[ids]).abs().sum(-1) > 0) & ~padding
        attacks = args.attacks.split(",")
        guesses = {}
        if "nn_l2" in attacks:
            guesses["nn_l2"] = ids.clone()
            guesses["nn_l2"][got_noise] = nearest_neighbour_attack(noised[got_noise], table, "l2").ids.flatten()
        if "lm_beam" in attacks:
            guesses["lm_beam"] = lm_beam_attack(
                noised, table, config, lm_log_probs, loss_mask=loss_mask, padding_mask=padding
            )
        entry = {}
        for name, guess in guesses.items():
            correct = (guess == ids) | ~got_noise
            whole = [bool(correct[row][question[row]].all()) for row in range(len(rows))]
            by_task = defaultdict(list)
            for (_, _, task), hit in zip(rows, whole, strict=True):
                by_task[task].append(hit)
            entry[name] = {
                "token_recovery": float(correct[got_noise].float().mean()),
                "question_recovery": float(correct[question].float().mean()),
                "whole_question_recovered": sum(whole) / len(whole),
                "whole_question_by_task": {t: sum(h) / len(h) for t, h in sorted(by_task.items())},
            }
        entry["seconds"] = time.perf_counter() - started
        report["levels"][level] = entry
        parts = [
            f"{name}: per-token {100 * entry[name]['token_recovery']:5.1f} %, whole user question "
            f"{100 * entry[name]['whole_question_recovered']:5.1f} %"
            for name in guesses
        ]
        print(f"{level:11s} " + "; ".join(parts) + f" ({entry['seconds']:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
