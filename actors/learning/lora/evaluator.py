"""VersionEvaluator: the LoRA driver's quality gate and held-out scores, scored on rank 0's model (docs/learning.md §7)."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import ray

from actors.learning.lora.messages import (
    GateDecided,
    RetentionScoreRequest,
    RetentionSetRequest,
    ScoreRequest,
    TrainerEvent,
    VersionScored,
)
from actors.learning.store.models import VersionConflict
from actors.learning.store.records import AdapterInfo, VersionScores, VersionVerdict
from settings import TrainingConfig


class RankZero(Protocol):
    """Scoring on rank 0's model (the LoRA driver sends these to its rank 0, between its steps)."""

    def score(self, request: ScoreRequest) -> list[Any]: ...

    def retention_set(self, request: RetentionSetRequest) -> Any: ...

    def score_retention(self, request: RetentionScoreRequest) -> list[tuple[float, int]]: ...


@dataclass(frozen=True)
class RetentionScores:
    """A version's retention check: its score, the base's, the prompts, and the seconds it cost."""

    score: float
    base: float
    prompts: int
    seconds: float


@dataclass
class EvalJob:
    """A version waiting to be scored: a candidate for the gate, or one served without it."""

    adapter: str
    version: int
    path: str  # its published location (actors/learning/versions/files.py makes a local copy)
    candidate: bool
    created: list[float]  # acceptance times of the items it trained on (freshness once served)
    attempts: int = 0
    not_before: float = 0.0  # a failed attempt waits before the next


