"""Which modules of the served model a LoRA adapter can target, read from the model's config on the meta device.

``POST /v1/adapters`` checks ``lora.target_modules`` with these before anything is stored, so a
name the model does not have is a 400 at creation instead of a trainer that fails on the adapter's
first feedback. The module tree comes from the model's own class (transformers' ``AutoConfig`` and
``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``: no weights are read or
allocated), so it holds for any architecture, not a list written for Llama. A target matches as
peft matches it (``peft.tuners.tuners_utils.check_target_module_exists``): a module whose full
name equals it or ends with ``"." + target``, and only modules of a layer type peft's LoRA wraps.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence


def lora_targetable_modules(model_dir: str) -> frozenset[str]:
    """Full names of the modules of the model in ``model_dir`` that LoRA can wrap (linear, embedding, conv)."""
    return frozenset(module_shapes(model_dir))


def module_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """Module name -> (features in, features out) of every module LoRA can wrap in the model at ``model_dir``
    (an embedding: (vocabulary, width)). Built once per process (a replica warms it before traffic: the
    first build imports the model's code and holds the GIL for seconds, which stalled streams by 2 s)."""
    from pathlib import Path

    return _module_shapes(str(Path(model_dir).resolve()))


@functools.lru_cache(maxsize=8)
def _module_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # the module tree only: every parameter is a shape without storage
        model = AutoModelForCausalLM.from_config(config)
    # The layer types peft's LoRA dispatches to (peft/tuners/lora/layer.py: Linear, Embedding, Conv*, Conv1D).
    shapes: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        if isinstance(module, torch.nn.Linear):
            shapes[name] = (module.in_features, module.out_features)
        elif isinstance(module, torch.nn.Embedding):
            shapes[name] = (module.num_embeddings, module.embedding_dim)
        elif isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            shapes[name] = (module.in_channels, module.out_channels)
        elif isinstance(module, Conv1D):
            shapes[name] = (int(module.weight.shape[0]), int(module.weight.shape[1]))
    return shapes


def unknown_targets(targets: Sequence[str], modules: Iterable[str]) -> list[str]:
    """The entries of ``targets`` that match no module, by peft's rule (full name, or a ``.``-suffix of one)."""
    names = list(modules)
    return [t for t in targets if not any(m == t or m.endswith("." + t) for m in names)]


def short_names(modules: Iterable[str]) -> list[str]:
    """The distinct last components of module names (``q_proj``, ``lm_head``): what a client usually sends."""
    return sorted({m.rsplit(".", 1)[-1] for m in modules})
