"""API keys and tenants: keys are kept only as SHA-256 digests, and a request's bearer key names its tenant.

A key belongs to one tenant; the tenant named ``admin`` is the operator. Keys are random 256-bit
strings made by ``python -m deployments.keys add``, so one SHA-256 digest is as good as a slow password
hash here and lets every request be checked with one dictionary lookup. Keys come from a YAML
file (``auth.keys_file``)::

    keys:
      - {tenant: acme, sha256: 5f1c...}
      - {tenant: admin, sha256: 9e2a...}

and from an environment variable (``auth.keys_env``, ``COSERVE_API_KEYS`` by default) of
``tenant=key`` or ``tenant=sha256:<hex>`` entries separated by commas, hashed as they are read.
With no key anywhere, the app runs in local mode: one user with every right, on loopback only.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from settings import ADMIN_TENANT

TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
KEY_PREFIX = "sk-coserve-"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def digest(key: str) -> str:
    """The SHA-256 hex digest a key is stored as."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who sent a request: a tenant (``None`` in local mode) and whether it may manage everything."""

    tenant: str | None
    admin: bool
    key_id: str  # the digest's first 12 hex digits: names the key in limits and logs, never the key

    def may_use(self, owner: str | None) -> bool:
        """Whether this principal may call, train or read an adapter owned by ``owner``."""
        return self.admin or (owner is not None and owner == self.tenant)

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of this principal's tenant (vLLM's ``cache_salt``), assigned by the server:
        requests of one tenant share cached prefixes, other tenants' never match them (CVE-2025-46570)."""
        return hashlib.sha256(f"coserve-prefix-cache:{self.tenant or ''}".encode()).hexdigest()[:32]


LOCAL = Principal(tenant=None, admin=True, key_id="local")


class KeysConfigError(ValueError):
    """A malformed keys file or variable (raised at start-up, with where and why)."""


class KeyRing:
    """The configured keys, as digest -> tenant."""

    def __init__(self, tenants_by_digest: Mapping[str, str]) -> None:
        self._by_digest = dict(tenants_by_digest)

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    @property
    def tenants(self) -> set[str]:
        return set(self._by_digest.values())

    def identify(self, key: str | None) -> Principal | None:
        """The principal of a presented key, or None for a missing or unknown key."""
        if not key:
            return None
        d = digest(key)
        tenant = self._by_digest.get(d)
        if tenant is None:
            return None
        return Principal(tenant=tenant, admin=tenant == ADMIN_TENANT, key_id=d[:12])

    @classmethod
    def load(
        cls,
        keys_file: str | Path | None,
        keys_env: str | None,
        data_path: Path,
        environ: Mapping[str, str] | None = None,
    ) -> KeyRing:
        """Keys from the file and the environment variable named in the config (either may be absent)."""
        environ = os.environ if environ is None else environ
        found: dict[str, str] = {}
        if keys_file:
            path = Path(keys_file).expanduser()
            path = path if path.is_absolute() else data_path / path
            if not path.is_file():
                raise KeysConfigError(f"auth.keys_file {str(path)!r} does not exist")
            found.update(_parse_file(path))
        if keys_env and environ.get(keys_env):
            found.update(_parse_env(keys_env, environ[keys_env]))
        return cls(found)


def _entry(tenant: object, value: str, hashed: bool, where: str) -> tuple[str, str]:
    if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
        raise KeysConfigError(f"{where}: tenant {tenant!r} must match {TENANT_RE.pattern}")
    if hashed:
        if not _HEX64.match(value):
            raise KeysConfigError(f"{where}: sha256 must be 64 lowercase hex digits")
        return value, tenant
    if len(value) < 16:
        raise KeysConfigError(f"{where}: a key must be at least 16 characters")
    return digest(value), tenant


def _parse_file(path: Path) -> dict[str, str]:
    import yaml

    raw = yaml.safe_load(path.read_text()) or {}
    entries = raw.get("keys") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise KeysConfigError(f"{path}: expected a mapping with a `keys` list")
    out: dict[str, str] = {}
    for i, e in enumerate(entries):
        where = f"{path}: keys[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("sha256"), str):
            raise KeysConfigError(f"{where}: expected {{tenant: <name>, sha256: <hex digest>}}")
        d, tenant = _entry(e.get("tenant"), e["sha256"], True, where)
        out[d] = tenant
    return out


def _parse_env(name: str, value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, part in enumerate(p.strip() for p in value.split(",")):
        if not part:
            continue
        tenant, sep, key = part.partition("=")
        if not sep:
            raise KeysConfigError(f"${name} entry {i}: expected tenant=key or tenant=sha256:<hex>")
        hashed = key.startswith("sha256:")
        d, tenant = _entry(tenant.strip(), key.removeprefix("sha256:").strip(), hashed, f"${name} entry {i}")
        out[d] = tenant
    return out


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def bind_refusal(host: str, keys_enabled: bool, allow_unauthenticated: bool) -> str | None:
    """Why the app must not serve HTTP on ``host`` (None: it may). Without keys every client has
    every right, so only loopback, unless an authenticating proxy in front is declared."""
    if keys_enabled or host in LOOPBACK_HOSTS or allow_unauthenticated:
        return None
    return (
        f"Refusing to serve on {host} without API keys: anyone who reaches it could train, roll back and call "
        "every adapter. Configure auth.keys_file or the auth.keys_env variable (python -m deployments.keys add), bind "
        "http_options.host to 127.0.0.1, or set auth.allow_unauthenticated_bind behind an authenticating proxy."
    )


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def add_key(path: Path, tenant: str) -> str:
    """Append a new key of ``tenant`` to the keys file (created if absent, mode 0600); returns the key."""
    import yaml

    _entry(tenant, "x" * 16, False, "tenant")
    raw = yaml.safe_load(path.read_text()) if path.is_file() else None
    raw = raw or {"keys": []}
    key = new_key()
    raw.setdefault("keys", []).append({"tenant": tenant, "sha256": digest(key)})
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.keys", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="make a key for a tenant, store its digest in the file, print the key once")
    a.add_argument("--file", required=True, type=Path, help="the keys file (auth.keys_file)")
    a.add_argument("--tenant", required=True, help=f"tenant name ({ADMIN_TENANT!r} is the operator)")
    h = sub.add_parser("hash", help="print the sha256 digest of a key read from stdin")
    h.set_defaults(file=None)
    args = p.parse_args(argv)
    if args.cmd == "add":
        try:
            print(add_key(args.file, args.tenant))
        except KeysConfigError as exc:
            print(exc, file=sys.stderr)
            return 2
        return 0
    print(digest(sys.stdin.readline().strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
