"""The most characters of a prompt one token can stand for: a token count's lower bound, free.

A text of N characters holds at least N / B tokens when no token covers more than B of its
characters, so a 16 MiB prompt sent to a 2,048-token model is refused on ``len()`` alone, before
a chat template renders it or a tokenizer reads it (both O(N), tens of ms of CPU each).

B is read once per tokenizer from its ``tokenizer.json``, and only where the bound is sound:
every character must reach some token (a BPE whose alphabet holds all 256 bytes, byte-level or
byte fallback: no unknown character is dropped or fused into one ``<unk>``) and no stage may
delete text (whitespace-removing pre-tokenizers, ``Strip``, added tokens that swallow the
whitespace beside them, truncation). Everything else gets no bound (None) and keeps the
prefix probing of :mod:`~edgeinfer.daemon.api.prompt_length`, which is sound for any tokenizer.

B = (the longest token, in UTF-8 bytes of the text it matches) x (the most a normalizer can
shrink the text). A character is at least one UTF-8 byte, so characters stand in for bytes
without encoding the text. Normalization factors, per code point (a sweep over all of Unicode,
``tests/test_token_bytes.py``): NFC and NFD shrink at most 3x (U+1FEF, 3 bytes, is U+0060,
1 byte; Hangul jamo L+V+T, 9 bytes, compose to one 3-byte syllable), NFKC and NFKD 4x
(a 4-byte character can become one ASCII letter).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

from tokenizers.pre_tokenizers import ByteLevel

from edgeinfer.daemon.engine.tokenizer import Tokenizer

_NORMALIZER_SHRINK = {"NFC": 3.0, "NFD": 3.0, "NFKC": 4.0, "NFKD": 4.0, "Prepend": 1.0}
# Pre-tokenizers that split or map the text without removing any of it (Split, Punctuation
# and Digits keep it unless their behavior is "Removed", checked below).
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Split", "Punctuation", "Digits", "UnicodeScripts"}
)
_BYTE_FALLBACK_TOKENS = [f"<0x{b:02X}>" for b in range(256)]

_cache: weakref.WeakKeyDictionary[Tokenizer, int | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def chars_per_token_bound(tokenizer: Tokenizer) -> int | None:
    """B: no token of ``tokenizer`` stands for more than B characters of a text; None when
    the tokenizer has no such bound (see the module docstring). Computed once per tokenizer
    (parsing ``tokenizer.json``: ~0.1 s for a 50k vocabulary), the first time it is asked."""
    with _lock:
        if tokenizer in _cache:
            return _cache[tokenizer]
        bound = bound_of_spec(tokenizer.spec())
        _cache[tokenizer] = bound
        return bound


def min_tokens(chars: int, bound: int) -> int:
    """The fewest tokens a text of ``chars`` characters can hold, given B = ``bound``."""
    return -(-chars // bound)


def bound_of_spec(spec: dict[str, Any]) -> int | None:
    """B for the tokenizer that the parsed ``tokenizer.json`` document ``spec`` describes."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation") is not None:
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    if shrink is None or not _keeps_text(pre):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    byte_level = _has_byte_level(pre)
    if byte_level:
        # Every byte maps to one character of this alphabet, so a token of k characters
        # matches k bytes of the text.
        if not all(c in vocab for c in ByteLevel.alphabet()):
            return None
        longest = max(len(token) for token in vocab)
    elif model.get("byte_fallback") and all(t in vocab for t in _BYTE_FALLBACK_TOKENS):
        longest = max(len(token.encode()) for token in vocab)
    else:
        return None
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return None  # the token also swallows any run of whitespace beside it
        longest = max(longest, len(str(added.get("content", "")).encode()))
    return math.ceil(longest * shrink)


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> float | None:
    """How many times shorter (in UTF-8 bytes) ``normalizer`` can make a text; None: any."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1.0
        for inner in normalizer.get("normalizers") or []:
            shrink = _normalizer_shrink(inner)
            if shrink is None:
                return None
            total *= shrink
        return total
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content")
        if not isinstance(pattern, str) or not isinstance(content, str) or not content:
            return None  # a regex, or a deletion
        return max(len(pattern.encode()) / len(content.encode()), 1.0)
    return _NORMALIZER_SHRINK.get(str(kind))


def _keeps_text(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_text(inner) for inner in pre.get("pretokenizers") or [])
    return pre.get("type") in _KEEPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def _has_byte_level(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_has_byte_level(inner) for inner in pre.get("pretokenizers") or [])
    return pre.get("type") == "ByteLevel"
