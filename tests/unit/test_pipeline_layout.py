"""The pure pipeline layout (actors/learning/full/layout.py): layer order, parameter counts, partition checks."""

from __future__ import annotations

import pytest

from actors.learning.full.layout import LlamaDims, check_bounds, layer_names, layer_param_counts

# SmolLM2-135M's config.json fields that shape the model (tied embeddings, grouped-query attention).
SMOLLM2 = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}


def test_layers_are_embedding_decoders_norm_head():
    dims = LlamaDims.from_config({**SMOLLM2, "num_hidden_layers": 2})
    assert layer_names(dims) == ["embed", "decoder.0", "decoder.1", "norm", "head"]


def total_params(dims: LlamaDims) -> int:
    """The HF model's parameter count from the stages' counts (a tied head shares the embedding's)."""
    counts = layer_param_counts(dims)
    return sum(counts) - (counts[-1] if dims.tie_word_embeddings else 0)


def test_parameter_counts_match_smollm2_135m():
    dims = LlamaDims.from_config(SMOLLM2)
    assert dims.head_dim == 64
    assert total_params(dims) == 134_515_008  # the published parameter count of SmolLM2-135M
    counts = layer_param_counts(dims)
    assert counts[0] == counts[-1] == 49152 * 576  # the tied head is counted on the stage that carries it


def test_untied_head_is_its_own_parameters():
    dims = LlamaDims.from_config({**SMOLLM2, "tie_word_embeddings": False})
    assert total_params(dims) == 134_515_008 + 49152 * 576


@pytest.mark.parametrize("bounds", [[0, 3], [1, 3, 7], [0, 3, 3, 7], [0, 3, 6]])
def test_a_partition_must_cover_all_layers_with_no_empty_stage(bounds):
    with pytest.raises(ValueError):
        check_bounds(bounds, 7, 2 if len(bounds) != 4 else 3)
    check_bounds([0, 3, 7], 7, 2)
