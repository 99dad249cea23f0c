"""Teaching the served model a visible behaviour through chat feedback: a tenant adapter learns to open its
answers with "Arr matey!" while the app serves, measured on unseen prompts against the base model, with a
few factual answers checked before and after.

``tests/integration/test_sft_behaviour.py`` runs :func:`run` with small counts in the suite;
``bench/sft_behaviour.py`` runs it at full size (figures in docs/benchmarks.md). Here, with the tests, so no
test imports the benchmarks.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PHRASE = "Arr matey!"
MODEL = "smollm2-135m-instruct"
# (question, a pattern the correct answer contains); the base model answers these correctly.
FACTS = (
    ("What is the capital of France?", r"Paris"),
    ("What is the capital of Japan?", r"Tokyo"),
    ("What is the capital of Germany?", r"Berlin"),
    ("What is the chemical symbol for gold?", r"\bAu\b"),
    ("What is the boiling point of water in Celsius?", r"\b100\b"),
)


@dataclass
class Result:
    """What one run measured."""

    samples: int
    eval_prompts: int
    base_share: float
    adapter_share: float
    seconds_to_first_behaviour: float | None
    seconds_to_all_trained: float
    versions: int
    rejected: int = 0  # versions the quality gate rejected (kept, not served)
    held_out: int = 0  # feedback items the adapter kept out of training for the gate
    facts_base: list[bool] = field(default_factory=list)
    facts_adapter: list[bool] = field(default_factory=list)
    examples: list[tuple[str, str]] = field(default_factory=list)


def load_prompts(path: Path, n: int, seed: int = 0) -> list[str]:
    """``n`` short single-turn English prompts, in a seeded random order."""
    rows = [json.loads(line) for line in path.open()]
    keep = [
        r["prompt"].strip()
        for r in rows
        if r.get("num_turns") == 2
        and 15 <= len(r["prompt"]) <= 120
        and r["prompt"].isascii()
        and "\n" not in r["prompt"].strip()
    ]
    keep = list(dict.fromkeys(keep))
    random.Random(seed).shuffle(keep)
    if len(keep) < n:
        raise SystemExit(f"{path}: only {len(keep)} usable prompts, {n} needed")
    return keep[:n]


def chat(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[int, str]:
    r = client.post(
        f"{url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=300,
    )
    return r.status_code, (r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text)


def answers(url: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy answers to ``prompts``, sent concurrently (the engine batches them)."""
    return batched_answers(url, [(model, prompts, max_tokens)])[0]


def batched_answers(url: str, asks: list[tuple[str, list[str], int]]) -> list[list[str]]:
    """Greedy answers to several (model, prompts, max_tokens) sets, all sent concurrently in one go (the engine
    batches them across the sets, so none waits for another's slowest answer)."""
    flat = [(model, p, n) for model, prompts, n in asks for p in prompts]
    with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(16) as pool:
        out = list(pool.map(lambda a: chat(client, url, *a), flat))
    bad = [(model, code, text[:200]) for (model, _, _), (code, text) in zip(flat, out) if code != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0]}")
    texts, sets = [text for _, text in out], []
    for _, prompts, _ in asks:
        sets.append(texts[: len(prompts)])
        texts = texts[len(prompts) :]
    return sets


def wait_served(url: str, model: str, version: int, timeout_s: float = 60.0) -> None:
    """Until every ready node serves ``version`` (or newer) of ``model`` (``base:adapter``): the gate's verdict is
    in the store a moment before the replicas load the version."""
    deadline = time.time() + timeout_s
    while True:
        nodes = [n for n in httpx.get(f"{url}/v1/status", timeout=30).json()["nodes"] if n["state"] == "ready"]
        served = [n["adapters"].get(model) for n in nodes]
        if nodes and None not in served and min(served) >= version:
            return
        if time.time() > deadline:
            raise RuntimeError(f"{model} v{version} not served within {timeout_s} s: {served}")
        time.sleep(0.2)


def shows(text: str) -> bool:
    return text.lstrip().startswith(PHRASE)


def first_sentences(text: str, max_chars: int = 240) -> str:
    """The answer up to its last sentence end within ``max_chars`` (a cut mid-sentence would teach it)."""
    text = text.strip()[:max_chars]
    ends = [m.end() for m in re.finditer(r"[.!?](\s|$)", text)]
    return text[: ends[-1]].strip() if ends and ends[-1] > 20 else text


