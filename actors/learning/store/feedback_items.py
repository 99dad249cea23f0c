"""A feedback item as the store takes it: its three shapes (SFT sample, label, preference pair), the validation
of a batch, an ``Idempotency-Key``'s rules, and which items an adapter holds out (pure: no database)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from actors.learning.store.models import (
    DEFAULT_MAX_BATCH_ITEMS,
    DEFAULT_MAX_ITEM_BYTES,
    MAX_IDEMPOTENCY_KEY_CHARS,
    InvalidRequest,
    Kind,
    StrictModel,
    pydantic_error,
)

# Feedback as a client sent it (one item or a list; each a JSON object), before validate_feedback checks it.
RawItems: TypeAlias = Sequence[Mapping[str, Any]] | Mapping[str, Any]


def _text(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be blank")
    return v


class ChatTurn(StrictModel):
    """One message of a conversation, as in OpenAI's chat and fine-tuning formats."""

    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1)


class _Prompted(StrictModel):
    """An item's context: a raw ``prompt`` text, or chat ``messages`` that the trainer renders with
    the served model's chat template, so that what is trained is what is served."""

    adapter: str = Field(min_length=1)
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatTurn] | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_context(self) -> _Prompted:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt (raw text) or messages (a chat), not both or neither")
        if self.messages is not None and self.messages[-1].role == "assistant":
            raise ValueError(
                "messages must end with a user (or system) turn; the answer goes in completion, or chosen and rejected"
            )
        return self

    @field_validator("prompt")
    @classmethod
    def _nonblank_prompt(cls, v: str | None) -> str | None:
        return v if v is None else _text(v)

    def context_texts(self) -> tuple[str, ...]:
        return (self.prompt,) if self.prompt is not None else tuple(m.content for m in self.messages or ())

    def messages_json(self) -> str | None:
        return None if self.messages is None else json.dumps([m.model_dump() for m in self.messages])


class SFTItem(_Prompted):
    """One supervised sample: train the adapter to answer the context with ``completion``."""

    completion: str = Field(min_length=1)

    _nonblank = field_validator("completion")(_text)

    @property
    def kind(self) -> Kind:
        return "sft"

    def texts(self) -> tuple[str, ...]:
        return (*self.context_texts(), self.completion)


class LabelItem(_Prompted):
    """One unpaired label (KTO): ``completion`` answered the context well (``label`` true: a thumbs-up) or not."""

    completion: str = Field(min_length=1)
    label: bool

    _nonblank = field_validator("completion")(_text)

    @property
    def kind(self) -> Kind:
        return "label"

    def texts(self) -> tuple[str, ...]:
        return (*self.context_texts(), self.completion)


class PreferenceItem(_Prompted):
    """One preference pair: ``chosen`` is the better answer to the context than ``rejected``."""

    chosen: str = Field(min_length=1)
    rejected: str = Field(min_length=1)

    _nonblank = field_validator("chosen", "rejected")(_text)

    @property
    def kind(self) -> Kind:
        return "preference"

    def texts(self) -> tuple[str, ...]:
        return (*self.context_texts(), self.chosen, self.rejected)


def idempotency_key_problem(key: str) -> str | None:
    """Why ``key`` cannot be an ``Idempotency-Key`` (None: it can): 1 to 255 printable ASCII characters."""
    if not isinstance(key, str) or not key:
        return "Idempotency-Key: must not be empty"
    if len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        return f"Idempotency-Key: {len(key)} characters, at most {MAX_IDEMPOTENCY_KEY_CHARS}"
    if not all(" " <= c <= "~" for c in key):
        return "Idempotency-Key: only printable ASCII characters"
    return None


