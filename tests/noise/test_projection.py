"""Nearest-row projection (``NoiseConfig.projection='nearest_row'``): the search, the lookup and the noise hook.

The search is checked against a brute-force ``cdist`` argmin and against the audit's own nearest-neighbour attack;
the hook on the real Megatron-Core GPT model (CPU, gloo) must output exact table rows for the noised tokens, leave
the clean tokens as they were, and send each projected token's gradient to its chosen row only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.projection import (
    NO_ROW,
    lookup_rows,
    nearest_rows,
    project_noised,
    projection_recovery,
)
from nemo_noise_plugin.privacy.audit.attacks import direction_attack, nearest_neighbour_attack
from nemo_noise_plugin.privacy.audit.noised import noised_embeddings, noised_tokens
from nemo_noise_plugin.privacy.ledger import privacy_ledger
from nemo_noise_plugin.privacy.ledger_format import format_ledger
from nemo_noise_plugin.validation import SettingError

VOCAB, HIDDEN, SEQ, BATCH = 256, 64, 16, 4
CLIP = 2.0


def random_table(seed: int = 0) -> torch.Tensor:
    """``[VOCAB, HIDDEN]`` rows of norm about 2.4: a clip at 2.0 shortens most of them."""
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.3


def token_batch() -> dict[str, torch.Tensor]:
    """Token ids with a special token at every fifth position and a loss mask over each row's second half."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(8, VOCAB, (BATCH, SEQ), generator=generator)
    tokens[:, ::5] = 7
    loss_mask = torch.zeros(BATCH, SEQ)
    loss_mask[:, SEQ // 2 - 1 :] = 1.0
    return {"tokens": tokens, "loss_mask": loss_mask, "position_ids": torch.arange(SEQ).expand(BATCH, -1)}


PRIVATE = NoiseConfig(
    mechanism="gaussian_mechanism",
    clip_norm=CLIP,
    epsilon=40.0,
    tokens="response",
    special_token_ids=[7],
    projection="nearest_row",
    seed=5,
)
"""About half of the noised tokens land nearest their own row at this level (measured: 0.47)."""


def test_chunked_search_equals_brute_force_argmin():
    table, queries = random_table(), torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(2)) * 0.4
    expected = torch.cdist(queries.double(), table.double()).argmin(dim=1)
    whole = nearest_rows(queries, table)
    chunked = nearest_rows(queries, table, max_elements=1000)  # 15 rows x 66 queries per block
    assert torch.equal(whole, expected)
    assert torch.equal(chunked, whole)


def test_cosine_search_equals_brute_force_argmax_in_chunks():
    table, queries = random_table(), torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(3))
    similarity = (
        torch.nn.functional.normalize(queries.double(), dim=1)
        @ torch.nn.functional.normalize(table.double(), dim=1).t()
    )
    assert torch.equal(nearest_rows(queries, table, metric="cosine", max_elements=700), similarity.argmax(dim=1))


def test_a_token_with_zero_noise_projects_to_itself_with_every_metric_and_clip():
    table = random_table()
    ids = torch.arange(VOCAB)
    clipped = table * (CLIP / table.norm(dim=1, keepdim=True)).clamp_max(1.0)
    assert torch.equal(nearest_rows(table, table), ids)
    assert torch.equal(nearest_rows(table, table, metric="cosine"), ids)
    assert torch.equal(nearest_rows(clipped, table, clip_norm=CLIP), ids)


def test_l2_and_cosine_pick_the_rows_their_definitions_give_on_a_constructed_table():
    # Query (1, 0.2): row 0 (1, 0) is 0.2 away but 11 degrees off; row 1 (5, 1) points exactly its way, 4.1 away.
    table = torch.tensor([[1.0, 0.0], [5.0, 1.0], [0.0, 1.0]])
    query = torch.tensor([[1.0, 0.2]])
    assert nearest_rows(query, table, metric="l2").tolist() == [0]
    assert nearest_rows(query, table, metric="cosine").tolist() == [1]


def test_clipped_l2_search_compares_with_the_rows_as_the_mechanism_clips_them():
    # Row 0 (10, 0) clips to (1, 0): the noise-free release of token 0; unclipped, row 1 (1.2, 0.1) is nearer.
    table = torch.tensor([[10.0, 0.0], [1.2, 0.1]])
    release = torch.tensor([[1.0, 0.0]])
    assert nearest_rows(release, table).tolist() == [1]
    assert nearest_rows(release, table, clip_norm=1.0).tolist() == [0]


def test_equal_distances_go_to_the_smallest_id_whatever_the_chunking():
    table = random_table()
    table[200] = table[10]
    table[130] = table[10]
    query = table[10:11] + 1e-3
    for max_elements in (HIDDEN, 64 * HIDDEN, 2**26):  # one row per block, 64 rows, the whole table
        assert nearest_rows(query, table, max_elements=max_elements).tolist() == [10]


def test_lookup_rows_gives_zeros_for_no_row_and_gradients_to_the_rows_looked_up():
    table = random_table().requires_grad_()
    ids = torch.tensor([[3, NO_ROW], [3, 9]])
    rows = lookup_rows(ids, table)
    assert torch.equal(rows[0, 0], table[3].detach()) and torch.equal(rows[1, 1], table[9].detach())
    assert torch.equal(rows[0, 1], torch.zeros(HIDDEN))
    weights = torch.randn(2, 2, HIDDEN, generator=torch.Generator().manual_seed(4))
    (rows * weights).sum().backward()
    expected = torch.zeros(VOCAB, HIDDEN)
    expected[3] = weights[0, 0] + weights[1, 0]
    expected[9] = weights[1, 1]
    assert torch.equal(table.grad, expected)


