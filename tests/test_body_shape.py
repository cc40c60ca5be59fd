"""A large body's shape: long values become markers with their lengths, everything else stays."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from edgeinfer.daemon.api.body_shape import (
    LONG_LIST_ITEMS,
    LONG_TEXT_CHARS,
    MAX_SHAPE_BYTES,
    Long,
    Shape,
    decode_shape,
    encode_shape,
    shape_of,
)

SHORT = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=8), SHORT, max_size=6))
def test_a_body_without_long_values_is_its_own_shape(body: dict[str, Any]) -> None:
    shape = decode_shape(encode_shape(shape_of(orjson.dumps(body))))
    assert shape == Shape(body=body)


def test_long_values_become_markers_with_their_lengths() -> None:
    text = "  " + "x" * LONG_TEXT_CHARS + " "
    ids = [7] * LONG_LIST_ITEMS
    mixed = [1, "a"] * LONG_LIST_ITEMS  # not all integers: kept, walked
    body = {"model": "m", "prompt": text, "ids": ids, "mixed": mixed, "n": 2}
    shape = decode_shape(encode_shape(shape_of(orjson.dumps(body))))
    assert shape.body is not None and shape.error is None
    assert shape.body["model"] == "m" and shape.body["n"] == 2 and shape.body["mixed"] == mixed
    assert shape.long[shape.body["prompt"]] == Long(chars=len(text), stripped=LONG_TEXT_CHARS)
    assert shape.long[shape.body["ids"]] == Long(items=LONG_LIST_ITEMS)
    assert shape.long[shape.body["ids"]].is_ids


def test_a_client_cannot_forge_a_marker() -> None:
    first = shape_of(orjson.dumps({"a": "y" * LONG_TEXT_CHARS}))
    (marker,) = first.long
    # The same marker sent as a value: short, kept as text, and the next body's markers differ.
    second = shape_of(orjson.dumps({"a": "y" * LONG_TEXT_CHARS, "b": marker}))
    assert second.body is not None and second.body["b"] == marker
    assert marker not in second.long


def test_what_cannot_be_sent_back_asks_for_a_full_decode() -> None:
    many = orjson.dumps({"stop": ["abc"] * (MAX_SHAPE_BYTES // 4)})  # short values, large shape
    assert decode_shape(encode_shape(shape_of(many))) == Shape()
    huge_int = b'{"seed": 123456789012345678901234567890}'
    assert decode_shape(encode_shape(shape_of(huge_int))) == Shape()


def test_malformed_bodies_get_the_daemons_messages() -> None:
    assert shape_of(b'{"prompt": "x').error == (
        "the request body is not valid JSON: Input data was truncated"
    )
    assert shape_of(b"[1, 2]").error == "the request body must be a JSON object"
