"""Full-weight sync into a running vLLM engine: a worker extension that loads a published version, and a fingerprint.

vLLM runs :class:`FullWeightsExtension` inside its worker process (``--worker-extension-cls``,
set for every replica by ``actors.serving.engine_args.engine_flags``; vLLM adds it to the worker class's
bases at start-up, so it costs nothing until a method is called). ``ModelReplica`` reaches the
methods through ``AsyncLLM.collective_rpc``, which runs them on every worker of the engine
between two engine steps, never during one.

A full version is the directory ``<root>/<unit>/v<N>/`` holding ``model.safetensors`` (the whole
state dict under Hugging Face Llama names) and ``meta.json``; the trainer side writes it, this
module only reads it. Transport:

- one host: the worker reads the directory itself; safetensors maps the file, so the bytes come
  from the page cache the writer just filled, with no copy through Ray or the engine's sockets;
- several hosts: the replica first turns the published location into a local directory through
  the same path adapter versions take (``actors.learning.versions.files.AdapterFiles.local_path``: the
  feedback store actor's ``read_version`` through Ray's object store, or the
  ``storage.adapters_uri`` URI through ``pyarrow.fs``, kept in the node's ``data_dir`` cache),
  and the worker reads that copy. See ``ModelReplica.load_full_version``. Not working yet:
  ``actors/learning/versions/layout.py`` checks a version for the adapter files only, so that route refuses
  a full version (``model.safetensors`` + ``meta.json``) until it learns the second layout.

Kept import-light (the standard library at import; torch, safetensors and vLLM inside the
methods, where the worker has them loaded already): the module is imported in every engine.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXTENSION = "actors.serving.engine_weights.FullWeightsExtension"  # the value of vLLM's --worker-extension-cls
WEIGHTS_FILE = "model.safetensors"
META_FILE = "meta.json"
LOAD_METHOD = "coserve_load_full_weights"
FINGERPRINT_METHOD = "coserve_weights_fingerprint"
SAMPLE_ELEMENTS = 4096  # elements hashed per plain parameter: enough to see any real update, cheap on 100M+ params
_VERSION_DIR = re.compile(r"^v(\d+)$")


@dataclass(frozen=True)
class FullVersionLoad:
    """What ``ModelReplica.load_full_version`` did: the version now served and what the swap cost."""

    node_id: int
    version: int
    path: str  # the published location asked for
    local_path: str  # the directory the engine read
    previous_version: int | None  # the full version served before (None: the weights the engine started with)
    tensors: int  # checkpoint tensors read, summed over the engine's workers
    bytes: int
    load_s: float  # the slowest worker's load (inside the engine, engine steps stopped)
    total_s: float  # the whole call: pause (with the cache reset), load, resume
    fingerprint: str  # of the live weights after the load (see :func:`combine_fingerprints`)
    meta: dict[str, Any] = field(default_factory=dict)  # the version's meta.json


def version_of(path: str) -> tuple[str, int]:
    """``(unit, N)`` of a full version's location ``.../<unit>/v<N>`` (a path or a URI)."""
    parts = path.rstrip("/").split("/")
    m = _VERSION_DIR.match(parts[-1]) if len(parts) >= 2 else None
    if m is None or not parts[-2]:
        raise ValueError(f"{path!r} is not a version location <root>/<unit>/v<N>")
    return parts[-2], int(m.group(1))


def combine_fingerprints(per_worker: list[dict[str, Any]]) -> str:
    """One fingerprint for the engine from its workers' (each covers only its own shard or stages)."""
    h = hashlib.sha256()
    for part in sorted(per_worker, key=lambda p: p["rank"]):
        h.update(f"{part['rank']}:{part['digest']};".encode())
    return h.hexdigest()[:16]


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The version's meta.json; ``{}`` when there is none (a hand-made checkpoint still loads)."""
    try:
        return json.loads((Path(directory) / META_FILE).read_text())
    except FileNotFoundError:
        return {}


