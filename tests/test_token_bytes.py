"""The characters-per-token bound: sound where it is given, absent where a tokenizer drops text."""

from __future__ import annotations

import copy
import random
import sys
import unicodedata
from typing import Any

import pytest

from daemon_helpers import build_checkpoint
from edgeinfer.daemon.api.token_bytes import (
    _NORMALIZER_SHRINK,
    bound_of_spec,
    chars_per_token_bound,
    min_tokens,
)
from edgeinfer.daemon.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_checkpoint(tmp_path_factory.mktemp("token_bytes")))


def texts(seed: int) -> list[str]:
    """Prose, runs of one character, digits, CJK, emoji, special-token text, whitespace."""
    rng = random.Random(seed)
    words = ["the", "baker", "sea", "town", "little", "loaf", "morning", "bread", "and"]
    out = []
    for n in (1, 5, 50, 300):
        out.append(" ".join(rng.choice(words) for _ in range(n)))
        out.append("".join(rng.choice(words) for _ in range(n)))
        out.append("a" * n * 7)
        out.append(" " * n * 7)
        out.append("".join(str(rng.randrange(10)) for _ in range(n * 3)))
        out.append("".join(chr(rng.randrange(0x4E00, 0x4E80)) for _ in range(n)))
        out.append("\U0001f600" * n)
        out.append("<|im_start|>" * n + "<|im_end|>\n" * n)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_no_text_holds_fewer_tokens_than_the_bound_says(tokenizer: Tokenizer, seed: int) -> None:
    bound = chars_per_token_bound(tokenizer)
    assert bound is not None
    for text in texts(seed):
        count = len(tokenizer.encode(text, add_special_tokens=False))
        assert count >= min_tokens(len(text), bound), (count, bound, text[:40])


def test_the_tiny_tokenizer_bound_is_its_longest_token(tokenizer: Tokenizer) -> None:
    spec = tokenizer.spec()
    longest = max(
        max(len(t) for t in spec["model"]["vocab"]),
        max(len(a["content"].encode()) for a in spec["added_tokens"]),
    )
    assert chars_per_token_bound(tokenizer) == longest


def _variant(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("model", "type"), "WordPiece"),  # one [UNK] stands for a whole unknown word
        (("pre_tokenizer",), {"type": "Whitespace"}),  # drops whitespace
        (("pre_tokenizer",), {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"}),
        (("normalizer",), {"type": "Strip", "strip_left": True, "strip_right": True}),
        (("normalizer",), {"type": "Replace", "pattern": {"String": " "}, "content": ""}),
        (("normalizer",), {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}),
        (("normalizer",), {"type": "Lowercase"}),
        (("truncation",), {"max_length": 16, "strategy": "LongestFirst", "stride": 0}),
    ],
    ids=[
        "wordpiece",
        "whitespace",
        "split-removed",
        "strip",
        "deleting",
        "regex",
        "lower",
        "trunc",
    ],
)
def test_tokenizers_that_drop_text_get_no_bound(
    tokenizer: Tokenizer, path: tuple[str, ...], value: Any
) -> None:
    assert bound_of_spec(tokenizer.spec()) is not None
    assert bound_of_spec(_variant(tokenizer.spec(), path, value)) is None


def test_an_added_token_that_swallows_whitespace_or_a_missing_byte_voids_the_bound(
    tokenizer: Tokenizer,
) -> None:
    spec = tokenizer.spec()
    stripping = copy.deepcopy(spec)
    stripping["added_tokens"][0]["rstrip"] = True
    assert bound_of_spec(stripping) is None
    holed = copy.deepcopy(spec)
    holed["model"]["vocab"].pop("a")  # "a" alone can no longer be a token: it would be dropped
    assert bound_of_spec(holed) is None


def test_normalizers_scale_the_bound(tokenizer: Tokenizer) -> None:
    spec = tokenizer.spec()
    plain = bound_of_spec(spec)
    assert plain is not None
    nfc = _variant(spec, ("normalizer",), {"type": "NFC"})
    assert bound_of_spec(nfc) == 3 * plain
    both = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "NFKC"}]}
    assert bound_of_spec(_variant(spec, ("normalizer",), both)) == 12 * plain
    # Llama's sentencepiece-style space marker only lengthens the text.
    marker = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    assert bound_of_spec(_variant(spec, ("normalizer",), marker)) == plain


@pytest.mark.parametrize("form", ["NFC", "NFD", "NFKC", "NFKD"])
def test_no_code_point_shrinks_more_than_its_normalizer_factor(form: str) -> None:
    factor = _NORMALIZER_SHRINK[form]
    for cp in range(sys.maxunicode + 1):
        if 0xD800 <= cp < 0xE000:
            continue  # surrogates are not text
        c = chr(cp)
        normal = unicodedata.normalize(form, c)
        assert normal and len(c.encode()) <= factor * len(normal.encode()), hex(cp)