def test_projection_recovery_equals_the_audits_nearest_neighbour_attacks():
    """Own-id fraction of the projection = the audit's recovery (unclipped: nn_l2; clipped: the direction attack)."""
    table, batch = random_table(), token_batch()
    for config, attack in (
        (NoiseConfig(mechanism="gaussian", sigma=0.5, scaling="absolute", projection="nearest_row"), None),
        (PRIVATE, CLIP),
    ):
        noised = noised_embeddings(table, batch["tokens"], config, loss_mask=batch["loss_mask"])
        selected = noised_tokens(config, batch["tokens"], loss_mask=batch["loss_mask"])
        projection = project_noised(
            noised.transpose(0, 1), selected.t(), torch.nn.Embedding.from_pretrained(table), config
        )
        if attack is None:
            guesses = nearest_neighbour_attack(noised[selected], table, "l2").ids
        else:
            guesses = direction_attack(noised[selected], table, attack).ids
        assert torch.equal(projection.ids.t()[selected], guesses)
        recovery = projection_recovery(projection.ids, batch["tokens"])
        assert recovery == pytest.approx(float((guesses == batch["tokens"][selected]).float().mean()))
        assert 0.2 < recovery < 0.95  # a level where projection both recovers and misses tokens


def _noisy_model(config: NoiseConfig, table: torch.Tensor):
    from nemo_noise_plugin.model import NoisyGPTModel
    from tests.support.models import build_tiny_gpt

    model = build_tiny_gpt(vocab_size=VOCAB, model_class=NoisyGPTModel, noise_config=config)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.copy_(table)
    model.noise_clock.start_iteration(3)
    return model


def _decoder_input(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with model.noise_batch_inputs(batch["loss_mask"]):
        return model._preprocess(input_ids=batch["tokens"], position_ids=batch["position_ids"])[0]


def test_noisy_model_outputs_exact_table_rows_for_noised_tokens_and_leaves_clean_ones(megatron_cpu):
    table, batch = random_table(), token_batch()
    model = _noisy_model(PRIVATE, table)
    projected = _decoder_input(model, batch)
    ids = model.projected_ids
    noised = _decoder_input(_noisy_model(dataclasses.replace(PRIVATE, projection="none"), table), batch)
    selected = noised_tokens(PRIVATE, batch["tokens"], loss_mask=batch["loss_mask"]).t()
    assert 0 < int(selected.sum()) < selected.numel()
    assert torch.equal(ids != NO_ROW, selected)
    assert torch.equal(projected[selected], table[ids[selected]])  # bit for bit
    assert torch.equal(projected[~selected], table[batch["tokens"].t()][~selected])  # the clean lookup
    assert torch.equal(projected[~selected], noised[~selected])
    assert not torch.equal(projected[selected], noised[selected])


def test_projected_tokens_send_their_gradient_to_the_chosen_row_not_to_their_own(megatron_cpu):
    table, batch = random_table(), token_batch()
    model = _noisy_model(PRIVATE, table)
    model.train()
    decoder_input = _decoder_input(model, batch)
    weights = torch.randn(decoder_input.shape, generator=torch.Generator().manual_seed(6))
    (decoder_input * weights).sum().backward()
    ids = model.projected_ids
    taken = torch.where(ids != NO_ROW, ids, batch["tokens"].t())  # projected row, or the clean token's own row
    expected = torch.zeros(VOCAB, HIDDEN).index_add_(0, taken.reshape(-1), weights.reshape(-1, HIDDEN))
    assert bool((ids != batch["tokens"].t())[ids != NO_ROW].any()), "some token must be projected elsewhere"
    torch.testing.assert_close(model.embedding.word_embeddings.weight.grad, expected, rtol=1e-6, atol=1e-6)


def test_projection_settings_are_validated_with_the_setting_named():
    with pytest.raises(SettingError, match=r"NoiseConfig\.projection.*'nearest'.*none, nearest_row"):
        NoiseConfig(projection="nearest")
    with pytest.raises(SettingError, match=r"NoiseConfig\.projection_metric.*'l1'.*l2, cosine"):
        NoiseConfig(projection="nearest_row", projection_metric="l1")


@pytest.mark.parametrize(
    "preset",
    [
        dict(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=8.0),
        dict(mechanism="metric_dp", eta=100.0, clip_norm=1.0),
        dict(mechanism="laplace", laplace_scale=0.5, clip_norm=1.0),
    ],
    ids=lambda preset: preset["mechanism"],
)
def test_projection_leaves_the_ledgers_numbers_unchanged_and_says_it_is_post_processing(preset):
    plain = privacy_ledger(NoiseConfig(**preset), sequence_length=512, epochs=3, hidden_size=576)
    projected = privacy_ledger(
        NoiseConfig(**preset, projection="nearest_row"), sequence_length=512, epochs=3, hidden_size=576
    )
    assert projected.per_token == plain.per_token and projected.per_token
    assert projected.per_sequence == plain.per_sequence and projected.per_sequence[0].epsilon is not None
    added = [line for line in projected.assumptions if line not in plain.assumptions]
    assert len(added) == 1 and "post-processing" in added[0] and "unchanged" in added[0]
    assert "post-processing" in format_ledger(projected) and "post-processing" not in format_ledger(plain)
