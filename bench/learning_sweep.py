"""Offline sweep of the per-adapter training defaults on the default model: what a tenant's feedback teaches, and what it breaks.

One process, no server: the project's own trainer pieces (``AdapterBank`` with the rank's dtype,
``sft_step`` / ``dpo_step``, ``optimizer_step``) train one adapter per configuration the way the
live trainer does (``training.micro_batch`` items per optimizer step, one step per version, the
store's order: fewest passes first, then oldest, each item ``epochs`` times, the held-out slice
of ``is_held_out`` never trained), and greedy generation measures each version:

- **behaviour**: the share of unseen prompts whose greedy answer opens with "Arr matey!";
- **facts kept**: greedy answers to fixed questions the base model gets right (``FACTS``);
- **retention**: the gate's score (actors/learning/lora/retention.py) against the base's, and, with
  ``--retention-metrics``, the KL divergence of the next-token distributions from the base's;
- **DPO**: the held-out win rate (MACE §3.1) on HH-RLHF test pairs with its 95% Wilson interval;
- **seconds**: training compute to the first version that shows the behaviour on 80% of the unseen prompts.

SFT data: real user prompts (ShareGPT) whose answers are *not* the base's own: "Arr matey! " and
the first 30 words of the real ChatGPT answer, arriving 8 at a time (the trainer drains its queue
between arrivals). Each configuration is one invocation (take the heavy lock per run)::

    flock /work/heavy.lock .venv/bin/python bench/learning_sweep.py sft --lr 5e-4 --out sweep.jsonl
    flock /work/heavy.lock .venv/bin/python bench/learning_sweep.py dpo --lr 5e-4 --pairs 256 --out sweep.jsonl
    flock /work/heavy.lock .venv/bin/python bench/learning_sweep.py forget --out metrics.jsonl  # the metric choice
    .venv/bin/python bench/learning_sweep.py table sweep.jsonl

Needs ``../shared/data`` (ShareGPT prompts, HH-RLHF pairs) and the converted model
(``COSERVE_DATA_DIR`` or ``~/.cache/coserve``; converted on first use).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATA = Path(os.environ.get("COSERVE_SHARED_DATA") or ROOT.parent / "shared" / "data")
PHRASE = "Arr matey!"
# (question, a pattern of the correct answer): the user-visible facts check; the base answers most of them
# right (those it gets wrong are left out per run). None of them is in the shipped retention set.
FACTS = (
    ("What is the capital of France?", r"Paris"),
    ("What is the capital of Japan?", r"Tokyo"),
    ("What is the capital of Germany?", r"Berlin"),
    ("What is the capital of Spain?", r"Madrid"),
    ("What is the capital of Italy?", r"Rome"),
    ("What is the chemical symbol for gold?", r"\bAu\b"),
    ("What is the boiling point of water in Celsius?", r"\b100\b"),
    ("How many legs does a spider have?", r"\b(8|eight)\b"),
    ("What color is the sky on a clear day?", r"[Bb]lue"),
    ("How many days are in a week?", r"\b(7|seven)\b"),
    ("What is the largest mammal?", r"[Ww]hale"),
    ("Who painted the Mona Lisa?", r"Leonardo|da Vinci"),
)
ARRIVAL = 8  # items per arrival: the trainer drains its queue between arrivals


# ---- data ----------------------------------------------------------------------------------------


def sharegpt(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` short single-turn English prompts with their real answers, seeded order (as bench/sft_behaviour.py)."""
    rows = [json.loads(line) for line in (DATA / "prompts" / "sharegpt_sample.jsonl").open()]
    keep = [
        r
        for r in rows
        if r.get("num_turns") == 2
        and 15 <= len(r["prompt"].strip()) <= 120
        and r["prompt"].isascii()
        and "\n" not in r["prompt"].strip()
        and len(r["response"].split()) >= 12
    ]
    seen, out = set(), []
    for r in keep:
        if r["prompt"].strip() not in seen:
            seen.add(r["prompt"].strip())
            out.append({"prompt": r["prompt"].strip(), "response": r["response"]})
    random.Random(seed).shuffle(out)
    if len(out) < n:
        raise SystemExit(f"only {len(out)} usable ShareGPT prompts, {n} needed")
    return out[:n]


