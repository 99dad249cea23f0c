"""CompletionRows: the feedback store's stored completions (the ``completions`` table) and the feedback given on them by id.

A chat or completion request with ``"store": true`` (or one to an adapter created with
``store_completions: true``) is kept here with its rendered prompt, its output, its tenant, its adapter, the
adapter version pinned when it was admitted, its sampling parameters and its time. Feedback then names the
completion instead of re-sending it (:meth:`CompletionRows.resolve_feedback_refs`): a rating is a KTO label, a
correction an SFT item on the stored prompt, ``preferred_over`` a DPO pair of two completions of one prompt.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from actors.learning.store.connection import StoreConnection
from actors.learning.store.models import RATINGS, InvalidRequest, StoreError, UnknownItem
from actors.learning.store.schema import COMPLETION_COLUMNS

# The keys a feedback item on a stored completion may hold; exactly one of the last three says what it is.
REF_KEYS = frozenset({"completion_id", "adapter", "rating", "correction", "preferred_over"})
REF_SHAPES = ("rating", "correction", "preferred_over")


class UnknownCompletion(UnknownItem):
    """No stored completion of that id for this tenant (another tenant's is as absent as a missing one)."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a stored chat request, as plain text (the text parts of OpenAI's content list joined)."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling parameters a stored request set, by OpenAI's names; None: the request did not set it."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None

    @classmethod
    def of(cls, request: Any) -> SamplingParams:
        """Those of an OpenAI request object (vLLM's ``ChatCompletionRequest`` or ``CompletionRequest``)."""
        return cls(**{f.name: getattr(request, f.name, None) for f in fields(cls)})

    def given(self) -> dict[str, Any]:
        """The parameters set, as JSON (what is stored and shown: unset ones are left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True, slots=True)
class StoredCompletion:
    """One stored completion as the store keeps it (the HTTP layer shapes it as OpenAI's object)."""

    id: str
    tenant: str
    object: str
    model: str
    adapter: str | None
    version: int | None
    prompt: str
    messages: tuple[ChatMessage, ...] | None
    output: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    params: SamplingParams
    created_at: float

    @classmethod
    def admitted(
        cls,
        tenant: str,
        object: str,
        model: str,
        adapter: str | None,
        version: int | None,
        prompt: str,
        messages: tuple[ChatMessage, ...] | None,
        params: SamplingParams,
    ) -> StoredCompletion:
        """What is known of a request when it is admitted; :meth:`answered` adds the engine's answer."""
        return cls("", tenant, object, model, adapter, version, prompt, messages, "", None, None, None, params, 0.0)

    def answered(
        self,
        completion_id: str,
        output: str,
        finish_reason: str | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        at: float,
    ) -> StoredCompletion:
        """This admitted request with the engine's answer: the record to store."""
        return replace(
            self,
            id=completion_id,
            output=output,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            created_at=at,
        )

    def turns(self) -> list[dict[str, str]] | None:
        """The chat turns as JSON (a feedback item's ``messages``, the stored column, the API's answer)."""
        return None if self.messages is None else [asdict(m) for m in self.messages]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> StoredCompletion:
        (id_, tenant, obj, model, adapter, version, prompt, messages, output, finish, pt, ct, params, created) = row
        turns = None if messages is None else tuple(ChatMessage(**m) for m in json.loads(messages))
        return cls(
            id_,
            tenant,
            obj,
            model,
            adapter,
            version,
            prompt,
            turns,
            output,
            finish,
            pt,
            ct,
            SamplingParams(**json.loads(params)),
            created,
        )


@dataclass(frozen=True, slots=True)
class FeedbackRef:
    """Where a feedback item given by completion id came from: the completion and the version that answered it."""

    completion_id: str
    answered_version: int | None


class CompletionRows(StoreConnection):
    """Stored completions: kept, read and deleted per tenant, aged out after ``limits.store_completions_days``."""

    def store_completion(self, record: StoredCompletion, keep_days: float | None = None) -> None:
        """Keep ``record`` (one transaction; the same id again replaces it). Completions older than ``keep_days``
        go in the same transaction, so retention needs no timer of its own."""
        with self._tx() as db:
            if keep_days is not None:
                db.execute("DELETE FROM completions WHERE created_at < ?", (time.time() - keep_days * 86400.0,))
            db.execute(
                f"INSERT OR REPLACE INTO completions ({COMPLETION_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    record.id,
                    record.tenant,
                    record.object,
                    record.model,
                    record.adapter,
                    record.version,
                    record.prompt,
                    None if record.messages is None else json.dumps(record.turns()),
                    record.output,
                    record.finish_reason,
                    record.prompt_tokens,
                    record.completion_tokens,
                    json.dumps(record.params.given(), sort_keys=True),
                    record.created_at,
                ),
            )

    def get_completion(
        self, completion_id: str, tenant: str | None, keep_days: float | None = None
    ) -> StoredCompletion:
        """The stored completion ``completion_id`` of ``tenant`` (None: local mode); :class:`UnknownCompletion`
        (404) for a missing one, another tenant's, or one older than ``keep_days``."""
        with self._tx(write=False) as db:
            return self._completion(db, completion_id, tenant, keep_days)

    def delete_completion(self, completion_id: str, tenant: str | None) -> None:
        """Delete the tenant's stored completion; :class:`UnknownCompletion` (404) as :meth:`get_completion`.
        Feedback already given on it keeps its own copy of the texts."""
        with self._tx() as db:
            if (
                db.execute(
                    "DELETE FROM completions WHERE id = ? AND tenant = ?", (completion_id, tenant or "")
                ).rowcount
                == 0
            ):
                raise UnknownCompletion(f"no stored completion {completion_id!r}")

    def _completion(
        self, db: Any, completion_id: Any, tenant: str | None, keep_days: float | None = None
    ) -> StoredCompletion:
        if not isinstance(completion_id, str) or not completion_id:
            raise InvalidRequest("completion_id: a completion's id (a string) is required", param="completion_id")
        row = db.execute(
            f"SELECT {COMPLETION_COLUMNS} FROM completions WHERE id = ? AND tenant = ?", (completion_id, tenant or "")
        ).fetchone()
        if row is None or (keep_days is not None and row[-1] < time.time() - keep_days * 86400.0):
            raise UnknownCompletion(f"no stored completion {completion_id!r}")
        return StoredCompletion.from_row(row)

    def resolve_feedback_refs(
        self, items: Sequence[Any], tenant: str | None, keep_days: float | None = None
    ) -> tuple[list[Any], list[FeedbackRef | None]]:
        """Each item that names a ``completion_id`` as the item it stands for, with where it came from.

        - ``{"completion_id", "rating": "up" | "down"}``: a label (KTO) of the completion's answer;
        - ``{"completion_id", "correction": text}``: an SFT item, the correction as the answer to its prompt;
        - ``{"completion_id": A, "preferred_over": B}``: a preference pair, A's answer chosen over B's; both of
          the tenant's and of the same prompt.

        The adapter is the item's ``adapter`` (a store key) or else the completion's; a completion of the base
        model needs one named. Other items pass through unchanged (their ref is None). Raises
        :class:`InvalidRequest` (400) for a malformed reference, :class:`UnknownCompletion` (404) for a
        completion that is missing or another tenant's; every problem of the batch at once, by index.
        """
        single = isinstance(items, Mapping)
        listed = (
            [items] if single else list(items) if isinstance(items, Sequence) and not isinstance(items, str) else None
        )
        if listed is None:
            return items, []
        out: list[Any] = []
        refs: list[FeedbackRef | None] = []
        errors: list[str] = []
        missing: list[str] = []
        with self._tx(write=False) as db:
            for i, raw in enumerate(listed):
                if not isinstance(raw, Mapping) or "completion_id" not in raw:
                    out.append(raw)
                    refs.append(None)
                    continue
                try:
                    item, ref = self._resolve_one(db, raw, tenant, keep_days)
                except UnknownCompletion as exc:
                    missing.append(f"items[{i}]: {exc}")
                    out.append(raw)
                    refs.append(None)
                    continue
                except InvalidRequest as exc:
                    errors.extend(f"items[{i}].{e}" for e in exc.errors)
                    out.append(raw)
                    refs.append(None)
                    continue
                out.append(item)
                refs.append(ref)
        if errors:
            raise InvalidRequest(errors, param=_param(errors[0]))
        if missing:
            raise UnknownCompletion("; ".join(missing[:10]))
        return (out[0] if single else out), refs

    def _resolve_one(
        self, db: Any, raw: Mapping[str, Any], tenant: str | None, keep_days: float | None
    ) -> tuple[dict[str, Any], FeedbackRef]:
        extra = sorted(set(raw) - REF_KEYS)
        if extra:
            raise InvalidRequest(
                f"{extra[0]}: unknown field beside completion_id (an item on a stored completion "
                f"takes {', '.join(sorted(REF_KEYS))})",
                param=extra[0],
            )
        shapes = [k for k in REF_SHAPES if k in raw]
        if len(shapes) != 1:
            raise InvalidRequest(
                "rating: give exactly one of rating (up/down), correction (a text) or preferred_over "
                "(another completion_id) with completion_id",
                param="rating",
            )
        shape = shapes[0]
        value = raw[shape]
        if shape == "rating" and (not isinstance(value, str) or value not in RATINGS):
            raise InvalidRequest('rating: must be "up" or "down"', param="rating")
        if shape == "correction" and (not isinstance(value, str) or not value.strip()):
            raise InvalidRequest("correction: a non-blank text is required", param="correction")
        if shape == "preferred_over" and (not isinstance(value, str) or value == raw["completion_id"]):
            raise InvalidRequest(
                "preferred_over: the id of another stored completion of the same prompt", param="preferred_over"
            )
        done = self._completion(db, raw["completion_id"], tenant, keep_days)
        if shape != "correction" and not done.output.strip():
            raise InvalidRequest(
                f"completion_id: completion {done.id!r} answered nothing (an empty answer); there "
                "is nothing to rate or prefer",
                param="completion_id",
            )
        adapter = raw.get("adapter", done.adapter)
        if not isinstance(adapter, str) or not adapter:
            raise InvalidRequest(
                "adapter: the completion was answered by the base model; name the adapter to train", param="adapter"
            )
        context: dict[str, Any] = {"messages": done.turns()} if done.messages is not None else {"prompt": done.prompt}
        item: dict[str, Any] = {"adapter": adapter, **context}
        if shape == "rating":
            item.update(completion=done.output, label=RATINGS[value])
        elif shape == "correction":
            item.update(completion=value)
        else:
            other = self._completion(db, value, tenant, keep_days)
            if (other.prompt, other.messages) != (done.prompt, done.messages):
                raise InvalidRequest(
                    f"preferred_over: completion {value!r} answered another prompt than "
                    f"{done.id!r}; a preference pair compares two answers to one prompt",
                    param="preferred_over",
                )
            item.update(chosen=done.output, rejected=other.output)
        # The base model's answer is the adapter's version 0 (a fresh LoRA adds nothing); another adapter's: unknown.
        answered = done.version if done.adapter == adapter else 0 if done.adapter is None else None
        return item, FeedbackRef(done.id, answered)

    def prune_completions(self, keep_days: float) -> int:
        """Delete completions older than ``keep_days``; how many went."""
        with self._tx() as db:
            return db.execute(
                "DELETE FROM completions WHERE created_at < ?", (time.time() - keep_days * 86400.0,)
            ).rowcount


def _param(error: str) -> str | None:
    """The field an ``items[i].field: ...`` message is about."""
    head = error.split(":", 1)[0]
    return head.split(".", 1)[1] if "." in head else None


__all__ = ["CompletionRows", "FeedbackRef", "StoredCompletion", "StoreError", "UnknownCompletion"]
