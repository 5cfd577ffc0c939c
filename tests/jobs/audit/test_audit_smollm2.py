"""The audit's task metric on the real SmolLM2-135M-Instruct: teacher-forced exact match agrees with transformers'
own greedy decoding, position by position."""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.slow  # about a minute: SmolLM2 on the CPU

EXAMPLES = 12


def _leading_matches(tokens: list[int], reference: list[int]) -> int:
    count = 0
    for token, expected in zip(tokens, reference, strict=False):
        if token != expected:
            break
        count += 1
    return count


def test_teacher_forced_answers_are_what_greedy_generation_produces(smollm2_hf_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_noise_plugin.jobs.audit.data import AUDIT_CHATS, answer_spans, padded
    from nemo_noise_plugin.jobs.audit.targets import hf_exact_match

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_hf_dir), dtype=torch.float32).eval()
    table = model.get_input_embeddings().weight.detach()
    sequences, spans = answer_spans(tokenizer)
    assert len(sequences) == AUDIT_CHATS == 80  # every audited validation chat splits at its answer
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generated_matches, forced_matches, exact = [], [], []
    for sequence, (start, end) in list(zip(sequences, spans, strict=True))[:EXAMPLES]:
        reference = sequence[start:end]
        assert reference[-1] == end_of_turn and tokenizer.decode(reference[:-1]).strip()
        with torch.no_grad():
            prompt = torch.tensor([sequence[:start]])
            generated = model.generate(prompt, max_new_tokens=len(reference), do_sample=False)[0, start:].tolist()
            predicted = model(torch.tensor([sequence])).logits.argmax(-1)[0, start - 1 : end - 1].tolist()
        generated_matches.append(_leading_matches(generated, reference))
        forced_matches.append(_leading_matches(predicted, reference))
        exact.append((generated[: len(reference)] == reference, forced_matches[-1] == len(reference)))
    assert forced_matches == generated_matches  # greedy follows the reference exactly as far as the argmax does
    assert max(generated_matches) > 0  # the comparison is not vacuous: some answers start right
    assert all(by_generation == by_argmax for by_generation, by_argmax in exact)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    ids, padding = padded(sequences[:EXAMPLES], pad_id)
    exact_match = hf_exact_match(model, table, ids, padding, spans[:EXAMPLES])
    by_generation = sum(by_gen for by_gen, _ in exact) / EXAMPLES
    assert exact_match(NoiseConfig(enabled=False)) == pytest.approx(by_generation)  # padding changes no answer
    assert exact_match(NoiseConfig(alpha=1e5)) == 0.0
