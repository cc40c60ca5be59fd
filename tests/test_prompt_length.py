"""Early refusal of over-long prompts: never a prompt that fits, never the whole of a huge one."""

from __future__ import annotations

import random
from typing import Any

import pytest

from daemon_helpers import build_checkpoint
from edgeinfer.daemon.api.body_shape import Long
from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.prompt_length import PROBE_CHARS_PER_TOKEN, check_chat, encode_within
from edgeinfer.daemon.api.protocol import ModelInfo, parse_request
from edgeinfer.daemon.engine.tokenizer import Tokenizer

LIMIT = 64


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_checkpoint(tmp_path_factory.mktemp("prompt_length")))


class Counting:
    """A tokenizer wrapper that records how many characters it was asked to encode; without
    ``bounded`` it hides its vocabulary, so no characters-per-token bound applies."""

    def __init__(self, inner: Tokenizer, bounded: bool = False) -> None:
        self.inner = inner
        self.bounded = bounded
        self.chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.chars += len(text)
        return self.inner.encode(text, add_special_tokens)

    def spec(self) -> dict[str, Any]:
        return self.inner.spec() if self.bounded else {}


def texts(seed: int) -> list[str]:
    """Prose, one long word, digits, non-Latin script, newlines: around the limit each."""
    rng = random.Random(seed)
    words = ["the", "baker", "sea", "town", "little", "loaf", "morning", "bread", "and"]
    out = []
    for n in (10, 40, 60, 63, 64, 65, 70, 120, 400):
        out.append(" ".join(rng.choice(words) for _ in range(n)))
        out.append("".join(rng.choice(words) for _ in range(n)))  # no whitespace to cut at
        out.append("".join(str(rng.randrange(10)) for _ in range(n * 3)))
        out.append("".join(chr(rng.randrange(0x4E00, 0x4E80)) for _ in range(n)))
        out.append("\n".join(rng.choice(words) * 3 for _ in range(n)))
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("special", [True, False])
def test_refuses_only_what_the_full_count_refuses(
    tokenizer: Tokenizer, seed: int, special: bool
) -> None:
    for text in texts(seed):
        full = tokenizer.encode(text, add_special_tokens=special)
        try:
            got = encode_within(tokenizer, text, LIMIT, "prompt", add_special_tokens=special)
        except APIError as exc:
            assert exc.code == "context_length_exceeded" and exc.param == "prompt"
            assert len(full) >= LIMIT, (len(full), text[:80])
        else:
            assert got == full


def test_a_huge_prompt_is_refused_after_a_bounded_prefix(tokenizer: Tokenizer) -> None:
    text = "the little town by the sea had one baker " * 100_000  # ~4 MB
    counting = Counting(tokenizer)
    with pytest.raises(APIError) as caught:
        encode_within(counting, text, LIMIT, "messages")  # type: ignore[arg-type]
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"
    assert f"maximum context length is {LIMIT} tokens" in caught.value.message
    # Probes double from LIMIT * 4 characters: a few of them, not the 4 MB.
    assert counting.chars < 16 * LIMIT * PROBE_CHARS_PER_TOKEN


def test_a_fitting_prompt_is_tokenised_once_when_short(tokenizer: Tokenizer) -> None:
    counting = Counting(tokenizer)
    text = "a short prompt"
    assert encode_within(counting, text, LIMIT, "prompt") == tokenizer.encode(text)  # type: ignore[arg-type]
    assert counting.chars == len(text)


HUGE = "the little town by the sea had one baker " * 100_000  # ~4 MB


def test_a_huge_prompt_is_refused_on_its_length_alone(tokenizer: Tokenizer) -> None:
    counting = Counting(tokenizer, bounded=True)
    with pytest.raises(APIError) as caught:
        encode_within(counting, HUGE, LIMIT, "prompt")  # type: ignore[arg-type]
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "prompt"
    assert counting.chars == 0


