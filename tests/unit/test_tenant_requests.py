"""Which adapter a tenant's request reaches (issue 29 item 1): a tenant names its own adapters by their bare names,
the admin names keys, and another tenant's adapter is exactly as absent as a missing one (the completions, chat,
tokenize and detokenize wrappers in deployments/server.py all ask engine_model_for)."""

from __future__ import annotations

import asyncio

from deployments.keys import LOCAL, Principal
from deployments.request_rules import UNKNOWN, adapter_key_for, as_seen_by, engine_model_for, public_model, shown_name

ACME = Principal("acme", False, "k-acme")
BETA = Principal("beta", False, "k-beta")
ADMIN = Principal("admin", True, "k-admin")


def test_a_tenant_names_its_own_adapters_bare_and_the_admin_names_keys():
    assert adapter_key_for(ACME, "support") == "acme/support"
    assert adapter_key_for(ACME, "beta/support") is None  # never another tenant's
    assert adapter_key_for(ADMIN, "acme/support") == "acme/support"
    assert adapter_key_for(LOCAL, "support") == "support"
    assert shown_name(ACME, "acme/support") == "support"
    assert shown_name(ADMIN, "acme/support") == "acme/support"
    assert (
        as_seen_by(ACME, "acme/support v3 was never published; not xacme/y")
        == "support v3 was never published; not xacme/y"
    )
    assert as_seen_by(ADMIN, "acme/support v3") == "acme/support v3"


def test_a_request_reaches_its_tenants_lora_and_nothing_else():
    owners = {
        "acme/support": "acme",
        "beta/support": "beta",
        "beta/beta-secret": "beta",
        "shared": None,
        "acme/unserved": "acme",
    }
    served = {"tiny:acme/support", "tiny:beta/support", "tiny:beta/beta-secret", "tiny:shared", "tiny:operator"}

    async def owner(key: str) -> object:
        return owners.get(key, UNKNOWN)

    def engine(principal: Principal, model: str) -> str | None:
        return asyncio.run(engine_model_for(principal, model, "tiny", owner, served))

    assert engine(ACME, "tiny:support") == "tiny:acme/support"
    assert engine(BETA, "tiny:support") == "tiny:beta/support"
    # Another tenant's adapter, by either name, is exactly as absent as one that does not exist.
    assert engine(ACME, "tiny:beta-secret") is engine(ACME, "tiny:beta/beta-secret") is None
    assert engine(ACME, "tiny:no-such") is None
    assert engine(ACME, "tiny:shared") is None  # made without keys: the admin's
    assert engine(ACME, "tiny:unserved") is None  # its own, but no version served here: vLLM's 404, its name
    assert engine(ACME, "tiny:operator") is None  # loaded outside the store: admins only
    assert engine(ACME, "tiny") == "tiny"
    assert engine(ADMIN, "tiny:acme/support") == "tiny:acme/support"
    assert engine(ADMIN, "tiny:operator") == "tiny:operator"
    assert engine(ADMIN, "tiny:support") == "tiny:support"  # no such key: vLLM's own 404
    assert engine(LOCAL, "tiny:shared") == "tiny:shared"
    # The name an answer carries is the one the client knows.
    assert public_model(ACME, "tiny", "tiny:acme/support") == "tiny:support"
    assert public_model(ADMIN, "tiny", "tiny:acme/support") == "tiny:acme/support"
    assert public_model(ACME, "tiny", "tiny") == "tiny"
