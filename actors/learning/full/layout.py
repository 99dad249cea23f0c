"""Pure description of a Llama model as pipeline layers: their names and parameter counts (no torch, no IO)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaDims:
    """The shape fields of a Llama ``config.json`` that decide the pipeline layers and their sizes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: dict) -> LlamaDims:
        """From a parsed ``config.json`` (head_dim and key/value heads default as HF's LlamaConfig does)."""
        heads = int(config["num_attention_heads"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )


def layer_names(dims: LlamaDims) -> list[str]:
    """The pipeline's layers in order: ``embed``, ``decoder.<i>`` per HF decoder layer, ``norm``, ``head``.

    With tied embeddings ``head`` is the same module as ``embed`` (a DeepSpeed ``TiedLayerSpec``).
    """
    return ["embed", *(f"decoder.{i}" for i in range(dims.num_hidden_layers)), "norm", "head"]


def decoder_params(dims: LlamaDims) -> int:
    """Trainable parameters of one decoder layer: q/k/v/o projections, gated MLP, two RMSNorms (no biases)."""
    h, kv = dims.hidden_size, dims.num_key_value_heads * dims.head_dim
    attention = h * dims.num_attention_heads * dims.head_dim * 2 + h * kv * 2
    return attention + 3 * h * dims.intermediate_size + 2 * h


def layer_param_counts(dims: LlamaDims) -> list[int]:
    """Trainable parameters per pipeline layer, as DeepSpeed's ``partition_method: parameters`` counts them.

    The tied head is counted again (DeepSpeed builds the tied module on the stage that uses it as
    the head, too), so the last stage is not handed extra decoder layers for a head it does carry.
    """
    embed = dims.vocab_size * dims.hidden_size
    return [embed, *([decoder_params(dims)] * dims.num_hidden_layers), dims.hidden_size, embed]


def layer_compute_weights(dims: LlamaDims) -> list[int]:
    """Multiply-adds per token of each pipeline layer (``partition_method: compute``): the embedding is a
    lookup and the norm is elementwise (0), a decoder layer its weights, the head vocab × hidden. The
    head of a 49k-token vocabulary costs as much as several decoder layers, so a split by parameters
    or by layer count leaves the last stage the slowest, and the first idle behind it."""
    return [0, *([decoder_params(dims)] * dims.num_hidden_layers), 0, dims.vocab_size * dims.hidden_size]


def check_bounds(bounds: list[int], n_layers: int, stages: int) -> None:
    """Raise unless ``bounds`` (DeepSpeed's ``parts``) split ``n_layers`` into ``stages`` contiguous non-empty slices."""
    if len(bounds) != stages + 1 or bounds[0] != 0 or bounds[-1] != n_layers:
        raise ValueError(f"partition {bounds} does not cover {n_layers} layers in {stages} stages")
    if any(b >= e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"partition {bounds} leaves a stage without layers")
