"""Encoding a rendered chat piece by piece between its added tokens, the pieces cached, gives
the ids of encoding it whole; where it might not, the cache encodes whole texts."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from edgeinfer.router import segment_cache
from edgeinfer.router.segment_cache import SegmentCache

CORPUS = ["the quick brown fox jumps over the lazy dog, and then it naps. " * 20]
SPECIALS = ("<|im_start|>", "<|im_end|>")


def _tokenizer(pre: pre_tokenizers.PreTokenizer, **flags: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet))
    flags = {"normalized": False, **flags}
    tok.add_special_tokens([AddedToken(s, special=True, **flags) for s in SPECIALS])
    return tok


def _byte_level(**flags: bool) -> Tokenizer:
    return _tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False), **flags)


def chat(*turns: str) -> str:
    roles = ["system", "user", "assistant"] * len(turns)
    return "".join(f"<|im_start|>{r}\n{t}<|im_end|>\n" for r, t in zip(roles, turns, strict=False))


def whole(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("release_gil", [False, True])
def test_pieces_give_the_whole_texts_ids(release_gil: bool) -> None:
    tok = _byte_level()
    cache = SegmentCache(tok)
    assert cache.segmenting
    system = "You are the lazy dog's assistant. " * 8
    history = [system]
    for turn in ("the quick fox?", "it jumps.", "  and   then?<|im_start|>x", "naps"):
        history.append(turn)
        text = chat(*history) + "<|im_start|>assistant\n"
        assert cache.encode(text, None, release_gil) == whole(tok, text)
    held = cache._held
    ids, cached = cache.encode_counted(text, None, release_gil)
    assert ids == whole(tok, text)
    assert cache._held == held  # every piece was a hit
    assert cached == len(ids) - text.count("<|im_")  # all but the added tokens' ids


def test_salts_keep_pieces_apart() -> None:
    cache = SegmentCache(_byte_level())
    text = chat("You are helpful.", "hello")
    cache.encode(text, "tenant-a")
    entries = len(cache._cache)
    cache.encode(text, "tenant-b")
    assert len(cache._cache) == 2 * entries


def test_least_recent_pieces_go_past_the_capacity() -> None:
    tok = _byte_level()
    cache = SegmentCache(tok, capacity_bytes=600)
    keep = chat("the lazy dog")
    for i in range(20):
        cache.encode(keep, None)  # used every time: stays
        text = chat(f"question {i} about the quick brown fox")
        assert cache.encode(text, None) == whole(tok, text)
        assert cache._held <= 600
    assert (None, "system\nthe lazy dog") in cache._cache
    assert len(cache._cache) < 20


def test_the_capacity_counts_a_piece_text_not_only_its_ids() -> None:
    tok = _byte_level()
    cache = SegmentCache(tok, capacity_bytes=64 << 10)
    for i in range(8):
        # 16k characters that merge into ~4 a token: 8 pieces are ~32k ids in all, which a
        # budget of ids alone (64k) would keep every one of.
        cache.encode(chat(f"{i} " + CORPUS[0] * 12), None)
        assert cache._held <= 64 << 10
    assert len(cache._cache) <= 4


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word", "normalized"])
def test_a_token_that_is_not_plain_text_turns_pieces_off(flag: str) -> None:
    tok = _byte_level(**{flag: True})
    cache = SegmentCache(tok)
    assert not cache.segmenting
    text = chat("  spaced  ", " out ")
    assert cache.encode(text, None) == whole(tok, text)


def test_a_first_piece_prefix_fails_the_probe() -> None:
    # A metaspace prefix on the first piece only: a piece encoded alone would get it too.
    tok = _tokenizer(pre_tokenizers.Metaspace(prepend_scheme="first"))
    text = "Hello world<|im_end|>again"
    pieces = whole(tok, "Hello world") + [tok.token_to_id("<|im_end|>")] + whole(tok, "again")
    if pieces == whole(tok, text):
        pytest.skip("this tokenizers version encodes every piece alike")
    cache = SegmentCache(tok)
    assert not cache.segmenting
    assert cache.encode(text, None) == whole(tok, text)


def test_a_difference_found_by_the_check_turns_pieces_off(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _byte_level()
    cache = SegmentCache(tok)
    wrong = cache._segmented
    monkeypatch.setattr(cache, "_segmented", lambda *a, **k: ([*wrong(*a, **k)[0], 0], 0))
    text = chat("hello", "there")
    for _ in range(segment_cache.VERIFY_EVERY):
        last = cache.encode(text, None)
    assert last == whole(tok, text)  # the check's own text already gets the whole ids
    assert not cache.segmenting and not cache._cache
    assert cache.encode(text, None) == whole(tok, text)
