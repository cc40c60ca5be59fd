"""Tokenise a prompt only as far as its length allows: an over-long one is refused early.

A prompt of N characters costs O(N) to tokenise (about a second per MiB on a small vocabulary),
so a 16 MiB prompt sent to a 2,048-token model would take seconds of CPU only to be refused.
:func:`encode_within` tokenises growing prefixes instead (the first of about four characters
per allowed token, then doubling) and stops as soon as one of them alone holds at least
``limit`` tokens: the work is bounded by the model's context, not by what the client sent.

A prefix can count a few more tokens than the same span of the whole text (its last word may
be cut, and a cut word can split into more pieces), so a prefix proves the prompt too long
only with :data:`BOUNDARY_SLACK` tokens to spare, and the cut is moved back to a whitespace
when there is one nearby.

Before any of that, a text's length alone may already prove it too long
(:mod:`~edgeinfer.daemon.api.token_bytes`): :func:`check_chars` for a text, and
:func:`check_chat` for a conversation before its template renders it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from edgeinfer.daemon.api.body_shape import Long
from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.token_bytes import chars_per_token_bound, min_tokens
from edgeinfer.daemon.engine.tokenizer import Tokenizer

# The first probe's length in characters per allowed token: English averages about four.
PROBE_CHARS_PER_TOKEN = 4
# Tokens a cut prefix may count beyond the whole text's tokens of that span.
BOUNDARY_SLACK = 32
# How far back from a cut to look for a whitespace to cut at instead.
_CUT_WINDOW = 256
# Roles whose content a template may shorten by what it says: reasoning templates (Qwen3,
# DeepSeek-R1) keep only what follows an assistant message's last "</think>".
_UNCOUNTED_ROLES = frozenset({"assistant"})
_NONE_LONG: Mapping[str, Long] = MappingProxyType({})


def encode_within(
    tokenizer: Tokenizer, text: str, limit: int, param: str, *, add_special_tokens: bool = True
) -> list[int]:
    """``tokenizer.encode(text)``, unless a prefix shows the text has ``limit`` tokens or more:
    then ``context_length_exceeded`` (400) without tokenising the rest."""
    check_chars(tokenizer, len(text), limit, param)
    size = max(limit, 1) * PROBE_CHARS_PER_TOKEN
    while size < len(text):
        cut = _cut(text, size)
        counted = len(tokenizer.encode(text[:cut], add_special_tokens=add_special_tokens))
        if counted - BOUNDARY_SLACK >= limit:
            raise too_long(limit, counted - BOUNDARY_SLACK, param)
        size *= 2
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_chars(tokenizer: Tokenizer, chars: int, limit: int, param: str) -> None:
    """``context_length_exceeded`` (400) when a text of ``chars`` characters holds at least
    ``limit`` tokens whatever it says (see :mod:`~edgeinfer.daemon.api.token_bytes`)."""
    if chars < limit:
        return  # no token is shorter than one character: nothing to prove
    bound = chars_per_token_bound(tokenizer)
    if bound is not None and (at_least := min_tokens(chars, bound)) >= limit:
        raise too_long(limit, at_least, param)


def check_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    limit: int,
    render: Callable[[list[dict[str, Any]]], str],
    long: Mapping[str, Long] = _NONE_LONG,
) -> None:
    """Refuse a conversation whose messages alone cannot fit in ``limit`` tokens, before the
    chat template renders them (rendering copies a 16 MiB message several times over).

    A message counts only if the template shows its content: ``render`` (the template) runs
    once on the conversation with each text content replaced by a marker, and a message
    whose marker is missing from the result (a template that drops it, or cuts it) adds
    nothing. Content is counted without its surrounding whitespace (templates often trim).
    Assistant messages never count (see ``_UNCOUNTED_ROLES``). Costs nothing unless the
    contents are long enough to decide. A content that is a marker of ``long`` (a body's
    shape, :mod:`~edgeinfer.daemon.api.body_shape`) counts as the text it stands for."""

    def chars(content: str) -> int:
        return v.chars if (v := long.get(content)) is not None else len(content)

    def stripped(content: str) -> int:
        return v.stripped if (v := long.get(content)) is not None else len(content.strip())

    counted = [
        i
        for i, m in enumerate(messages)
        if m.get("role") not in _UNCOUNTED_ROLES and isinstance(m.get("content"), str)
    ]
    most = sum(chars(messages[i]["content"]) for i in counted)
    if most < limit:
        return
    bound = chars_per_token_bound(tokenizer)
    # Even if every counted message showed in full it could fit: no probe render (the common
    # case for a long but legitimate conversation).
    if bound is None or min_tokens(most, bound) < limit:
        return
    # Every text content becomes a marker, so the probe renders nothing long, and no message
    # can show another's marker.
    markers = {
        i: f"\u2063edgeinfer-message-{i}\u2063"
        for i, m in enumerate(messages)
        if isinstance(m.get("content"), str)
    }
    shown = render(
        [{**m, "content": markers[i]} if i in markers else m for i, m in enumerate(messages)]
    )
    shown_chars = sum(stripped(messages[i]["content"]) for i in counted if markers[i] in shown)
    if (at_least := min_tokens(shown_chars, bound)) >= limit:
        raise too_long(limit, at_least, "messages")


def too_long(limit: int, at_least: int, param: str) -> APIError:
    """The refusal of a prompt known to hold ``at_least`` tokens, before counting them all."""
    # OpenAI's opening words, which clients and users recognise.
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, the {param} has at "
        f"least {at_least} tokens. Please reduce the length of the {param}.",
        param=param,
        code="context_length_exceeded",
    )


def _cut(text: str, size: int) -> int:
    """``size``, or just after the last whitespace before it when one is near."""
    start = max(size - _CUT_WINDOW, 0)
    space = max(text.rfind(" ", start, size), text.rfind("\n", start, size))
    return space + 1 if space > 0 else size