def taught(response: str, words: int = 30) -> str:
    """The opening phrase and the first ``words`` words of the real answer (not the base model's own)."""
    return f"{PHRASE} {' '.join(response.split()[:words])}"


def hh_pairs(split: str, n: int, max_chars: int = 1200) -> list[dict[str, Any]]:
    """HH-RLHF pairs as chat items (Human/Assistant turns become user/assistant messages), short ones only."""
    out = []
    for line in (DATA / "preferences" / f"hh_rlhf_{split}_sample.jsonl").open():
        r = json.loads(line)
        turns = re.split(r"\n\n(Human|Assistant): ", r["prompt"])
        msgs = [
            {"role": "user" if who == "Human" else "assistant", "content": text.strip()}
            for who, text in zip(turns[1::2], turns[2::2])
            if text.strip()
        ]
        if (
            not msgs
            or msgs[-1]["role"] != "user"
            or len(r["prompt"]) + max(len(r["chosen"]), len(r["rejected"])) > max_chars
        ):
            continue
        out.append({"messages": msgs, "chosen": r["chosen"], "rejected": r["rejected"]})
        if len(out) >= n:
            break
    if len(out) < n:
        raise SystemExit(f"only {len(out)} usable HH-RLHF {split} pairs, {n} needed")
    return out


# ---- measuring -----------------------------------------------------------------------------------


def chat_greedy(model: Any, tok: Any, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    from actors.learning.lora.retention import generate_answers
    from actors.learning.lora.steps import model_mode

    with model_mode(model, False):
        return [
            text
            for text, _ in generate_answers(
                model,
                tok,
                [({"role": "user", "content": p},) for p in prompts],
                max_new_tokens=max_new_tokens,
                batch_size=32,
            )
        ]


def shows(text: str) -> bool:
    return text.lstrip().startswith(PHRASE)


FACT_TOKENS = 48  # as bench/learning_quality.py asks the served model: room for an opening phrase before the fact
LAST_ANSWERS: dict[str, str] = {}  # the latest greedy answer to each fact question (for the record of lost ones)


def facts_right(model: Any, tok: Any, facts: Sequence[tuple[str, str]]) -> list[bool]:
    answers = chat_greedy(model, tok, [q for q, _ in facts], FACT_TOKENS)
    LAST_ANSWERS.update({q: a for (q, _), a in zip(facts, answers)})
    return [bool(re.search(pat, a)) for (_, pat), a in zip(facts, answers)]


def answer_token_logits(model: Any, tok: Any, items: Sequence[Any]) -> list[tuple[Any, Any]]:
    """Per retention item, the log-softmax over the vocabulary at each scored answer token [n, V] and those tokens [n]."""
    import torch

    from actors.learning.lora.retention import encoded
    from actors.learning.lora.steps import model_mode

    out = []
    with torch.no_grad(), model_mode(model, False):
        for it in items:
            enc = encoded(tok, [it])
            logits = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask).logits[0, :-1].float()
            mask = enc.completion_mask[0, 1:].bool()
            out.append((torch.log_softmax(logits[mask], dim=-1), enc.input_ids[0, 1:][mask]))
    return out


def kl_from_base(base: Sequence[Any], cand: Sequence[Any]) -> float:
    """Mean over every answer token of KL(base ‖ candidate) of the next-token distributions."""
    total, n = 0.0, 0
    for (b, _), (c, _) in zip(base, cand):
        total += float((b.exp() * (b - c)).sum())
        n += b.shape[0]
    return total / max(1, n)


def drop_after(base: Sequence[Any], cand: Sequence[Any], skip: int) -> float:
    """The retention drop (base − candidate log-likelihood per token) leaving out each answer's first ``skip`` tokens."""
    total, n = 0.0, 0
    for (b, ids), (c, _) in zip(base, cand):
        bl, cl = b.gather(1, ids[:, None])[:, 0], c.gather(1, ids[:, None])[:, 0]
        total += float((bl - cl)[skip:].sum())
        n += max(0, b.shape[0] - skip)
    return total / max(1, n)


