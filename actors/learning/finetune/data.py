"""The job's training items: ``/v1/feedback`` item shapes, validated with the feedback store's own pydantic models.

A line of the JSONL file is one item as ``POST /v1/feedback`` takes it (``prompt`` or ``messages``,
then ``completion`` for SFT or ``chosen`` + ``rejected`` for DPO); ``adapter`` may be left out (the
job names the adapter). The driver checks the whole file before any worker starts, so a bad line is
one error naming its line number, not a worker failure an epoch later.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from actors.learning.store.feedback_items import PreferenceItem, SFTItem, validate_feedback
from actors.learning.store.models import KIND_FOR_METHOD, KIND_NAMES, METHOD_TAKES, InvalidRequest

_ITEM_PREFIX = re.compile(r"^items\[0\]\.?:?\s*")


class DataFileError(ValueError):
    """The data file has bad lines; the message names each (line number and field)."""


def as_item(row: Mapping[str, Any], adapter: str, method: str) -> SFTItem | PreferenceItem:
    """One row (a JSON object, or a Ray Data row) as a validated item of the kind ``method`` trains on."""
    row = {k: _plain(v) for k, v in row.items() if v is not None}  # Ray Data fills a column a row lacks with null
    row.setdefault("adapter", adapter)
    item = validate_feedback([row], max_items=1)[0]
    if item.kind != KIND_FOR_METHOD[method]:
        raise InvalidRequest(f"{KIND_NAMES[item.kind]}, but a {method} adapter trains on {METHOD_TAKES[method]}")
    return item


def read_items(path: str | Path, adapter: str, method: str, max_errors: int = 20) -> list[SFTItem | PreferenceItem]:
    """Every item of the JSONL file at ``path``; :class:`DataFileError` lists bad lines (blank lines are skipped)."""
    items, errors = [], []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataFileError(f"{path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            if not isinstance(raw, dict):
                raise InvalidRequest(f"expected a JSON object, got {type(raw).__name__}")
            items.append(as_item(raw, adapter, method))
        except json.JSONDecodeError as exc:
            errors.append(f"line {number}: not JSON ({exc.msg})")
        except InvalidRequest as exc:
            # validate_feedback names the one item items[0]; here it is a line of the file.
            errors.extend(f"line {number}: {_ITEM_PREFIX.sub('', e)}" for e in exc.errors)
    if errors:
        shown = errors[:max_errors]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        raise DataFileError(f"{path}: {len(errors)} bad item(s):\n  " + "\n  ".join(shown) + more)
    if not items:
        raise DataFileError(f"{path}: no items")
    return items


def item_dict(item: SFTItem | PreferenceItem) -> dict[str, Any]:
    """The item as the training steps read it (plain dicts: ``prompted_text`` indexes chat turns by key)."""
    return item.model_dump()


def _plain(value: Any) -> Any:
    """A Ray Data value as plain Python: numpy arrays (a list column, e.g. ``messages``) become lists."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value
