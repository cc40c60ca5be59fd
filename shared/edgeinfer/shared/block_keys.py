"""Prefix-cache block keys: one implementation for the engine that caches and the router that
predicts its hits.

A prompt is cut into full blocks of ``block_size`` tokens; each block's key is a digest of its
tokens chained over its parent's key, so a key stands for the whole prefix up to it. A request's
cache salt seeds the chain: the first block's parent is a key derived from the salt instead of
the root, so salted requests share blocks only with requests of the same salt.

The salt itself combines two parts (the router's trusted per-tenant header and the body's
optional ``cache_salt``, vLLM's field) into one digest of the length-prefixed pair, in which no
choice of the two strings can stand for another pair; a fixed-size digest also keeps the
tenant's name off the KV wire.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_KEY = b"edgeinfer-kv-v1"
# blake2b's personalisation string: salt keys live in a hash domain of their own, so no chain
# of block hashes (which has none) can ever produce one.
_SALT_PERSON = b"edgeinfer-salt"


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Content hash of a full block, chained over its parent so equal blocks at different
    prefixes never collide. A cryptographic digest: a crafted prompt cannot poison the cache."""
    h = hashlib.blake2b(parent or ROOT_KEY, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def salt_key(cache_salt: str | None) -> bytes | None:
    """The parent key of a salted sequence's first block (None: the shared, unsalted root)."""
    if cache_salt is None:
        return None
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=_SALT_PERSON).digest()


def effective_cache_salt(header: str | None, body: str | None) -> str | None:
    """The engine's salt for a request from the router's header and the body's ``cache_salt``:
    None when neither part is set (the shared cache)."""
    header = header or None  # an empty header names no tenant
    if header is None and body is None:
        return None
    h = hashlib.blake2b(digest_size=16)
    for part in (header, body):
        if part is None:
            h.update(b"\x00")
        else:
            raw = part.encode(errors="surrogatepass")  # injective, never raises
            h.update(b"\x01" + len(raw).to_bytes(8, "big") + raw)
    return h.hexdigest()


def chain_keys(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None, limit: int | None = None
) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` (at most ``limit``), as the engine registers
    them for a sequence salted with ``cache_salt`` (already combined: see above)."""
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    keys: list[bytes] = []
    parent = salt_key(cache_salt)
    ids = np.asarray(token_ids[: n * block_size], dtype=np.int64)
    for i in range(n):
        # One digest per block over the array's bytes: the same bytes block_hash hashes.
        h = hashlib.blake2b(parent or ROOT_KEY, digest_size=16)
        h.update(ids[i * block_size : (i + 1) * block_size].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys
