"""Early refusal of over-long prompts: never a prompt that fits, never the whole of a huge one."""

from __future__ import annotations

import random

import pytest

from daemon_helpers import build_checkpoint
from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.prompt_length import PROBE_CHARS_PER_TOKEN, encode_within
from edgeinfer.daemon.engine.tokenizer import Tokenizer

LIMIT = 64


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_checkpoint(tmp_path_factory.mktemp("prompt_length")))


class Counting:
    """A tokenizer wrapper that records how many characters it was asked to encode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.chars += len(text)
        return self.inner.encode(text, add_special_tokens)


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