class Render:
    """A chat template stand-in that shows the messages it is given, as ``template`` says."""

    def __init__(self, template: str = "all") -> None:
        self.template = template
        self.calls: list[list[dict[str, Any]]] = []

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        self.calls.append(messages)
        shown = messages
        if self.template == "drops-system":
            shown = [m for m in messages if m["role"] != "system"]
        if self.template == "trims":
            return "".join(f"<{m['role']}>{m['content'].strip()}" for m in shown)
        return "".join(f"<{m['role']}>{m['content']}" for m in shown)


def test_a_huge_message_is_refused_before_the_template_renders_it(tokenizer: Tokenizer) -> None:
    render = Render()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": HUGE},  # not counted, and not rendered either
        {"role": "user", "content": HUGE},
    ]
    with pytest.raises(APIError) as caught:
        check_chat(tokenizer, messages, LIMIT, render)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"
    # One probe render, of short markers: never a message itself.
    assert len(render.calls) == 1
    assert max(len(m["content"]) for m in render.calls[0]) < 100


@pytest.mark.parametrize(
    ("template", "messages"),
    [
        ("drops-system", [{"role": "system", "content": HUGE}, {"role": "user", "content": "hi"}]),
        ("trims", [{"role": "user", "content": " " * len(HUGE) + "hi"}]),
        # Reasoning templates may keep only what follows an assistant message's "</think>".
        ("all", [{"role": "assistant", "content": HUGE}, {"role": "user", "content": "hi"}]),
    ],
    ids=["dropped-message", "trimmed-whitespace", "assistant"],
)
def test_what_a_template_may_not_show_is_not_counted(
    tokenizer: Tokenizer, template: str, messages: list[dict[str, Any]]
) -> None:
    check_chat(tokenizer, messages, LIMIT, Render(template))  # no refusal


def test_short_conversations_are_not_even_probed(tokenizer: Tokenizer) -> None:
    render = Render()
    check_chat(tokenizer, [{"role": "user", "content": "a" * (LIMIT - 1)}], LIMIT, render)
    assert render.calls == []


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_huge_request_is_neither_rendered_nor_tokenised(
    tokenizer: Tokenizer, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole parse, through the real chat template: the 400 comes from the length."""
    rendered: list[int] = []
    encoded: list[int] = []
    render, encode = tokenizer.apply_chat_template, tokenizer.encode

    def counting_render(messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
        text = render(messages, *args, **kwargs)
        rendered.append(len(text))
        return text

    def counting_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        encoded.append(len(text))
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counting_render)
    monkeypatch.setattr(tokenizer, "encode", counting_encode)
    model = ModelInfo("m", tokenizer, tokenizer.vocab_size, LIMIT, LIMIT)
    body: dict[str, Any] = {"model": "m", "max_tokens": 4}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": HUGE}]
    else:
        body["prompt"] = HUGE
    with pytest.raises(APIError) as caught:
        parse_request(kind, body, model, None)  # type: ignore[arg-type]
    assert caught.value.code == "context_length_exceeded"
    assert encoded == []
    assert all(n < 1000 for n in rendered)  # the probe's markers at most


def test_a_marker_counts_as_the_text_it_stands_for(tokenizer: Tokenizer) -> None:
    """A large body's shape (body_shape.py) replaces long contents by markers; the check counts
    each as its text's length, and still only where the template shows it."""
    marker = "\u2063edgeinfer-long-0\u2063"
    long = {marker: Long(chars=len(HUGE), stripped=len(HUGE))}
    with pytest.raises(APIError) as caught:
        check_chat(tokenizer, [{"role": "user", "content": marker}], LIMIT, Render(), long)
    assert caught.value.code == "context_length_exceeded"
    dropped = [{"role": "system", "content": marker}, {"role": "user", "content": "hi"}]
    check_chat(tokenizer, dropped, LIMIT, Render("drops-system"), long)  # no refusal
    # Only whitespace around a short text: what a trimming template shows is short.
    trimmed = {marker: Long(chars=len(HUGE), stripped=2)}
    check_chat(tokenizer, [{"role": "user", "content": marker}], LIMIT, Render("trims"), trimmed)
