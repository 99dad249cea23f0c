"""HF Llama as DeepSpeed pipeline layers, and a stage's slice of it to and from HF-named tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from actors.learning.full.layout import LlamaDims, layer_compute_weights, layer_names

TIED_KEY = "embed"
EMBED = "model.embed_tokens.weight"


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _hf_config(config: dict):
    from transformers import LlamaConfig

    # An explicit causal mask is passed to every decoder layer, so either kernel sees the same thing.
    return LlamaConfig(
        **{k: v for k, v in config.items() if k not in ("architectures", "transformers_version")},
        attn_implementation="sdpa",
    )


class _HFLayer(nn.Module):
    """A pipeline layer that knows the HF names of its parameters (``local name -> HF name``)."""

    def hf_names(self) -> dict[str, str]:
        raise NotImplementedError


class EmbedPipe(_HFLayer):
    """Token ids [B, T] -> hidden states [B, T, H]; with tied embeddings also the head (``tied_head``)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def hf_names(self) -> dict[str, str]:
        return {"embed_tokens.weight": EMBED}


def tied_head(module: EmbedPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The head of a tied model: the embedding matrix as the output projection (HF's lm_head = embed_tokens)."""
    return F.linear(hidden, module.embed_tokens.weight)


class DecoderPipe(_HFLayer):
    """One HF decoder layer. transformers 5 layers take the rotary (cos, sin) from the model, which a stage
    does not have, so each layer computes them itself from the sequence length (positions 0..T-1: rows are
    right-padded, so a real token never sees a pad and needs no attention mask beyond the causal one)."""

    def __init__(self, config: dict, index: int) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        cfg = _hf_config(config)
        self.index = index
        self.layer = LlamaDecoderLayer(cfg, layer_idx=index)
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[1]
        positions = torch.arange(t, device=hidden.device).unsqueeze(0)
        cos_sin = self.rotary(hidden, positions)
        mask = torch.full((t, t), torch.finfo(hidden.dtype).min, device=hidden.device, dtype=hidden.dtype).triu(1)
        out = self.layer(hidden, attention_mask=mask[None, None], position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def hf_names(self) -> dict[str, str]:
        return {n: f"model.layers.{self.index}.{n[len('layer.') :]}" for n, _ in self.named_parameters()}


class NormPipe(_HFLayer):
    def __init__(self, config: dict) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(config["hidden_size"], eps=config.get("rms_norm_eps", 1e-6))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    def hf_names(self) -> dict[str, str]:
        return {"norm.weight": "model.norm.weight"}


class HeadPipe(_HFLayer):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def hf_names(self) -> dict[str, str]:
        return {"lm_head.weight": "lm_head.weight"}


def pipeline_module(config: dict, stages: int, partition_method: str, loss_fn, **kwargs):
    """DeepSpeed's ``PipelineModule`` of the model; ``partition_method`` is DeepSpeed's (``uniform``,
    ``parameters``, ``type:<regex>``) or ``compute``: balanced by each layer's multiply-adds per token
    (``layout.layer_compute_weights``)."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime import utils as ds_utils

    # Overrides DeepSpeed's private partitioning step (the names it uses are checked in compat/).
    class ComputeBalanced(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            if method != "compute":
                return super()._partition_layers(method)
            weights = layer_compute_weights(LlamaDims.from_config(config))
            self.parts = ds_utils.partition_balanced(weights=weights, num_parts=self.num_stages)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return ComputeBalanced(
        layers=layer_specs(config), num_stages=stages, partition_method=partition_method, loss_fn=loss_fn, **kwargs
    )


def chunk_bounds(config: dict, start: int, stop: int, chunks: int) -> list[tuple[int, int]]:
    """Split a stage's layers [start, stop) into ``chunks`` runs of about equal compute, as local [a, b)."""
    from deepspeed.runtime import utils as ds_utils

    weights = layer_compute_weights(LlamaDims.from_config(config))[start:stop]
    if chunks < 1 or chunks > sum(1 for w in weights if w > 0):
        raise ValueError(f"a stage of {stop - start} layers cannot run as {chunks} chunks")
    if chunks == 1:
        return [(0, stop - start)]
    parts = ds_utils.partition_balanced(weights=weights, num_parts=chunks)
    return list(zip(parts, parts[1:]))


def layer_specs(config: dict) -> list:
    """The DeepSpeed layer specs of the model: embedding, decoder layers, final norm, head.

    ``tie_word_embeddings`` (SmolLM2): the embedding and the head are one ``TiedLayerSpec`` key, so
    DeepSpeed builds the module on the first and the last stage, broadcasts its weight at start and
    all-reduces its gradient between those two stages every step; the head applies it with
    ``tied_head``. The version keeps it once, under ``model.embed_tokens.weight`` (as HF saves it).
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    dims = LlamaDims.from_config(config)
    if dims.tie_word_embeddings:
        first = TiedLayerSpec(TIED_KEY, EmbedPipe, config, tied_weight_attr="embed_tokens.weight")
        last = TiedLayerSpec(TIED_KEY, EmbedPipe, config, forward_fn=tied_head, tied_weight_attr="embed_tokens.weight")
    else:
        first, last = LayerSpec(EmbedPipe, config), LayerSpec(HeadPipe, config)
    specs = [
        first,
        *(LayerSpec(DecoderPipe, config, i) for i in range(dims.num_hidden_layers)),
        LayerSpec(NormPipe, config),
        last,
    ]
    assert len(specs) == len(layer_names(dims))
    return specs


def local_layers(pipe) -> list[tuple[int, _HFLayer, bool]]:
    """This stage's layers as (global index, module, owns its weights): a tied module is owned by the layer
    that first uses it (the embedding), so the tensor is written once."""
    from deepspeed.pipe import TiedLayerSpec

    from compat import pipeline_layer_specs, pipeline_local_bounds

    specs = pipeline_layer_specs(pipe)
    out = []
    for idx in range(*pipeline_local_bounds(pipe)):
        spec = specs[idx]
        if isinstance(spec, TiedLayerSpec):
            first = next(i for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec) and s.key == spec.key)
            out.append((idx, pipe.tied_modules[spec.key], idx == first))
        else:
            out.append((idx, getattr(pipe, str(idx)), True))
    return out


def state_slice(pipe) -> dict[str, torch.Tensor]:
    """The HF-named float tensors of the weights this stage owns (CPU copies)."""
    out: dict[str, torch.Tensor] = {}
    for _, module, owned in local_layers(pipe):
        if not owned:
            continue
        params = dict(module.named_parameters())
        for local, hf in module.hf_names().items():
            out[hf] = params[local].detach().to("cpu", copy=True).contiguous()
    return out


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [model_dir / "model.safetensors"]


def load_slice(pipe, model_dir: str | Path) -> int:
    """Copy this stage's weights (tied copies too) from an HF checkpoint directory; the tensors loaded."""
    from safetensors import safe_open

    wanted: dict[str, torch.Tensor] = {}
    for _, module, _ in local_layers(pipe):
        params = dict(module.named_parameters())
        for local, hf in module.hf_names().items():
            wanted[hf] = params[local]
    found = 0
    with torch.no_grad():
        for path in _weight_files(Path(model_dir)):
            with safe_open(str(path), framework="pt") as f:
                for name in set(f.keys()) & set(wanted):
                    wanted[name].copy_(f.get_tensor(name))
                    found += 1
    missing = len(wanted) - found
    if missing:
        raise ValueError(f"{model_dir}: {missing} of this stage's {len(wanted)} tensors are not in the checkpoint")
    return found


def load_tensors(pipe, tensors: dict[str, torch.Tensor]) -> int:
    """Copy HF-named ``tensors`` into this stage's layers (a weight sync): every tensor the stage holds must be there."""
    n = 0
    with torch.no_grad():
        for _, module, _ in local_layers(pipe):
            params = dict(module.named_parameters())
            for local, hf in module.hf_names().items():
                if hf not in tensors:
                    raise ValueError(f"weight sync lacks {hf}")
                params[local].copy_(tensors[hf])
                n += 1
    return n
