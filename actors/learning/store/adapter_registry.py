"""AdapterRegistry: the feedback store's methods that create, change and list adapters (the ``adapters`` table)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from actors.learning.store.connection import StoreConnection, validate_as
from actors.learning.store.models import (
    AdapterExists,
    AdapterQuotaExceeded,
    AdapterSpec,
    FullUnitExists,
    GateOverrides,
    GateSettings,
    InvalidRequest,
    UnknownAdapter,
    adapter_key,
    split_adapter_key,
)
from actors.learning.store.records import AdapterInfo
from actors.learning.store.schema import ADAPTER_COLUMNS, UPDATABLE
from actors.learning.store.unit_kind import unit_kind


class AdapterRegistry(StoreConnection):
    """Adapters (and the full unit): one row each, keyed by ``tenant/name``."""

    def create_adapter(self, spec: AdapterSpec | Mapping[str, Any]) -> AdapterInfo:
        """Register a new adapter under its key ``adapter_key(spec.tenant, spec.name)`` (what every other method
        takes as its name); :class:`AdapterExists` (409) if its tenant has one of that name already (another
        tenant's of the same name is another adapter), :class:`AdapterQuotaExceeded` (403) if its tenant owns
        ``max_adapters_per_tenant`` already."""
        spec = validate_as(AdapterSpec, spec, "adapter")
        key = adapter_key(spec.tenant, spec.name)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM adapters WHERE name = ?", (key,)).fetchone():
                raise AdapterExists(f"adapter {spec.name!r} already exists")
            cap = self.max_adapters_per_tenant
            # Counted in the insert's transaction: concurrent creates cannot both take the last place.
            if (
                cap is not None
                and db.execute("SELECT COUNT(*) FROM adapters WHERE tenant IS ?", (spec.tenant,)).fetchone()[0] >= cap
            ):
                owner = f"tenant {spec.tenant!r}" if spec.tenant is not None else "this deployment (no API keys)"
                raise AdapterQuotaExceeded(
                    f"{owner} has {cap} adapters, the most limits.adapters_per_tenant allows; "
                    "the operator can raise the limit"
                )
            kind = unit_kind(spec.method)
            if kind.one_per_deployment:
                # A full unit changes the base model every request is served with: one per deployment.
                methods = sorted(kind.methods)
                other = db.execute(
                    f"SELECT name FROM adapters WHERE method IN ({','.join('?' * len(methods))})", methods
                ).fetchone()
                if other:
                    raise FullUnitExists(
                        f"full unit {other[0]!r} already trains this deployment's model; "
                        "at most one full_sft/full_dpo unit per deployment"
                    )
            db.execute(
                f"INSERT INTO adapters ({ADAPTER_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    key,
                    spec.method,
                    spec.beta,
                    spec.learning_rate,
                    spec.lora.r,
                    spec.lora.alpha,
                    json.dumps(spec.lora.target_modules),
                    spec.lora.dropout,
                    spec.mode,
                    spec.periodic.every_seconds,
                    spec.periodic.every_samples,
                    None,
                    time.time(),
                    spec.epochs,
                    spec.tenant,
                    spec.warmup_steps,
                    int(spec.store_completions),
                ),
            )
            db.execute("UPDATE adapters SET gate = ? WHERE name = ?", (_overrides_json(spec.gate), key))
            return self._adapter_info(db, key)

    def update_adapter(self, name: str, changes: Mapping[str, Any]) -> AdapterInfo:
        """Change how an adapter trains from now on: ``mode``, ``learning_rate``, ``beta``, ``periodic``,
        ``gate`` (the fields given replace the adapter's own; a null goes back to training.gate's) or
        ``paused`` (false resumes training paused by the gate and forgets its rejections in a row; true pauses).

        ``method`` and ``lora`` are fixed at creation (every version shares them), so changing them is
        an :class:`InvalidRequest`; :class:`UnknownAdapter` (404) if there is no such adapter.
        """
        if not isinstance(changes, Mapping) or not changes:
            raise InvalidRequest("body: a JSON object with at least one of " + ", ".join(sorted(UPDATABLE)))
        fixed = sorted(set(changes) - UPDATABLE)
        if fixed:
            raise InvalidRequest(
                [f"{k}: cannot be changed after creation (updatable: {', '.join(sorted(UPDATABLE))})" for k in fixed]
            )
        with self._tx() as db:
            info = self._adapter_info(db, name)
            current = info.model_dump(
                include={"method", "beta", "learning_rate", "lora", "mode", "periodic", "epochs", "warmup_steps"}
            )
            current["name"] = split_adapter_key(name)[1]  # a spec names the adapter without its tenant
            if "periodic" in changes and isinstance(changes["periodic"], Mapping):
                changes = {**changes, "periodic": {**current["periodic"], **changes["periodic"]}}
            gate_changes, paused = changes.get("gate"), changes.get("paused")
            changes = {k: v for k, v in changes.items() if k not in ("gate", "paused")}
            spec = validate_as(AdapterSpec, {**current, **changes}, "adapter")
            gate = self._gate_overrides(db, name)
            if gate_changes is not None:
                if not isinstance(gate_changes, Mapping):
                    raise InvalidRequest("gate: expected an object of gate settings")
                merged = {**gate.model_dump(exclude_none=True), **gate_changes}
                gate = validate_as(GateOverrides, {k: v for k, v in merged.items() if v is not None}, "gate")
            if paused is not None and not isinstance(paused, bool):
                raise InvalidRequest("paused: expected true or false")
            db.execute(
                "UPDATE adapters SET mode = ?, learning_rate = ?, beta = ?, periodic_every_seconds = ?, "
                "periodic_every_samples = ?, gate = ?, epochs = ?, warmup_steps = ? WHERE name = ?",
                (
                    spec.mode,
                    spec.learning_rate,
                    spec.beta,
                    spec.periodic.every_seconds,
                    spec.periodic.every_samples,
                    _overrides_json(gate),
                    spec.epochs,
                    spec.warmup_steps,
                    name,
                ),
            )
            if paused is False:
                db.execute("UPDATE adapters SET paused_reason = NULL, rejections_in_row = 0 WHERE name = ?", (name,))
            elif paused is True and info.paused_reason is None:
                db.execute(
                    "UPDATE adapters SET paused_reason = ? WHERE name = ?",
                    ('paused through PATCH /v1/adapters (send {"paused": false} to resume)', name),
                )
            return self._adapter_info(db, name)

    def pause_adapter(self, name: str, reason: str) -> AdapterInfo:
        """Pause one adapter's training with ``reason`` (its fault, e.g. a version that does not load);
        the others train on. A PATCH with ``{"paused": false}`` resumes it. :class:`UnknownAdapter` (404)."""
        with self._tx() as db:
            self._adapter_info(db, name)
            db.execute("UPDATE adapters SET paused_reason = ? WHERE name = ?", (reason[:2000], name))
            return self._adapter_info(db, name)

    def get_adapter(self, name: str) -> AdapterInfo:
        """The adapter with its published versions and queue state; :class:`UnknownAdapter` (404)."""
        with self._tx(write=False) as db:
            return self._adapter_info(db, name)

    def adapter_tenant(self, name: str) -> str | None:
        """The tenant that owns adapter ``name`` (None: made without keys); :class:`UnknownAdapter` (404)."""
        with self._tx(write=False) as db:
            row = db.execute("SELECT tenant FROM adapters WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise UnknownAdapter(f"no adapter named {name!r}")
        return row[0]

    def list_adapters(self) -> list[AdapterInfo]:
        """Every adapter, by name."""
        with self._tx(write=False) as db:
            names = [r[0] for r in db.execute("SELECT name FROM adapters ORDER BY name")]
            return [self._adapter_info(db, n) for n in names]

    def gate_settings(self, adapter: str) -> GateSettings:
        """The gate settings in effect for ``adapter``: its own over the app's defaults."""
        with self._tx(write=False) as db:
            return self._gate_overrides(db, adapter).over(self.gate_defaults)


def _overrides_json(gate: GateOverrides) -> str | None:
    own = gate.model_dump(exclude_none=True)
    return json.dumps(own) if own else None
