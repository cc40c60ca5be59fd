"""A request's prefix-cache salt: the router's per-tenant header and the body's ``cache_salt``.

The router sends ``x-edge-cache-salt`` (the tenant, unless the operator shares the cache across
tenants) and strips that header from clients; a client may add vLLM's ``cache_salt`` field to
keep its own requests apart further. Requests share prefix-cache blocks only when both parts
are equal, so the engine gets one salt (:func:`edgeinfer.shared.block_keys.effective_cache_salt`,
which the router uses too to predict the daemon's block keys).
"""

from __future__ import annotations

from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.fields import Fields
from edgeinfer.shared.block_keys import effective_cache_salt

__all__ = ["CACHE_SALT_HEADER", "body_cache_salt", "effective_cache_salt"]

CACHE_SALT_HEADER = "x-edge-cache-salt"
MAX_CACHE_SALT_CHARS = 256


def body_cache_salt(fields: Fields) -> str | None:
    """The body's ``cache_salt``, as vLLM takes it: absent, or a non-empty string."""
    salt = fields.text("cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise APIError(
            400,
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            param="cache_salt",
        )
    return salt