def _checkpoint_tensors(path: Path, dtype: Any = None) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        # Sorted names keep each layer's tensors together, so vLLM's layerwise reload finishes
        # (and frees the buffers of) one layer before the next starts.
        for name in sorted(f.keys()):
            tensor = f.get_tensor(name)
            # Cast here what the loaders would cast anyway (a float32 checkpoint into a bf16
            # engine): vLLM's loader otherwise logs a warning per tensor on every sync.
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            yield name, tensor


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors file, from its header only (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def shape_mismatch(new: dict[str, tuple[int, ...]], reference: dict[str, tuple[int, ...]]) -> str | None:
    """Why a checkpoint with tensors ``new`` cannot replace one with ``reference``; None if it can."""
    missing, extra = sorted(set(reference) - set(new)), sorted(set(new) - set(reference))
    if missing or extra:
        return f"tensor names differ: missing {missing[:5]}, unexpected {extra[:5]}"
    wrong = [f"{n} {new[n]} != {reference[n]}" for n in sorted(new) if new[n] != reference[n]]
    return f"shapes differ: {wrong[:5]}" if wrong else None


class FullWeightsExtension:
    """Methods vLLM mixes into its worker; ``self`` is the worker (``self.model_runner``, ``self.rank``)."""

    def coserve_load_full_weights(self, directory: str) -> dict[str, Any]:
        """Load ``directory/model.safetensors`` into the running model; returns counts and seconds.

        Goes through the worker's ``reload_weights`` (vLLM's in-place reload), which feeds the
        tensors to the model's own ``load_weights``: Hugging Face names are mapped and stacked
        (q/k/v into qkv_proj), tensor-parallel workers take their shard and pipeline stages only
        their layers. The plain ``model.load_weights`` is not enough on its own: on the CPU
        backend vLLM packs each linear layer's weight for oneDNN after loading and frees the
        parameter, so the reload restores the layer, loads it and packs it again, one layer at a
        time. It also drops the LoRA adapters the worker holds (their layers cache base shapes);
        vLLM loads an adapter again on its next request. vLLM logs "RotaryEmbedding: Failed to
        load weights" on every reload: the rotary table is a buffer no checkpoint holds, and it is
        kept as it was, which is right.
        """
        path = Path(directory) / WEIGHTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no full checkpoint there")
        t0 = time.perf_counter()
        # A half-done reload leaves layers unloaded, so a checkpoint that cannot load whole is
        # refused before anything changes: same names and shapes as the one the engine started from.
        start = Path(self.model_config.model) / WEIGHTS_FILE
        if start.is_file():
            why = shape_mismatch(checkpoint_shapes(path), checkpoint_shapes(start))
            if why:
                raise ValueError(f"{path} does not fit the served model: {why}")
        counted = {"tensors": 0, "bytes": path.stat().st_size}  # bytes: of the file, whatever the engine's dtype

        # A quantized model's checkpoint holds scales and packed ints: those keep their own dtypes.
        dtype = self.model_config.dtype if self.model_config.quantization is None else None

        def counting() -> Iterator[tuple[str, Any]]:
            for name, tensor in _checkpoint_tensors(path, dtype):
                counted["tensors"] += 1
                yield name, tensor

        self.reload_weights(weights_iterator=counting(), is_checkpoint_format=True)
        return {"rank": self.rank, **counted, "seconds": time.perf_counter() - t0}

    def coserve_weights_fingerprint(self) -> dict[str, Any]:
        """A digest of the weights this worker computes with now (milliseconds, no engine step).

        Linear layers are probed (their live kernel applied to a fixed input), because on the CPU
        backend their packed weights are not parameters any more; every other parameter
        (embeddings, norms, the LM head) is hashed from an evenly strided sample of its elements.
        """
        import torch
        from vllm.model_executor.layers.linear import LinearBase

        model = self.model_runner.get_model()
        dtype = self.model_config.dtype
        device = next(model.parameters()).device
        h = hashlib.sha256()
        probed: set[str] = set()
        layers = 0
        with torch.inference_mode():
            for name, module in model.named_modules():
                if not isinstance(module, LinearBase) or module.quant_method is None:
                    continue
                size = module.input_size_per_partition
                x = torch.linspace(-1.0, 1.0, size, dtype=torch.float32).to(dtype=dtype, device=device)
                y = module.quant_method.apply(module, x.unsqueeze(0))
                h.update(name.encode())
                h.update(y.float().cpu().numpy().tobytes())
                probed.update(f"{name}.{p}" for p, _ in module.named_parameters(recurse=False))
                layers += 1
            for name, param in model.named_parameters():
                if name in probed or param.numel() == 0:
                    continue
                flat = param.detach().reshape(-1)
                sample = flat[:: max(1, flat.numel() // SAMPLE_ELEMENTS)][:SAMPLE_ELEMENTS]
                h.update(name.encode())
                h.update(sample.float().cpu().numpy().tobytes())
        return {"rank": self.rank, "digest": h.hexdigest(), "linear_layers": layers}
