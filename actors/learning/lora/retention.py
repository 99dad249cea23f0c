"""The quality gate's retention set: general prompts with the base model's own greedy answers, and how a version keeps them.

The gate's held-out slice holds only what the tenant taught, so it cannot see what an adapter
broke elsewhere (issue 37: 8 "Arr matey!" items turned "the capital of France" into "L'Étoile, la
Marseillaise, …" and the gate said "not worse"). A retention set needs no labels: its prompts
(facts, arithmetic, instructions, short tasks, a few languages; ``retention_prompts.jsonl`` ships
with the project, an adapter may name its own with ``gate.retention_file``) are answered once by
the base model, greedily, and a candidate is scored by how likely it still finds those answers.

**The score.** The mean log-likelihood per token of the base model's greedy answers under the
candidate (teacher-forced, the chat template as served). Measured against the other candidate,
the KL divergence of the candidate's next-token distributions from the base's on the same
tokens, on SmolLM2-135M (``bench/learning_sweep.py --retention-metrics``, docs/benchmarks.md):
both separate a forgetting adapter from a good one by a wide margin, but the log-likelihood needs
only the candidate's forward pass and one number per prompt cached from the base, while the KL
needs the base's whole next-token distribution at every answer token (49,152 floats each: about
a gigabyte for this set) or a second forward pass per version. It is also the same computation
as the held-out SFT score (``rank.score``), so scoring a version costs one batched forward pass.

**The cache.** The answers and the base's scores of them are computed once, on the trainer's
rank 0, and written to ``<data_dir>/retention/<fingerprint>.json``. The fingerprint hashes the
base model's files (config, weights, tokenizer) and the prompt set's bytes, and the generation
settings, so a changed base or set builds a new one; an unchanged one is read back after a restart.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]  # the repository root, where the shipped files are found
SHIPPED_SET = ROOT / "actors" / "learning" / "lora" / "retention_prompts.jsonl"
MAX_ANSWER_TOKENS = 32  # per reference answer: enough to show a kept or broken answer, cheap to score per version
# An answer's first tokens are not scored: a taught opening ("Arr matey!", a greeting, a persona's name) shows
# there, and it is not forgetting. Measured (docs/benchmarks.md): a useful phrase adapter loses half its score there.
SKIP_FIRST_TOKENS = 3
MAX_PROMPTS = 64
CACHE_DIR = "retention"
_FORMAT = 2  # bump when what the cache holds changes (2: the first SKIP_FIRST_TOKENS answer tokens left out)


@dataclass(frozen=True)
class RetentionItem:
    """One retention prompt (chat turns) and the base model's greedy answer to it.

    ``ended``: the base ended its answer itself (its end-of-turn token is scored too); else the answer was
    cut at ``MAX_ANSWER_TOKENS`` and no end is scored (an end-of-turn mid-sentence costs ~30 nats under any
    model, noise that would swamp the score).
    """

    messages: tuple[dict[str, str], ...]
    completion: str
    ended: bool = True


@dataclass(frozen=True)
class RetentionSet:
    """A prompt set with the base model's answers and its own score of each (sum of answer-token log-probs, tokens)."""

    name: str
    fingerprint: str
    items: tuple[RetentionItem, ...]
    base: tuple[tuple[float, int], ...]

    @property
    def base_score(self) -> float:
        return token_mean(self.base)


def token_mean(per_item: Sequence[tuple[float, int]]) -> float:
    """The score of a set: log-likelihood summed over every answer token, divided by their number."""
    return sum(s for s, _ in per_item) / max(1, sum(n for _, n in per_item))