class VersionEvaluator:
    """The driver's quality gate and held-out scores of every version, scored on rank 0's model.

    A candidate (its adapter's gate on) is scored on the adapter's held-out slice, the oldest
    ``max_eval_items`` held-out feedback items (or ``training.eval_file`` when it has none), and so
    is the version served now (the base model before the first; scores are cached per version and
    slice, so usually only the candidate is scored). ``planners.gate.judge`` compares them. It is
    also scored on the retention set (``gate.retention``: the base model's greedy answers to general
    prompts, or the adapter's ``gate.retention_file``; ``retention.py``), against the base model's
    own score of them, cached beside the model; ``planners.gate.decide`` combines the two under
    ``gate.thin_evidence``. The store records the verdict, both scores and the scoring seconds in
    one transaction, and a passed candidate is loaded on the replicas.
    The driver does not train an adapter while its candidate is judged, so the next version starts
    from whatever is served after the verdict, never from rejected weights.

    Versions served without the gate are scored the same way, so the served version's held-out win
    rate is known with the gate off too; when they come faster than that, only the newest waiting
    one per adapter is scored. A version is scored with rank 0's ``AdapterBank``: loaded as a
    temporary adapter beside the ones in training (no second copy of the base weights), between
    the driver's steps, since one model computes as one adapter at a time. The scores are kept
    here, in the driver, so a rank that restarts costs no rescoring of versions judged before.
    """

    MAX_ATTEMPTS = 3  # a candidate whose scoring fails this often is rejected with the error as its reason
    MAX_CACHED = 256

    def __init__(
        self,
        store: Any,
        line: int | None,
        training: TrainingConfig,
        data_path: Path,
        eval_file: str | None,
        *,
        rank_zero: RankZero,
        spec_changed: Callable[[str], None],
        load_on_replicas: Callable[[str, int], None],
        report: Callable[[str, TrainerEvent], None],
        warn: Callable[[str, BaseException | str], None],
    ) -> None:
        """``store``: the feedback store's actor handle; ``line``: the driver's queue partition (a node under
        per_node); ``spec_changed``: a verdict may have paused the adapter (the driver reads its spec again);
        ``load_on_replicas``: wait until the replicas serve a passed candidate (its served-change number)."""
        self.store, self.line, self.t, self.data_path = store, line, training, data_path
        self.rank_zero, self.spec_changed, self.load_on_replicas = rank_zero, spec_changed, load_on_replicas
        self.report, self.warn = report, warn
        self.eval_file = eval_file
        self._file_pairs: list[dict[str, str]] | None = None
        self._candidates: deque[EvalJob] = deque()
        self._served: dict[str, EvalJob] = {}  # adapter -> newest version served without the gate
        self._judging: dict[str, int] = {}  # adapter -> its candidates not decided yet
        # (adapter, version, "held-out" or "eval-file") -> {item id (eval file: index) -> its own score}
        self._scores: dict[tuple[str, int | None, str], dict[int, Any]] = {}

    def judging(self, adapter: str) -> bool:
        """Whether a candidate of ``adapter`` waits for its verdict (the driver does not train it meanwhile)."""
        return self._judging.get(adapter, 0) > 0

    def has(self, adapter: str, version: int) -> bool:
        """Whether the candidate ``version`` of ``adapter`` waits here for its verdict already."""
        return any(j.adapter == adapter and j.version == version for j in self._candidates)

    def submit(self, adapter: str, version: int, path: str, *, candidate: bool, created: list[float]) -> None:
        job = EvalJob(adapter, version, path, candidate, created)
        if candidate:
            self._candidates.append(job)
            self._judging[adapter] = self._judging.get(adapter, 0) + 1
        else:
            self._served[adapter] = job

    def pending(self) -> bool:
        now = time.time()
        return any(j.not_before <= now for j in self._candidates) or bool(self._served)

    def work_one(self) -> None:
        """Judge the oldest candidate (candidates first: training of their adapter waits), else score a served version."""
        now = time.time()
        job = next((j for j in self._candidates if j.not_before <= now), None)
        if job is None:
            self._score_served_safely(self._served.popitem()[1])
            return
        self._candidates.remove(job)
        try:
            self._gate(job)
        except Exception as exc:
            job.attempts += 1
            self.warn("gate", exc)
            if job.attempts < self.MAX_ATTEMPTS:
                job.not_before = time.time() + 2.0  # e.g. the store actor restarting
                self._candidates.appendleft(job)
                return
            self._give_up(job, exc)
        self._judging[job.adapter] -= 1

    def _score_served_safely(self, job: EvalJob) -> None:
        try:
            self._score_served(job)
        except Exception as exc:
            self.warn("evaluate", exc)

    # ---- what is scored, and how --------------------------------------------------------------------

    def _eval_file_pairs(self) -> list[dict[str, str]]:
        from actors.learning.lora.alignment import read_preference_jsonl

        if self.eval_file and self._file_pairs is None:
            try:
                self._file_pairs = read_preference_jsonl(
                    self.eval_file, limit=self.t.eval_pairs, max_text_bytes=4 * self.t.max_length
                )
            except Exception as exc:
                self.warn("eval_file", exc)
                self._file_pairs = []
        return self._file_pairs or []

    def _slice(self, adapter: str, max_items: int) -> tuple[list[Any], str, str]:
        """(items, a key naming exactly these items, how to call them in a reason); no items: nothing to score on."""
        items = ray.get(self.store.held_out_items.remote(adapter, max_items), timeout=60)
        if items:
            return items, "held-out:" + ",".join(str(it.id) for it in items), "held-out items"
        pairs = self._eval_file_pairs()
        if pairs:
            return pairs, "eval-file", f"pairs of training.eval_file {os.path.basename(self.eval_file)}"
        return [], "", ""

    def _score(
        self, adapter: str, version: int | None, path: str | None, info: AdapterInfo, items: list[Any], key: str
    ) -> tuple[dict[str, float], list[Any]]:
        """Held-out scores of one version (``path`` None: the base model) on ``items``, and each item's own score.

        Each item's own score (a pair's log-probability difference, a completion's log-likelihood
        and token count) is cached per version, so while the held-out slice grows toward
        ``max_eval_items`` only its new items are scored, and the served version, scored before,
        costs nothing more.
        """
        from actors.learning.lora.alignment import completion_eval, preference_eval

        held_out = key.startswith("held-out")
        ids = [it.id for it in items] if held_out else list(range(len(items)))
        cache_key = (adapter, version, "held-out" if held_out else "eval-file")
        if cache_key not in self._scores and len(self._scores) >= self.MAX_CACHED:
            self._scores.clear()
        cached = self._scores.setdefault(cache_key, {})
        missing = [(i, it) for i, it in zip(ids, items) if i not in cached]
        if missing:
            # An sft adapter's own held-out items have a completion; eval_file pairs score their chosen answer.
            found = self.rank_zero.score(
                ScoreRequest(
                    adapter,
                    version,
                    path,
                    info.lora,
                    info.method,
                    tuple(it for _, it in missing),
                    "completion" if held_out else "chosen",
                )
            )
            cached.update(zip((i for i, _ in missing), found))
        per_item = [cached[i] for i in ids]
        if info.method == "dpo":
            ev = preference_eval(per_item)
            return {"score": ev.win_rate, "win_rate": ev.win_rate, "clpd": ev.clpd}, per_item
        if info.method == "kto":
            # Each label's signed mean token log-likelihood: up-rated answers should grow likelier, down-rated less.
            signed = label_scores(items, per_item)
            return {"score": sum(signed) / max(len(signed), 1)}, per_item
        tokens = completion_eval(per_item)
        return {"score": tokens.token_logprob, "token_logprob": tokens.token_logprob}, per_item

    # ---- the gate --------------------------------------------------------------------------------

    def _gate(self, job: EvalJob) -> None:
        from planners.gate import decide, judge

        adapter, version, path = job.adapter, job.version, job.path
        t0 = time.time()
        info: AdapterInfo = ray.get(self.store.get_adapter.remote(adapter), timeout=60)
        current = ray.get(self.store.current_version.remote(adapter, self.line), timeout=60)
        base_version, base_path = (current.version, current.path) if current is not None else (None, None)
        base_name = "the base model" if current is None else f"v{current.version}"
        items, key, slice_name = self._slice(adapter, info.gate.max_eval_items)
        cand: dict[str, float] = {}
        base: dict[str, float] = {}
        held_out = None
        if items:
            cand, cand_items = self._score(adapter, version, path, info, items, key)
            base, base_items = self._score(adapter, base_version, base_path, info, items, key)
            # SFT: each item's change of its mean token log-likelihood, whose spread is the verdict's noise.
            changes = (
                [c - b for c, b in zip(label_scores(items, cand_items), label_scores(items, base_items))]
                if info.method == "kto"
                else [c[0] / max(c[1], 1) - b[0] / max(b[1], 1) for c, b in zip(cand_items, base_items)]
                if info.method == "sft"
                else []
            )
            held_out = judge(
                info.method,
                cand["score"],
                base["score"],
                info.gate.margin,
                items=len(items),
                baseline_name=base_name,
                slice_name=slice_name,
                item_changes=changes,
            )
        retention_verdict, kept = self._retention(adapter, version, path, info)
        verdict = decide(held_out, retention_verdict, info.gate.thin_evidence)
        score_s = round(time.time() - t0, 3)
        try:
            scores = _version_scores(cand, len(items), score_s, kept)
            written = ray.get(
                self.store.decide_version.remote(
                    adapter,
                    version,
                    VersionVerdict(
                        verdict.passed,
                        verdict.reason,
                        scores,
                        baseline_version=base_version if items else None,
                        baseline_score=base.get("score"),
                        counts=verdict.counts,
                    ),
                ),
                timeout=60,
            )
        except VersionConflict as exc:  # promoted (or otherwise decided) through the API meanwhile
            self.warn("gate", exc)
            return
        decided = written.info
        self.spec_changed(adapter)  # a pause the verdict caused takes effect at the next plan
        freshness: list[float] = []
        if decided.state == "served":
            self.load_on_replicas(adapter, written.served_change)
            now = time.time()
            freshness = [round(now - c, 3) for c in job.created]
        self.report(
            adapter,
            GateDecided(
                version,
                decided.state,
                decided.reason,
                decided.score,
                decided.baseline_score,
                decided.baseline_version,
                time.time() - t0,
                time.time(),
                tuple(freshness),
                cand.get("win_rate"),
                cand.get("clpd"),
                cand.get("token_logprob"),
                kept.score if kept else None,
                kept.base if kept else None,
                kept.seconds if kept else None,
            ),
        )

    # ---- the retention check ---------------------------------------------------------------------

    def _retention(
        self, adapter: str, version: int, path: str | None, info: AdapterInfo
    ) -> tuple[Any, RetentionScores | None]:
        """The retention verdict of a version and its scores; (None, None) with ``gate.retention`` off.

        The set (the base model's answers and its scores of them) is built on rank 0 at its first use
        and cached beside the model; each version costs one batched forward pass over the answers,
        itself cached per version. A missing or malformed ``retention_file`` of the adapter's own
        rejects the version with a reason that names the file, rather than serving it unchecked.
        """
        from actors.learning.lora.retention import read_prompts, resolve, token_mean
        from planners.gate import Verdict, judge_retention

        gate = info.gate
        if not gate.retention:
            return None, None
        t0 = time.time()
        file = resolve(gate.retention_file, self.data_path)
        name = (
            "the shipped retention set" if gate.retention_file is None else f"gate.retention_file {gate.retention_file}"
        )
        try:
            read_prompts(file)  # the adapter's own file: its fault, named in the reason, before rank 0 is asked
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = "not found under data_dir" if isinstance(exc, FileNotFoundError) else f"{type(exc).__name__}: {exc}"
            return Verdict(False, f"retention: {name}: {why}"[:500]), None
        rs = self.rank_zero.retention_set(RetentionSetRequest(str(file), name))
        cache_key = (adapter, version, "retention:" + rs.fingerprint)
        if cache_key not in self._scores and len(self._scores) >= self.MAX_CACHED:
            self._scores.clear()
        cached = self._scores.setdefault(cache_key, {})
        if not cached:
            found = self.rank_zero.score_retention(RetentionScoreRequest(adapter, version, path, info.lora, rs.items))
            cached.update(enumerate(found))
        score = token_mean([cached[i] for i in range(len(rs.items))])
        kept = RetentionScores(score, rs.base_score, len(rs.items), round(time.time() - t0, 3))
        return judge_retention(
            score, rs.base_score, gate.retention_margin, prompts=len(rs.items), set_name=rs.name
        ), kept

    def _give_up(self, job: EvalJob, exc: BaseException) -> None:
        """Scoring failed again and again: reject the candidate, with the error as the reason (not served unproven)."""
        try:
            ray.get(
                self.store.decide_version.remote(
                    job.adapter,
                    job.version,
                    VersionVerdict(False, f"the gate could not score it: {type(exc).__name__}: {str(exc)[:300]}"),
                ),
                timeout=60,
            )
        except Exception as again:
            self.warn("gate", again)

    def _score_served(self, job: EvalJob) -> None:
        """Held-out and retention scores of a version served without the gate (the gate off), for the API and the
        metrics: every served version's retention is shown, gated or not."""
        adapter, version = job.adapter, job.version
        t0 = time.time()
        info: AdapterInfo = ray.get(self.store.get_adapter.remote(adapter), timeout=60)
        items, key, _ = self._slice(adapter, info.gate.max_eval_items)
        scores: dict[str, float] = {}
        if items:
            scores, _ = self._score(adapter, version, job.path, info, items, key)
        _, kept = self._retention(adapter, version, job.path, info)
        if not items and kept is None:
            return
        measured = _version_scores(scores, len(items), round(time.time() - t0, 3), kept)
        ray.get(self.store.record_scores.remote(adapter, version, measured), timeout=60)
        self.report(
            adapter,
            VersionScored(
                version, time.time() - t0, scores.get("win_rate"), scores.get("clpd"), scores.get("token_logprob")
            ),
        )


def _version_scores(
    held_out: dict[str, float], items: int, seconds: float, kept: RetentionScores | None
) -> VersionScores:
    """What the store records of a scoring: the held-out scores over ``items``, the retention check's, the seconds."""
    return VersionScores(
        score=held_out.get("score"),
        win_rate=held_out.get("win_rate"),
        clpd=held_out.get("clpd"),
        token_logprob=held_out.get("token_logprob"),
        eval_items=items or None,
        score_s=seconds,
        retention=None if kept is None else kept.score,
        retention_base=None if kept is None else kept.base,
        retention_prompts=None if kept is None else kept.prompts,
    )


def label_scores(items: Any, per_item: Any) -> list[float]:
    """KTO's held-out score per labelled item: its answer's mean token log-likelihood, negated for a thumbs-down
    (higher is better: a version that makes liked answers likelier and disliked ones less likely scores up)."""
    return [(1.0 if getattr(it, "label", True) else -1.0) * (s[0] / max(s[1], 1)) for it, s in zip(items, per_item)]