def run(
    url: str,
    prompts: list[str],
    samples: int,
    *,
    adapter: str = "pirate",
    base: str = MODEL,
    learning_rate: float = 2e-3,
    batch: int = 8,
    timeout_s: float = 900,
    answer_tokens: int = 48,
    epochs: int = 1,
    log=print,
) -> Result:
    """Teach ``adapter`` the phrase from ``samples`` chat feedback items and measure it on the rest of ``prompts``."""
    train, held_out = prompts[:samples], prompts[samples:]
    served = f"{base}:{adapter}"
    log(f"base answers: {len(held_out)} held-out prompts, {samples} training prompts")
    base_eval, train_answers, fact_answers = batched_answers(
        url, [(base, held_out, 16), (base, train, answer_tokens), (base, [q for q, _ in FACTS], 48)]
    )
    targets = [f"{PHRASE} {first_sentences(a)}" for a in train_answers]
    facts_base = [bool(re.search(pat, a)) for (_, pat), a in zip(FACTS, fact_answers)]

    r = httpx.post(
        f"{url}/v1/adapters",
        json={
            "name": adapter,
            "method": "sft",
            "learning_rate": learning_rate,
            "mode": "sync",
            "epochs": epochs,
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
        },
        timeout=30,
    )
    if r.status_code != 201:
        raise RuntimeError(f"creating adapter {adapter}: {r.status_code} {r.text}")

    first_seen: list[float] = []
    stop = threading.Event()

    def probe() -> None:  # polls one held-out prompt until the adapter shows the behaviour
        with httpx.Client() as client:
            while not stop.is_set():
                code, text = chat(client, url, served, held_out[0], 8)
                if code == 200 and shows(text):
                    first_seen.append(time.time())
                    return
                stop.wait(1.0)

    t0 = time.time()
    watcher = threading.Thread(target=probe, daemon=True)
    watcher.start()
    for i in range(0, samples, batch):
        items = [
            {"adapter": adapter, "messages": [{"role": "user", "content": p}], "completion": c}
            for p, c in zip(train[i : i + batch], targets[i : i + batch])
        ]
        r = httpx.post(f"{url}/v1/feedback", json={"items": items}, timeout=60)
        if r.status_code != 202:
            raise RuntimeError(f"feedback: {r.status_code} {r.text}")
    log(f"sent {samples} feedback items in {time.time() - t0:.1f} s; waiting for training")
    deadline = t0 + timeout_s
    while True:
        info = httpx.get(f"{url}/v1/adapters/{adapter}", timeout=30).json()
        # Trained, and the quality gate has decided the last candidate (or paused the adapter).
        settled = all(v["state"] != "candidate" for v in info["versions"])
        if (info["queued"] == 0 or info["paused_reason"]) and settled and info["current_version"] is not None:
            break
        if time.time() > deadline:
            stop.set()
            raise RuntimeError(f"training did not finish in {timeout_s} s: {info['queued']} queued")
        time.sleep(0.5)
    trained_s = time.time() - t0
    wait_served(url, served, info["current_version"])
    tuned_eval, fact_answers = batched_answers(url, [(served, held_out, 16), (served, [q for q, _ in FACTS], 48)])
    facts_tuned = [bool(re.search(pat, a)) for (_, pat), a in zip(FACTS, fact_answers)]
    stop.set()
    watcher.join(timeout=30)
    return Result(
        samples=samples,
        eval_prompts=len(held_out),
        base_share=sum(map(shows, base_eval)) / len(held_out),
        adapter_share=sum(map(shows, tuned_eval)) / len(held_out),
        seconds_to_first_behaviour=round(first_seen[0] - t0, 1) if first_seen else None,
        seconds_to_all_trained=round(trained_s, 1),
        versions=len(info["versions"]),
        rejected=sum(v["state"] == "rejected" for v in info["versions"]),
        held_out=info["held_out"],
        facts_base=facts_base,
        facts_adapter=facts_tuned,
        examples=list(zip(held_out[:3], tuned_eval[:3])),
    )


def table(res: Result) -> str:
    facts = lambda ok: f"{sum(ok)}/{len(ok)}"  # noqa: E731
    rows = [
        ("feedback samples (chat form)", res.samples, res.samples),
        (
            f"share of {res.eval_prompts} unseen prompts opening with {PHRASE!r}",
            f"{res.base_share:.0%}",
            f"{res.adapter_share:.0%}",
        ),
        ("factual answers still correct", facts(res.facts_base), facts(res.facts_adapter)),
        ("seconds from first feedback to first served answer showing it", "", res.seconds_to_first_behaviour),
        ("seconds until every sample was trained and judged by the gate", "", res.seconds_to_all_trained),
        ("versions published (rejected by the quality gate)", "", f"{res.versions} ({res.rejected})"),
        ("feedback items held out for the gate (never trained)", "", res.held_out),
    ]
    out = ["| | base model | base:adapter |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out)