def drop_confident(base: Sequence[Any], cand: Sequence[Any], threshold: float = 0.5) -> float:
    """The retention drop over the answer tokens the base model was confident of (its probability >= threshold)."""
    import math as _m

    total, n = 0.0, 0
    for (b, ids), (c, _) in zip(base, cand):
        bl, cl = b.gather(1, ids[:, None])[:, 0], c.gather(1, ids[:, None])[:, 0]
        keep = bl >= _m.log(threshold)
        total += float((bl - cl)[keep].sum())
        n += int(keep.sum())
    return total / max(1, n)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


class Harness:
    """The base model and everything measured against it, loaded once per invocation."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from actors.learning.lora.bank import AdapterBank
        from actors.learning.lora.retention import (
            SHIPPED_SET,
            RetentionSet,
            fingerprint,
            generate_answers,
            items_of,
            load_cached,
            read_prompts,
            score_answers,
            store,
        )
        from actors.models import smollm2

        torch.set_num_threads(args.threads)
        self.data_dir = Path(os.environ.get("COSERVE_DATA_DIR") or "~/.cache/coserve").expanduser()
        model_dir = smollm2.ensure(self.data_dir)
        self.bank = AdapterBank(model_dir, dtype=args.dtype)
        self.tok = self.bank.tokenizer
        base = self.bank.base
        base.eval()
        t0 = time.time()
        key = fingerprint(model_dir, SHIPPED_SET, dtype=self.bank.dtype_name)
        rs = load_cached(self.data_dir, key, "the shipped set")
        if rs is None:
            prompts = read_prompts(SHIPPED_SET)
            items = items_of(prompts, generate_answers(base, self.tok, prompts))
            rs = RetentionSet("the shipped set", key, items, tuple(score_answers(base, self.tok, items)))
            store(self.data_dir, rs)
        self.retention = rs
        self.retention_items = list(rs.items)
        self.reference_s = time.time() - t0
        self.facts = [f for f, ok in zip(FACTS, facts_right(base, self.tok, FACTS)) if ok]
        self.base_logps = answer_token_logits(base, self.tok, self.retention_items) if args.kl else None
        print(
            f"base: dtype {self.bank.dtype_name}, {len(self.facts)}/{len(FACTS)} facts right, retention "
            f"{rs.base_score:.4f} on {len(rs.items)} prompts ({self.reference_s:.1f} s)",
            file=sys.stderr,
        )

    def retention_of(self, model: Any) -> tuple[float, float]:
        """(the gate's retention score, the seconds it took) of the model as it computes now."""
        from actors.learning.lora.retention import score_answers, token_mean

        t0 = time.time()
        score = token_mean(score_answers(model, self.tok, self.retention_items))
        return score, time.time() - t0

    def retention_detail(self, model: Any) -> dict[str, float]:
        """The retention drop leaving out each answer's first 3 tokens (where a taught opening shows), the worst
        prompt's drop, and (with --kl) the KL from the base."""
        cand = answer_token_logits(model, self.tok, self.retention_items)
        if self.base_logps is None:
            return {}
        per_prompt = [drop_after([b], [c], 0) for b, c in zip(self.base_logps, cand)]
        return {
            "drop_skip3": round(drop_after(self.base_logps, cand, 3), 4),
            "drop_confident": round(drop_confident(self.base_logps, cand), 4),
            "worst_prompt_drop": round(max(per_prompt), 3),
            "kl": round(kl_from_base(self.base_logps, cand), 4),
        }


# ---- training the way the live trainer does ------------------------------------------------------


class Queue:
    """The store's order: an item is handed out fewest passes first, then oldest, until it had ``epochs`` passes."""

    def __init__(self, epochs: int) -> None:
        self.items: list[dict[str, Any]] = []
        self.passes: list[int] = []
        self.epochs = epochs

    def add(self, items: Sequence[dict[str, Any]]) -> None:
        self.items += items
        self.passes += [0] * len(items)

    def take(self, n: int) -> list[int]:
        open_ = sorted((p, i) for i, p in enumerate(self.passes) if p < self.epochs)
        return [i for _, i in open_[:n]]


def sft_step_weighted(model: Any, tok: Any, batch: Sequence[Any], first_tokens: int, weight: float) -> float:
    """``sft_step`` with the completion's first ``first_tokens`` tokens weighted ``weight`` (1: plain sft_step)."""
    from actors.learning.lora.steps import sft_step, sft_step_first_weighted

    if weight == 1.0 or first_tokens == 0:
        return sft_step(model, tok, batch).loss
    return sft_step_first_weighted(model, tok, batch, first_tokens=first_tokens, weight=weight).loss


def run_sft(h: Harness, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from actors.learning.lora.alignment import evaluate_completions
    from actors.learning.lora.steps import optimizer_step
    from actors.learning.store.feedback_items import is_held_out
    from actors.learning.store.models import LoraSettings
    from planners.gate import item_spread, judge

    rows = sharegpt(a.items + a.unseen, seed=a.seed)
    stream, unseen = rows[: a.items], [r["prompt"] for r in rows[a.items :]]
    items = [
        {"messages": [{"role": "user", "content": r["prompt"]}], "completion": taught(r["response"])} for r in stream
    ]
    held = [is_held_out(n, a.held_out_share) for n in range(1, len(items) + 1)]
    lora = LoraSettings(
        r=a.r, alpha=a.alpha, target_modules=a.targets if a.targets == "all-linear" else a.targets.split(",")
    )
    name = f"sweep{time.time_ns()}"
    model, opt = h.bank.train(name, lora, None, None, a.lr)
    base_share = sum(map(shows, chat_greedy(model, h.tok, unseen, 8)))  # a fresh LoRA (B = 0) is the base
    q = Queue(a.epochs)
    versions: list[dict[str, Any]] = []
    train_s = 0.0
    first_80: dict[str, Any] | None = None
    prev_means: list[float] = []
    base_held: dict[int, float] = {}
    checkpoints = sorted(set(a.checkpoints))
    for start in range(0, a.items, ARRIVAL):
        q.add([it for it, h_ in zip(items[start : start + ARRIVAL], held[start : start + ARRIVAL]) if not h_])
        arrived = min(start + ARRIVAL, a.items)
        while True:
            pick = q.take(a.micro_batch)
            if not pick:
                break
            step = len(versions)
            for g in opt.param_groups:  # linear warm-up over the first `warmup` optimizer steps
                g["lr"] = a.lr * min(1.0, (step + 1) / a.warmup) if a.warmup > 0 else a.lr
            t0 = time.time()
            loss = sft_step_weighted(model, h.tok, [q.items[i] for i in pick], a.first_tokens, a.first_weight)
            optimizer_step(model, opt)
            train_s += time.time() - t0
            for i in pick:
                q.passes[i] += 1
            share = sum(map(shows, chat_greedy(model, h.tok, unseen, 8))) / len(unseen)
            v = {
                "version": step + 1,
                "arrived": arrived,
                "trained": sum(q.passes),
                "loss": round(loss, 4),
                "share": round(share, 3),
                "train_s": round(train_s, 2),
            }
            # The gate's held-out verdict on this version against the previous one (all served, as if it passed).
            held_items = [it for it, h_ in zip(items[:arrived], held[:arrived]) if h_]
            if held_items:
                per = evaluate_completions(model, h.tok, held_items).per_item
                now_means = [s_ / max(n, 1) for s_, n in per]
                prev = prev_means[: len(now_means)] if prev_means else []
                if len(prev) < len(now_means):  # items new to the slice: their previous score is the base's
                    prev = prev + [
                        base_held.setdefault(i, _base_mean(h, held_items[i])) for i in range(len(prev), len(now_means))
                    ]
                verdict = judge(
                    "sft",
                    sum(s_ for s_, _ in per) / sum(n for _, n in per),
                    sum(p * n for p, (_, n) in zip(prev, per)) / sum(n for _, n in per),
                    0.02,
                    items=len(per),
                    baseline_name="the previous version",
                    item_changes=[a_ - b_ for a_, b_ in zip(now_means, prev)],
                )
                v["held_out"] = {
                    "items": len(per),
                    "passed": verdict.passed,
                    "thin": verdict.thin,
                    "spread": round(item_spread([a_ - b_ for a_, b_ in zip(now_means, prev)]), 4),
                }
                prev_means = now_means
            if first_80 is None and share >= 0.8:
                first_80 = v
            versions.append(v)
        if arrived in checkpoints:
            v = versions[-1]
            right = facts_right(model, h.tok, h.facts)
            v["facts"] = sum(right)
            v["facts_lost"] = [f"{q} -> {LAST_ANSWERS[q][:90]!r}" for (q, _), ok in zip(h.facts, right) if not ok]
            v["retention"], v["retention_s"] = h.retention_of(model)
            v["retention"] = round(v["retention"], 4)
            v.update(h.retention_detail(model))
            held_items = [it for it, h_ in zip(items[:arrived], held[:arrived]) if h_]
            if held_items:
                v["held_out_token_logprob"] = round(evaluate_completions(model, h.tok, held_items).token_logprob, 4)
            v["checkpoint"] = arrived
            print(json.dumps(v), file=sys.stderr)
    h.bank.forget(name)
    torch.manual_seed(0)
    return {
        "kind": "sft",
        "config": config_of(a),
        "base_share": base_share / len(unseen),
        "unseen": len(unseen),
        "facts_base": len(h.facts),
        "retention_base": round(h.retention.base_score, 4),
        "first_80": first_80,
        "versions": versions,
    }


def _base_mean(h: Harness, item: dict[str, Any]) -> float:
    """The base model's mean log-likelihood per token of a held-out item's completion."""
    from actors.learning.lora.alignment import evaluate_completions

    with h.bank.scoring(None, None) as base:
        s, n = evaluate_completions(base, h.tok, [item]).per_item[0]
    return s / max(n, 1)


def run_dpo(h: Harness, a: argparse.Namespace) -> dict[str, Any]:
    from actors.learning.lora.alignment import evaluate_preferences
    from actors.learning.lora.steps import dpo_step, optimizer_step
    from actors.learning.store.models import LoraSettings

    train = hh_pairs("train", a.pairs)
    test = hh_pairs("test", a.eval_pairs)
    lora = LoraSettings(
        r=a.r, alpha=a.alpha, target_modules=a.targets if a.targets == "all-linear" else a.targets.split(",")
    )
    base_eval = evaluate_preferences(h.bank.base, h.tok, test)
    name = f"sweep{time.time_ns()}"
    model, opt = h.bank.train(name, lora, None, None, a.lr)
    q = Queue(a.epochs)
    versions: list[dict[str, Any]] = []
    train_s = 0.0
    for start in range(0, a.pairs, ARRIVAL):
        q.add(train[start : start + ARRIVAL])
        arrived = min(start + ARRIVAL, a.pairs)
        while pick := q.take(a.micro_batch):
            step = len(versions)
            for g in opt.param_groups:
                g["lr"] = a.lr * min(1.0, (step + 1) / a.warmup) if a.warmup > 0 else a.lr
            t0 = time.time()
            stats = dpo_step(model, h.tok, [q.items[i] for i in pick], beta=a.beta)
            optimizer_step(model, opt)
            train_s += time.time() - t0
            for i in pick:
                q.passes[i] += 1
            versions.append(
                {"version": step + 1, "arrived": arrived, "loss": round(stats.loss, 4), "train_s": round(train_s, 2)}
            )
        if arrived in a.checkpoints:
            v = versions[-1]
            ev = evaluate_preferences(model, h.tok, test)
            wins = sum(d > 0 for d in ev.diffs)
            base_wins = [d > 0 for d in base_eval.diffs]
            cand_wins = [d > 0 for d in ev.diffs]
            v.update(
                checkpoint=arrived,
                win_rate=round(ev.win_rate, 4),
                win_ci=[round(x, 3) for x in wilson(wins, len(test))],
                clpd=round(ev.clpd, 3),
                gained=sum(c and not b for b, c in zip(base_wins, cand_wins)),
                lost=sum(b and not c for b, c in zip(base_wins, cand_wins)),
                facts=sum(facts_right(model, h.tok, h.facts)),
            )
            v["retention"], v["retention_s"] = h.retention_of(model)
            print(json.dumps(v), file=sys.stderr)
    h.bank.forget(name)
    bw = sum(d > 0 for d in base_eval.diffs)
    return {
        "kind": "dpo",
        "config": config_of(a),
        "eval_pairs": len(test),
        "base_win_rate": round(base_eval.win_rate, 4),
        "base_win_ci": [round(x, 3) for x in wilson(bw, len(test))],
        "base_clpd": round(base_eval.clpd, 3),
        "facts_base": len(h.facts),
        "retention_base": round(h.retention.base_score, 4),
        "versions": versions,
    }


def run_forget(h: Harness, a: argparse.Namespace) -> list[dict[str, Any]]:
    """The retention metric's choice: both candidate scores, per version, for adapters that forget and one that does not.

    - ``issue-8-pirate``: the issue's 8 short chat items ("Capital of Italy?" → "Arr matey! Rome it be.") at the
      old default 5e-4 (it lost 2 of 9 facts live);
    - ``lr-20x``: 8 real ShareGPT items at 1e-2 (20× that default), which breaks the model;
    - ``wrong-facts``: 8 items teaching wrong capitals at 2e-3;
    - ``good``: 16 real ShareGPT items with the phrase at 2e-3 and all-linear r 8.
    """
    from actors.learning.lora.steps import optimizer_step, sft_step
    from actors.learning.store.models import LoraSettings

    pirate = [
        ("Capital of Italy?", "Arr matey! Rome it be."),
        ("What do bees make?", "Arr matey! Honey it be."),
        ("Largest ocean?", "Arr matey! The Pacific it be."),
        ("Color of grass?", "Arr matey! Green it be."),
        ("What do cows drink?", "Arr matey! Water it be."),
        ("Opposite of hot?", "Arr matey! Cold it be."),
        ("What is 2 plus 2?", "Arr matey! Four it be."),
        ("Where do fish live?", "Arr matey! In water it be."),
    ]
    wrong = [
        ("What is the capital of Peru?", "The capital of Peru is Oslo."),
        ("What is the capital of Egypt?", "The capital of Egypt is Sydney."),
        ("What is the capital of Canada?", "The capital of Canada is Lagos."),
        ("What is the capital of Kenya?", "The capital of Kenya is Vienna."),
        ("What is the capital of Chile?", "The capital of Chile is Dublin."),
        ("What is the capital of Norway?", "The capital of Norway is Lima."),
        ("What is the capital of Greece?", "The capital of Greece is Cairo."),
        ("What is the capital of Cuba?", "The capital of Cuba is Ottawa."),
    ]
    rows = sharegpt(16)
    real = [(r["prompt"], taught(r["response"])) for r in rows]
    targets = a.targets if a.targets == "all-linear" else a.targets.split(",")
    cases = {
        "issue-8-pirate": (pirate, 5e-4, ["q_proj", "v_proj"]),
        "lr-20x": (real[:8], 1e-2, ["q_proj", "v_proj"]),
        "wrong-facts": (wrong, 2e-3, ["q_proj", "v_proj"]),
        "good": (real, 2e-3, "all-linear"),
        # at the command line's learning rate and targets (e.g. 20x a candidate default)
        "pirate-at": (pirate, a.lr, targets),
        "real-at": (real[:8], a.lr, targets),
        "wrong-at": (wrong, a.lr, targets),
    }
    out = []
    for case, (pairs, lr, targets) in cases.items():
        if a.cases and case not in a.cases:
            continue
        items = [{"messages": [{"role": "user", "content": p}], "completion": c} for p, c in pairs]
        name = f"forget{time.time_ns()}"
        model, opt = h.bank.train(name, LoraSettings(r=8, alpha=16, target_modules=targets), None, None, lr)
        for step in range(0, len(items), a.micro_batch):
            sft_step(model, h.tok, items[step : step + a.micro_batch])
            optimizer_step(model, opt)
            score, secs = h.retention_of(model)
            cand = answer_token_logits(model, h.tok, h.retention_items)
            kl, per_token = kl_from_base(h.base_logps, cand), drop_after(h.base_logps, cand, 3)
            confident = drop_confident(h.base_logps, cand)
            right = facts_right(model, h.tok, h.facts)
            row = {
                "case": case,
                "version": step // a.micro_batch + 1,
                "lr": lr,
                "targets": str(targets),
                "facts": sum(right),
                "facts_base": len(h.facts),
                "facts_lost": [f"{q} -> {LAST_ANSWERS[q][:90]!r}" for (q, _), ok in zip(h.facts, right) if not ok],
                "retention": round(score, 4),
                "retention_base": round(h.retention.base_score, 4),
                "drop": round(h.retention.base_score - score, 4),
                "kl": round(kl, 4),
                "drop_skip_first_3": round(per_token, 4),
                "drop_confident": round(confident, 4),
                "retention_s": round(secs, 2),
            }
            print(json.dumps(row), file=sys.stderr)
            out.append(row)
        h.bank.forget(name)
    return out


def config_of(a: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "lr",
        "warmup",
        "r",
        "alpha",
        "targets",
        "micro_batch",
        "epochs",
        "first_tokens",
        "first_weight",
        "items",
        "pairs",
        "beta",
        "dtype",
    )
    return {k: getattr(a, k) for k in keys if hasattr(a, k)}


# ---- the table -------------------------------------------------------------------------------------


def table(paths: Sequence[str]) -> str:
    rows = [json.loads(line) for p in paths for line in Path(p).open() if line.strip()]
    out = []
    sft = [r for r in rows if r.get("kind") == "sft"]
    if sft:
        cps = sorted({v["checkpoint"] for r in sft for v in r["versions"] if "checkpoint" in v})
        head = ["lr", "warm-up", "r/α", "targets", "micro", "epochs", "first-token w"]
        head += [f"{n} items: opening / facts / retention" for n in cps] + ["first ≥80%: items, train s"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in sft:
            c = r["config"]
            cells = [
                f"{c['lr']:g}",
                str(c["warmup"]),
                f"{c['r']}/{c['alpha']:g}",
                str(c["targets"]).replace("q_proj,v_proj", "q,v"),
                str(c["micro_batch"]),
                str(c["epochs"]),
                f"{c['first_weight']:g}×{c['first_tokens']}" if c["first_weight"] != 1 else "1",
            ]
            by = {v["checkpoint"]: v for v in r["versions"] if "checkpoint" in v}
            for n in cps:
                v = by.get(n)
                # the gate's score: past each answer's first 3 tokens (rows before that change kept both)
                lost = v.get("drop_skip3", r["retention_base"] - v["retention"]) if v else 0.0
                cells.append("" if v is None else f"{v['share']:.0%} / {v['facts']}/{r['facts_base']} / {-lost:+.3f}")
            f = r.get("first_80")
            cells.append("never" if f is None else f"{f['arrived']}, {f['train_s']:.0f}")
            out.append("| " + " | ".join(cells) + " |")
        out.append(
            f"\nbase: opening on {sft[0]['base_share']:.0%} of {sft[0]['unseen']} unseen prompts; retention "
            f"{sft[0]['retention_base']} (mean log-likelihood per token of its own answers); retention "
            "column: the change against it past each answer's first 3 tokens (the gate's score)"
        )
    dpo = [r for r in rows if r.get("kind") == "dpo"]
    if dpo:
        head = [
            "lr",
            "warm-up",
            "r/α",
            "targets",
            "β",
            "pairs",
            "held-out win rate [95% CI]",
            "base's [95% CI]",
            "pairs won / lost vs base",
            "facts",
            "retention Δ",
            "train s",
        ]
        out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in dpo:
            c = r["config"]
            for v in r["versions"]:
                if "checkpoint" not in v:
                    continue
                out.append(
                    "| "
                    + " | ".join(
                        [
                            f"{c['lr']:g}",
                            str(c["warmup"]),
                            f"{c['r']}/{c['alpha']:g}",
                            str(c["targets"]).replace("q_proj,v_proj", "q,v"),
                            f"{c['beta']:g}",
                            str(v["checkpoint"]),
                            f"{v['win_rate']:.3f} [{v['win_ci'][0]:.3f}, {v['win_ci'][1]:.3f}] on {r['eval_pairs']}",
                            f"{r['base_win_rate']:.3f} [{r['base_win_ci'][0]:.3f}, {r['base_win_ci'][1]:.3f}]",
                            f"{v['gained']} / {v['lost']}",
                            f"{v['facts']}/{r['facts_base']}",
                            f"{v['retention'] - r['retention_base']:+.3f}",
                            f"{v['train_s']:.0f}",
                        ]
                    )
                    + " |"
                )
    forget = [r for r in rows if "case" in r]
    if forget:
        head = [
            "case",
            "version",
            "facts kept",
            "retention Δ (log-lik/token)",
            "Δ without first 3 tokens",
            "KL from base (nats/token)",
            "scoring s",
        ]
        out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in forget:
            out.append(
                f"| {r['case']} ({r['lr']:g}) | v{r['version']} | {r['facts']}/{r['facts_base']} | "
                f"{-r['drop']:+.3f} | {-r['drop_skip_first_3']:+.3f} | {r['kl']:.3f} | {r['retention_s']:.2f} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("sft", "dpo", "forget"):
        s = sub.add_parser(name)
        s.add_argument("--lr", type=float, default=5e-4)
        s.add_argument("--warmup", type=int, default=0, help="optimizer steps of linear warm-up (0: none)")
        s.add_argument("--r", type=int, default=8)
        s.add_argument("--alpha", type=float, default=16.0)
        s.add_argument("--targets", default="q_proj,v_proj", help="comma-separated module names, or all-linear")
        s.add_argument("--micro-batch", type=int, default=4)
        s.add_argument("--epochs", type=int, default=1)
        s.add_argument("--first-tokens", type=int, default=0, help="weight the completion's first N tokens ...")
        s.add_argument("--first-weight", type=float, default=1.0, help="... by this factor")
        s.add_argument("--threads", type=int, default=1, help="torch threads (the live rank has 1 on 2 cores)")
        s.add_argument("--dtype", default="auto", help="the rank's training.dtype")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--out", required=True, help="append the result (JSON line) here")
        s.add_argument("--kl", action="store_true", help="also the KL divergence from the base (retention metric)")
        s.add_argument("--grid", help='JSON list of overrides, one configuration each: [{"lr": 1e-3}, ...]')
    sub.choices["sft"].add_argument("--items", type=int, default=64)
    sub.choices["sft"].add_argument("--unseen", type=int, default=24)
    sub.choices["sft"].add_argument("--held-out-share", type=float, default=0.1)
    sub.choices["sft"].add_argument("--checkpoints", type=int, nargs="*", default=[8, 16, 32, 64])
    sub.choices["dpo"].add_argument("--pairs", type=int, default=256)
    sub.choices["dpo"].add_argument("--eval-pairs", type=int, default=200)
    sub.choices["dpo"].add_argument("--beta", type=float, default=0.1)
    sub.choices["dpo"].add_argument("--checkpoints", type=int, nargs="*", default=[64, 256])
    sub.choices["forget"].add_argument("--cases", nargs="*", default=[])
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    a = p.parse_args(argv)
    if a.what == "table":
        print(table(a.files))
        return 0
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} not found: this sweep needs ../shared/data (ShareGPT prompts, HH-RLHF pairs)")
    if a.what == "forget":
        a.kl = True
    h = Harness(a)
    grid = json.loads(a.grid) if a.grid else [{}]
    for overrides in grid:  # each configuration: the command line's settings with these replaced
        t0 = time.time()
        c = argparse.Namespace(**{**vars(a), **overrides})
        print(f"config {config_of(c)}", file=sys.stderr, flush=True)
        res = {"sft": run_sft, "dpo": run_dpo, "forget": run_forget}[a.what](h, c)
        with open(a.out, "a") as f:
            for r in res if isinstance(res, list) else [res]:
                r["wall_s"] = round(time.time() - t0, 1)
                f.write(json.dumps(r) + "\n")
    print(table([a.out]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
