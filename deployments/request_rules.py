"""The rules a request is read by, said once: the names a principal gives adapters and models, and the output
length of a request that names none. The placement router and the model server both import them, so the
router plans with the name and the length the replica will use."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from actors.learning.store.models import ADAPTER_NAME_RE, adapter_key, split_adapter_key
from deployments.keys import Principal

UNKNOWN = object()  # the owner of an adapter that does not exist
# A completion that names no length gets OpenAI's (and vLLM's) 16 tokens; a chat gets limits.max_tokens.
COMPLETION_DEFAULT_MAX_TOKENS = 16


def adapter_key_for(principal: Principal, name: str) -> str | None:
    """The store's key of the adapter a request of ``principal`` names ``name``. An admin (and local mode) names
    keys: ``acme/support``, or the bare name of an adapter without a tenant or of the admin's own. A tenant names
    its own adapters by their bare names: acme's ``support`` is the key ``acme/support``. None: a name that
    cannot be one of the tenant's (one with a '/', say): as absent as any other tenant's."""
    if principal.admin:
        return name
    if principal.tenant is None or not isinstance(name, str) or not ADAPTER_NAME_RE.match(name):
        return None
    return adapter_key(principal.tenant, name)


def shown_name(principal: Principal, key: str) -> str:
    """The name ``principal`` knows the adapter keyed ``key`` by: a tenant its own by their bare names, an admin
    (and local mode) by the key (the inverse of :func:`adapter_key_for`)."""
    if principal.admin:
        return key
    tenant, name = split_adapter_key(key)
    return name if tenant is not None and tenant == principal.tenant else key


def as_seen_by(principal: Principal, text: str) -> str:
    """``text`` (a store error's message) as ``principal`` reads it: a tenant's own keys without the tenant."""
    if principal.admin or not principal.tenant:
        return text
    return re.sub(rf"(?<![a-z0-9_-]){re.escape(principal.tenant)}/", "", text)


def engine_model_name(principal: Principal, model: str) -> str:
    """The engine's name of the model a request names, by name alone (the router's view): a tenant's
    ``base:support`` is ``base:acme/support``. A name the principal may not use stays as sent: placement treats
    it as unknown, and the replica (:func:`engine_model_for`, which also asks the store) answers 404."""
    base, sep, name = model.partition(":")
    if not sep or principal.tenant is None and not principal.admin:
        return model
    key = adapter_key_for(principal, name)
    return model if key is None else f"{base}:{key}"


async def engine_model_for(
    principal: Any, model: str, base: str, owner: Callable[[str], Awaitable[Any]], served: Any
) -> str | None:
    """The engine's name for the model ``principal`` names ``model`` in a request, or None where that is an
    adapter the principal may not use or this node does not serve: the request then gets the 404 vLLM gives a
    model it does not have, whether the adapter is another tenant's or none at all. A tenant names its own
    adapters by their bare names (acme's ``base:support`` is the engine's ``base:acme/support``); an admin
    names keys. ``owner(key)``: the owning tenant or UNKNOWN (LearningRoutes.owner); ``served``: the
    engine's LoRA names (vLLM's ``lora_requests``)."""
    if not model.startswith(base + ":"):
        return model
    key = adapter_key_for(principal, model[len(base) + 1 :])
    found = UNKNOWN if key is None else await owner(key)
    if found is UNKNOWN:
        # Not in the store: an operator's adapter (the admin may call it; vLLM answers), or none at all.
        return model if principal.admin else None
    if not principal.may_use(found):
        return None
    return f"{base}:{key}" if f"{base}:{key}" in served else None


def public_model(principal: Any, base: str, model: str) -> str:
    """The model id ``principal`` knows the engine's ``model`` by: ``base:support`` for tenant acme's
    ``base:acme/support``; the admin (and local mode) the engine's own name."""
    if not model.startswith(base + ":"):
        return model
    return f"{base}:{shown_name(principal, model[len(base) + 1 :])}"


def default_max_tokens(request: Any, cap: int) -> None:
    """Give a chat or completion request that names no output length ``cap`` as its length.

    vLLM's own default for chat is the room the prompt leaves in the context: a client that sends no
    ``max_tokens`` (or a null one) must not hold the engine for a whole context. A completion's is 16 (vLLM
    fills an absent or null one with it before this runs), capped here too where ``cap`` is less. A length the
    client names is left as it is (over limits.max_tokens it is a 400). Set before vLLM sees the request: its
    ``get_max_tokens`` then takes the least of this and the room the prompt leaves."""
    fields = type(request).model_fields
    if "max_completion_tokens" in fields:  # chat; its max_tokens is deprecated, the older name of the same
        if request.max_completion_tokens is None and request.max_tokens is None:
            request.max_completion_tokens = cap
    elif "max_tokens" in fields:
        default = fields["max_tokens"].default
        if request.max_tokens is None or (request.max_tokens == default and default > cap):
            request.max_tokens = cap


def default_output_tokens(
    chat: bool, max_tokens_limit: int, max_model_len: int, model_default: int | None = None
) -> int:
    """The output length of a request that names none: for a chat ``limits.max_tokens`` (or the model's
    generation config's, where less), for a completion 16 as vLLM and OpenAI give it, capped by the same; never
    past the context. vLLM then takes the least of this and the room the prompt leaves (``get_max_tokens``)."""
    cap = min(max_tokens_limit, max_model_len, model_default or max_tokens_limit)
    return cap if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, cap)
