"""Fair training turns: which adapter the trainer takes next, rotating across tenants, then within a tenant.

Taking adapters in name order let one tenant's adapters (or one named "0poison") go first every
time; a tenant with many adapters then crowded out a tenant with one. Here the turn passes to the
next tenant after the one served last (tenants in name order, ``None``, an adapter made without
keys, counting as a tenant of its own), and within that tenant to its next adapter after the one
it trained last, so each tenant gets one turn in every round, and each of its adapters one turn
in every round of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class TrainingTurns:
    """Remembers who trained last; :meth:`next` picks among the adapters that can train now."""

    def __init__(self) -> None:
        self.last_tenant: str | None = None
        self.served_any = False
        self.last_of_tenant: dict[str | None, str] = {}

    def next(self, candidates: Iterable[str], tenant_of: Mapping[str, str | None]) -> str | None:
        """The adapter whose turn it is among ``candidates`` (None if there are none)."""
        by_tenant: dict[str | None, list[str]] = {}
        for name in sorted(candidates):
            by_tenant.setdefault(tenant_of.get(name), []).append(name)
        if not by_tenant:
            return None
        tenants = sorted(by_tenant, key=_tenant_key)
        if self.served_any:
            after = [t for t in tenants if _tenant_key(t) > _tenant_key(self.last_tenant)]
            tenant = (after or tenants)[0]
        else:
            tenant = tenants[0]
        names = by_tenant[tenant]
        last = self.last_of_tenant.get(tenant)
        later = [n for n in names if last is None or n > last]
        return (later or names)[0]

    def trained(self, adapter: str, tenant: str | None) -> None:
        """``adapter`` of ``tenant`` had its turn."""
        self.last_tenant, self.served_any = tenant, True
        self.last_of_tenant[tenant] = adapter


def _tenant_key(tenant: str | None) -> tuple[int, str]:
    return (0, "") if tenant is None else (1, tenant)