def validate_feedback(
    items: Sequence[Mapping[str, Any]] | Mapping[str, Any],
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES,
    max_items: int = DEFAULT_MAX_BATCH_ITEMS,
) -> list[SFTItem | PreferenceItem | LabelItem]:
    """Validate every item of a batch; raise :class:`InvalidRequest` listing each bad item by index."""
    if isinstance(items, Mapping):
        items = [items]
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise InvalidRequest("items: expected a list of feedback items")
    if not items:
        raise InvalidRequest("items: the list is empty")
    if len(items) > max_items:
        raise InvalidRequest(f"items: {len(items)} items, at most {max_items} per request")
    parsed, errors = [], []
    for i, raw in enumerate(items):
        try:
            parsed.append(_parse_item(raw, f"items[{i}]", max_item_bytes))
        except InvalidRequest as e:
            errors.extend(e.errors)
    if errors:
        raise InvalidRequest(errors)
    return parsed


def _parse_item(raw: Any, where: str, max_bytes: int) -> SFTItem | PreferenceItem | LabelItem:
    if isinstance(raw, BaseModel):
        raw = raw.model_dump()
    if not isinstance(raw, Mapping):
        raise InvalidRequest(f"{where}: expected an object, got {type(raw).__name__}")
    raw = _split_final_answer(raw)
    if "label" in raw:
        return _sized(_validated(LabelItem, raw, where), where, max_bytes)
    is_sft = "completion" in raw
    is_pref = "chosen" in raw or "rejected" in raw
    if is_sft and is_pref:
        raise InvalidRequest(
            f"{where}: give either completion (SFT sample) or chosen and rejected (preference pair), not both"
        )
    if not (is_sft or is_pref):
        raise InvalidRequest(f"{where}: needs completion (SFT sample) or chosen and rejected (preference pair)")
    return _sized(_validated(SFTItem if is_sft else PreferenceItem, raw, where), where, max_bytes)


def _validated(model: type[_Prompted], raw: Mapping[str, Any], where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise InvalidRequest([pydantic_error(where, err) for err in e.errors()]) from None


def _sized(item: Any, where: str, max_bytes: int) -> Any:
    """``item``, unless its text is over ``max_bytes`` or not valid Unicode (:class:`InvalidRequest`)."""
    size = 0
    for name, text in zip(_text_fields(item), item.texts()):
        try:
            size += len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidRequest(f"{where}.{name}: not valid Unicode text (lone surrogate)") from None
    if size > max_bytes:
        raise InvalidRequest(f"{where}: {size} bytes of text, more than the limit of {max_bytes}")
    return item


def _text_fields(item: SFTItem | PreferenceItem) -> tuple[str, ...]:
    """The names of ``item.texts()``, in order, for error messages."""
    context = (
        ("prompt",) if item.messages is None else tuple(f"messages[{i}].content" for i in range(len(item.messages)))
    )
    return (*context, "completion") if item.kind in ("sft", "label") else (*context, "chosen", "rejected")


def _split_final_answer(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """OpenAI's fine-tuning shape (``messages`` ending with the assistant's answer, no ``completion``)
    becomes ``messages`` + ``completion``."""
    msgs = raw.get("messages")
    if (
        "completion" in raw
        or "chosen" in raw
        or "rejected" in raw
        or not isinstance(msgs, list)
        or len(msgs) < 2
        or not isinstance(msgs[-1], Mapping)
        or msgs[-1].get("role") != "assistant"
    ):
        return raw
    return {**raw, "messages": msgs[:-1], "completion": msgs[-1].get("content")}


_GOLDEN = (5**0.5 - 1) / 2


def is_held_out(n: int, share: float) -> bool:
    """Whether an adapter's ``n``-th feedback item (1-based) belongs to its held-out slice.

    The fractional parts of n·φ (a Weyl sequence) spread evenly over [0, 1) in every prefix, so any
    run of items holds out close to ``share`` of them, with no period that a client's batches could
    line up with; with a share up to 0.2 the first four items are always trained. It depends only on
    n, so the assignment is the same after a restart (and it is stored with the item anyway).
    """
    return share > 0 and (n * _GOLDEN) % 1.0 < share