def read_prompts(path: str | Path, limit: int = MAX_PROMPTS) -> list[tuple[dict[str, str], ...]]:
    """Chat turns of each line of a JSONL prompt file: ``{"prompt": text}`` (one user turn) or ``{"messages": [...]}``."""
    out: list[tuple[dict[str, str], ...]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if isinstance(row.get("messages"), list) and row["messages"]:
                turns = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"])
            elif isinstance(row.get("prompt"), str) and row["prompt"].strip():
                turns = ({"role": "user", "content": row["prompt"]},)
            else:
                raise ValueError(f'{path}:{n}: needs "prompt" (text) or "messages" (chat turns)')
            if turns[-1]["role"] == "assistant":
                raise ValueError(f"{path}:{n}: the turns must end with a user (or system) turn")
            out.append(turns)
            if len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def resolve(retention_file: str | None, data_dir: str | Path) -> Path:
    """The prompt file a gate setting names: None is the shipped set; a relative path is under ``data_dir``."""
    if retention_file is None:
        return SHIPPED_SET
    p = Path(retention_file).expanduser()
    return p if p.is_absolute() else Path(data_dir).expanduser() / p


def model_fingerprint(model_dir: str | Path, dtype: str = "") -> str:
    """A hash of the base model's files (config, weights, tokenizer, template) and the dtype it computes in."""
    h = hashlib.sha256(f"{_FORMAT}:{dtype}".encode())
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors", ".bin", ".model", ".jinja", ".txt")):
            h.update(f.name.encode())
            with open(f, "rb") as src:
                for block in iter(lambda: src.read(1 << 22), b""):
                    h.update(block)
    return h.hexdigest()


def set_key(model_fp: str, prompts: bytes, max_answer_tokens: int = MAX_ANSWER_TOKENS) -> str:
    """The cache's key of one prompt set's answers: the base model's fingerprint, the set's bytes, the answer length."""
    return hashlib.sha256(f"{model_fp}:{max_answer_tokens}:".encode() + prompts).hexdigest()[:32]


def fingerprint(
    model_dir: str | Path, prompts_file: str | Path, max_answer_tokens: int = MAX_ANSWER_TOKENS, dtype: str = ""
) -> str:
    """:func:`set_key` of a model directory and a prompt file."""
    return set_key(model_fingerprint(model_dir, dtype), Path(prompts_file).read_bytes(), max_answer_tokens)


class RetentionSets:
    """A trainer rank's retention sets: built once per base model and prompt file, cached on disk and in memory.

    ``get`` hashes the prompt file each time (small), so an edited file builds a new set; the base
    model's fingerprint is computed once, since a rank's base never changes while it lives.
    """

    def __init__(self, model_dir: str | Path, data_dir: str | Path, dtype: str) -> None:
        self.model_dir, self.data_dir, self.dtype = Path(model_dir), Path(data_dir).expanduser(), dtype
        self._model_fp: str | None = None
        self._sets: dict[str, RetentionSet] = {}

    def get(self, prompts_file: str | Path, name: str, base: Any, tokenizer: Any) -> RetentionSet:
        """The set of ``prompts_file`` (answers and base scores); ``base()`` is a context manager yielding the base
        model in eval mode, entered only when the set must be built."""
        if self._model_fp is None:
            self._model_fp = model_fingerprint(self.model_dir, self.dtype)
        key = set_key(self._model_fp, Path(prompts_file).read_bytes())
        rs = self._sets.get(key) or load_cached(self.data_dir, key, name)
        if rs is None:
            prompts = read_prompts(prompts_file)
            with base() as model:
                items = items_of(prompts, generate_answers(model, tokenizer, prompts))
                if not items:
                    raise ValueError(f"{name}: the base model answered none of its prompts")
                rs = RetentionSet(name, key, items, tuple(score_answers(model, tokenizer, items)))
            store(self.data_dir, rs)
        rs = RetentionSet(name, rs.fingerprint, rs.items, rs.base)
        self._sets[key] = rs
        return rs


def cache_path(data_dir: str | Path, key: str) -> Path:
    return Path(data_dir).expanduser() / CACHE_DIR / f"{key}.json"


def load_cached(data_dir: str | Path, key: str, name: str) -> RetentionSet | None:
    """The set stored under ``key``, or None (absent or unreadable: it is built again)."""
    try:
        raw = json.loads(cache_path(data_dir, key).read_text())
        return RetentionSet(
            name,
            key,
            tuple(RetentionItem(tuple(i["messages"]), i["completion"], bool(i["ended"])) for i in raw["items"]),
            tuple((float(s), int(n)) for s, n in raw["base"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(data_dir: str | Path, rs: RetentionSet) -> None:
    """Write the set atomically (a reader sees all of it or none)."""
    path = cache_path(data_dir, rs.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "name": rs.name,
        "items": [{"messages": list(i.messages), "completion": i.completion, "ended": i.ended} for i in rs.items],
        "base": [list(b) for b in rs.base],
        "base_score": rs.base_score,
    }
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(body, f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def generate_answers(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[dict[str, str]]],
    *,
    max_new_tokens: int = MAX_ANSWER_TOKENS,
    batch_size: int = 16,
) -> list[tuple[str, bool]]:
    """Greedy answers of ``model`` to chat prompts (the chat template as vLLM's chat endpoint renders it), each with
    whether the model ended it within ``max_new_tokens``."""
    import torch

    texts = [tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True) for p in prompts]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    out: list[tuple[str, bool]] = []
    try:
        device = next(model.parameters()).device
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(device) for k, v in enc.items()}
            with torch.no_grad():
                ids = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                )
            for row in ids[:, enc["input_ids"].shape[1] :].tolist():
                ended = eos in row
                row = row[: row.index(eos)] if ended else row
                out.append((tokenizer.decode(row, skip_special_tokens=True).strip(), ended))
    finally:
        tokenizer.padding_side = side
    return out


def items_of(
    prompts: Sequence[Sequence[dict[str, str]]], answers: Sequence[tuple[str, bool]]
) -> tuple[RetentionItem, ...]:
    """Retention items from prompts and their base answers; a prompt the base answered with nothing is left out."""
    return tuple(RetentionItem(tuple(p), a, ended) for p, (a, ended) in zip(prompts, answers) if a.strip())


def score_answers(
    model: Any,
    tokenizer: Any,
    items: Sequence[RetentionItem],
    *,
    batch_size: int = 24,
    max_length: int = 512,
    skip_first: int = SKIP_FIRST_TOKENS,
) -> list[tuple[float, int]]:
    """Per item, (Σ log π of its answer's tokens after the first ``skip_first``, their number) under ``model`` as
    it computes now, teacher-forced.

    Runs in eval mode without gradients: one batched forward pass per ``batch_size`` items.
    """
    import torch

    from actors.learning.lora.steps import model_mode

    out: list[tuple[float, int]] = []
    with torch.no_grad(), model_mode(model, False):
        for i in range(0, len(items), batch_size):
            enc = encoded(tokenizer, items[i : i + batch_size], max_length)
            logps = _shared_prefix_logprobs(model, enc)
            mask = enc.completion_mask[:, 1:].to(logps.device)
            mask = mask * (mask.cumsum(dim=1) > skip_first)  # each answer's first tokens left out
            sums = (logps * mask).sum(dim=1).tolist()
            counts = mask.sum(dim=1).tolist()
            out += [(float(s), int(n)) for s, n in zip(sums, counts)]
    return out


def _shared_prefix_logprobs(model: Any, enc: Any) -> Any:
    """``steps.token_logprobs`` of a batch whose rows share a prefix (the chat template's system turn), computing
    that prefix once: its keys and values are repeated for every row, and only the rest runs per row.

    Every retention prompt starts with the same rendered system turn (about 24 of SmolLM2's ~60 tokens per
    item), so this saves about 40% of the scoring's forward pass. The result equals the plain pass
    (``tests/unit/test_retention.py``). Positions [0, P−1) of the result cover the prefix and are zero:
    no completion token lies there.
    """
    import torch

    from actors.learning.lora.steps import token_logprobs

    ids, attn = enc.input_ids, enc.attention_mask
    lengths = attn.sum(dim=1)
    same = (ids == ids[:1]).all(dim=0)
    # The shared prefix stops before every row's last prompt token, which must predict the first answer token.
    first_answer = enc.completion_mask.float().argmax(dim=1)
    limit = int(min(first_answer.min().item(), lengths.min().item())) - 1
    p = int(same[:limit].long().cumprod(0).sum().item()) if limit > 0 else 0
    if p < 2 or ids.shape[0] < 2:
        return token_logprobs(model, enc)
    device = next(model.parameters()).device
    ids, attn = ids.to(device), attn.to(device)
    head = model(input_ids=ids[:1, :p], use_cache=True)
    cache = head.past_key_values
    cache.batch_repeat_interleave(ids.shape[0])
    logits = model(input_ids=ids[:, p:], attention_mask=attn, past_key_values=cache, use_cache=True).logits.float()
    # logits[:, j] predicts token p + j + 1; the prefix's last position predicts token p.
    logits = torch.cat([head.logits[:, -1:].float().expand(ids.shape[0], -1, -1), logits[:, :-1]], dim=1)
    targets = ids[:, p:]
    rest = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.cat([torch.zeros(ids.shape[0], p - 1, device=device, dtype=rest.dtype), rest], dim=1)


def encoded(tokenizer: Any, items: Sequence[RetentionItem], max_length: int = 512) -> Any:
    """The items as one right-padded batch (``steps.Encoded``): the chat prompt as served, then the base's answer;
    its end of turn only when the base ended the answer itself."""
    from actors.learning.lora.steps import encode, prompted_text

    prompts, answers = [], []
    for it in items:
        t = prompted_text(tokenizer, {"messages": list(it.messages), "completion": it.completion}, "completion")
        prompts.append(t.prompt)
        answers.append(t.answer if it.ended else t.answer[: t.answer.rindex(it.completion) + len(it.completion)])
    return encode(tokenizer, prompts, answers, max_length=max_length, templated=[True] * len(prompts))
