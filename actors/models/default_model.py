"""Resolves the model a config serves, and builds the embedded test model (a tiny random Llama).

:func:`model_dir` is the one place that turns ``model.path`` / ``model.embedded`` into a directory:
a user's own checkpoint, the real instruct model (:mod:`actors.models.smollm2`, the default), or the
tiny test model built here. The tiny model exists because no model hub is reachable from the
machines this runs on and the test suite needs a model that loads in seconds: a Llama-architecture config with
head_dim 64 (vLLM's CPU attention kernels
reject 16), weights from a fixed seed, and a tokenizer whose vocabulary is the 256 bytes plus
three special tokens, so no training corpus is needed. Its outputs are gibberish but real: the
engine, LoRA, sampling and training paths all run exactly as they would on a real checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from settings import AppConfig

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# A plain role-tagged template; vLLM's chat endpoint needs one and HF checkpoints carry theirs.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of an embedded model; the offline jobs build several sizes from this."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    seed: int = 0

    @property
    def name(self) -> str:
        return f"tiny-llama-h{self.hidden_size}-l{self.num_layers}-s{self.seed}"


DEFAULT_SPEC = TinyLlamaSpec()


def _byte_vocab() -> dict[str, int]:
    """Token id = byte value for the 256 bytes (as ByteLevel characters), then the specials."""
    from tokenizers.pre_tokenizers import ByteLevel

    chars = _bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    if set(vocab) != set(ByteLevel.alphabet()):
        raise RuntimeError("tokenizers' ByteLevel alphabet is not the GPT-2 byte table")
    for i, tok in enumerate((BOS, EOS, PAD)):
        vocab[tok] = 256 + i
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the ByteLevel convention)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer():
    """A byte-level fast tokenizer: every byte is one token, decoding is exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = _byte_vocab()
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build(target: Path, spec: TinyLlamaSpec = DEFAULT_SPEC) -> Path:
    """Write the model and tokenizer to ``target`` atomically; return ``target``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if config.head_dim != 64:
        raise ValueError(f"head_dim must be 64 for vLLM's CPU kernels, got {config.head_dim}")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "embedded_spec.json").write_text(json.dumps(asdict(spec), indent=2))
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def model_path(cfg: AppConfig) -> str:
    """Where ``model_dir`` puts the model on this host, without fetching or building it."""
    if cfg.model.path:
        return cfg.model.path
    if cfg.model.embedded == "tiny-llama":
        return str(Path(cfg.data_path) / "models" / DEFAULT_SPEC.name)
    from actors.models import smollm2

    return str(Path(cfg.data_path) / "models" / smollm2.NAME)


def model_dir(cfg: AppConfig) -> str:
    """The directory of the model ``cfg`` serves, fetching or building an embedded one on first use."""
    if cfg.model.path:
        return cfg.model.path
    if cfg.model.embedded == "tiny-llama":
        return str(ensure(cfg.data_path))
    from actors.models import smollm2

    return str(smollm2.ensure(cfg.data_path))


def ensure(data_dir: Path, spec: TinyLlamaSpec = DEFAULT_SPEC) -> Path:
    """Return the directory of the embedded model ``spec``, building it on first use."""
    target = Path(data_dir).expanduser() / "models" / spec.name
    if (target / "embedded_spec.json").exists():
        return target
    return build(target, spec)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("COSERVE_DATA_DIR", "~/.cache/coserve"))
    parser.add_argument("--hidden-size", type=int, default=DEFAULT_SPEC.hidden_size)
    parser.add_argument("--layers", type=int, default=DEFAULT_SPEC.num_layers)
    parser.add_argument("--seed", type=int, default=DEFAULT_SPEC.seed)
    a = parser.parse_args()
    spec = TinyLlamaSpec(hidden_size=a.hidden_size, num_layers=a.layers, num_heads=a.hidden_size // 64, seed=a.seed)
    print(ensure(Path(a.data_dir), spec))
