"""A rendered chat's token ids, encoded piece by piece between its special tokens, the pieces
cached: a deployment's system prompt, and a conversation's earlier turns, are encoded once.

``tokenizers`` cuts a text at its added tokens before anything else: a ``<|im_start|>`` written
as text is that one token, and the text between two of them is normalised, pre-tokenised and
encoded on its own. So the ids of a text without special-token insertion (a chat the template
rendered) are the ids of its pieces, each encoded alone, with the added tokens' ids between.
The router encodes every prompt it places; with a shared system prompt of 1k tokens that is
~1.5-2 ms of its CPU a request, nearly all of it the same text each time (SGLang's gateway
caches at the same boundaries, for the same reason).

That holds only where the cut is plain string matching: every added token matched on the raw
text (not after normalisation) and none stripping whitespace around itself or matching only as
a whole word. A tokenizer with any other added token, or one whose pre-tokenizer treats the
first piece of a text apart from the rest (a metaspace prefix on the first piece only), would
encode a piece alone differently: :class:`SegmentCache` checks a probe at construction, and
every :data:`VERIFY_EVERY`-th text against a whole encode, and falls back to encoding whole
texts for good at the first difference.

Pieces are cached per cache salt: a piece another tenant sent is never a hit for this one, so
the router's timing cannot tell a tenant what another has sent.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# What the pieces may hold, ids and text together: ~1.5-3M tokens of English. The text counts
# as much as the ids: a piece of one character repeated is a few ids for thousands of characters.
CAPACITY_BYTES = 16 << 20
VERIFY_EVERY = 64  # texts between two checks against a whole encode
# Texts the constructor encodes both ways: a piece after an added token, one before the next,
# and leading whitespace, which a first-piece-only prefix would treat differently.
_PROBES = ("Hello world{0} again, friend.{0}\n  and more{0}", " leading space{0}x")


class SegmentCache:
    """One tokenizer's encoder of rendered chats, by pieces (module doc); thread-safe."""

    def __init__(self, tok: Tokenizer, capacity_bytes: int = CAPACITY_BYTES) -> None:
        self._tok = tok
        self._capacity = capacity_bytes
        self._cache: OrderedDict[tuple[str | None, str], array] = OrderedDict()
        self._held = 0  # bytes of the cached pieces' ids and text (_size)
        self._texts = 0
        self._lock = threading.Lock()  # the tokenize pool's threads share the cache
        added = list(tok.get_added_tokens_decoder().items())
        plain = all(not (t.normalized or t.lstrip or t.rstrip or t.single_word) for _, t in added)
        self._ids = {t.content: i for i, t in added}
        self._cut: re.Pattern[str] | None = None
        if added and plain:
            # Longest first: at one position the longer token wins, as tokenizers' matcher has it.
            contents = sorted(self._ids, key=len, reverse=True)
            self._cut = re.compile("(" + "|".join(map(re.escape, contents)) + ")")
            texts = [probe.format(contents[-1]) for probe in _PROBES]
            if any(self._segmented(self._cut, t, "")[0] != self._whole(t) for t in texts):
                self._cut = None
            self._cache.clear()
            self._held = 0
        self.segmenting = self._cut is not None

    def encode(self, text: str, salt: str | None, release_gil: bool = False) -> list[int]:
        """The ids ``tokenizers`` gives ``text`` without special-token insertion.
        ``release_gil`` (on a worker thread): pieces not cached are encoded as one batch, which
        lets the event loop run meanwhile."""
        return self.encode_counted(text, salt, release_gil)[0]

    def encode_counted(
        self, text: str, salt: str | None, release_gil: bool = False
    ) -> tuple[list[int], int]:
        """:meth:`encode`'s ids, and how many of them came from the cache."""
        cut = self._cut  # one value throughout: a check on another thread may clear it
        if cut is None:
            return self._whole(text, release_gil), 0
        with self._lock:
            self._texts += 1
            verify = self._texts % VERIFY_EVERY == 0
        ids, cached = self._segmented(cut, text, salt, release_gil)
        if verify and ids != (whole := self._whole(text, release_gil)):
            log.warning("encoding a prompt piece by piece differs from encoding it whole: "
                        "piece caching is off for this tokenizer")  # fmt: skip
            self._cut = None
            self.segmenting = False
            with self._lock:
                self._cache.clear()
                self._held = 0
            return whole, 0
        return ids, cached

    def _whole(self, text: str, release_gil: bool = False) -> list[int]:
        if release_gil:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def _segmented(
        self, cut: re.Pattern[str], text: str, salt: str | None, release_gil: bool = False
    ) -> tuple[list[int], int]:
        """The ids, and how many came from the cache."""
        parts = cut.split(text)  # pieces at even indices, added tokens at odd ones
        found: dict[str, array] = {}
        cached = 0
        with self._lock:
            for piece in parts[::2]:
                if piece and (hit := self._cache.get((salt, piece))) is not None:
                    self._cache.move_to_end((salt, piece))
                    found[piece] = hit
                    cached += len(hit)
        # Each piece not cached encoded once, however often the text repeats it.
        missing = list(dict.fromkeys(p for p in parts[::2] if p and p not in found))
        if missing:
            if release_gil:
                batch = self._tok.encode_batch(missing, add_special_tokens=False)
                encoded = [e.ids for e in batch]
            else:
                encoded = [self._tok.encode(p, add_special_tokens=False).ids for p in missing]
            with self._lock:
                for piece, piece_ids in zip(missing, encoded, strict=True):
                    found[piece] = self._keep((salt, piece), piece_ids)
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._ids[part])
            elif part:
                ids.extend(found[part])
        return ids, cached

    def _keep(self, key: tuple[str | None, str], piece_ids: list[int]) -> array:
        """Caches ``piece_ids`` (under the lock), evicting the least recent pieces past the
        capacity; a piece larger than the whole capacity is not kept."""
        kept = array("I", piece_ids)
        size = _size(key, kept)
        if size > self._capacity:
            return kept
        old = self._cache.pop(key, None)
        if old is not None:
            self._held -= _size(key, old)
        self._cache[key] = kept
        self._held += size
        while self._held > self._capacity:
            evicted_key, evicted = self._cache.popitem(last=False)
            self._held -= _size(evicted_key, evicted)
        return kept


def _size(key: tuple[str | None, str], ids: array) -> int:
    """Bytes one cached piece holds: its ids and its text (``getsizeof``: 1-4 bytes a
    character, as Python stores the string)."""
    return ids.itemsize * len(ids) + sys.getsizeof(key[1])
