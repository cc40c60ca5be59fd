"""Tokenizer and chat templates on top of the ``tokenizers`` library (no transformers at runtime).

Encoding follows ``tokenizer.json`` exactly (its post-processor decides whether BOS is added), and
chat templates are rendered by :mod:`edgeinfer.shared.chat_template` (as transformers renders
them), the code the router uses to predict a request's block keys.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from edgeinfer.daemon.engine.errors import InvalidRequestError, ModelLoadError
from edgeinfer.shared.chat_template import ChatTemplateError, render_chat

# Context tokens decoded before the first output token so the first delta keeps its spacing.
_DETOKENIZE_CONTEXT = 5


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    # Special tokens are written either as plain strings or as serialized AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class Tokenizer:
    """A model's tokenizer: ids <-> text plus its chat template and stop tokens."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        special_tokens: dict[str, str],
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_template: str | dict[str, str] | None,
    ) -> None:
        self._tok = tokenizer
        self.special_tokens = special_tokens
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{tokenizer_file} not found (only fast tokenizers are supported)")
        try:
            tok = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust library raises a plain Exception
            raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        tok_cfg = _read_json(path / "tokenizer_config.json")
        gen_cfg = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        special = {
            key: content
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (content := _token_content(tok_cfg.get(key))) is not None
        }
        bos_id = tok.token_to_id(special["bos_token"]) if "bos_token" in special else None
        if bos_id is None:
            bos_id = next(
                iter(_ids(gen_cfg.get("bos_token_id")) or _ids(model_cfg.get("bos_token_id"))), None
            )
        # Stop on any EOS named anywhere: chat models often list the turn-end token only in
        # generation_config.json while tokenizer_config.json names the document end.
        eos_ids = set(_ids(gen_cfg.get("eos_token_id"))) | set(_ids(model_cfg.get("eos_token_id")))
        if "eos_token" in special and (eos := tok.token_to_id(special["eos_token"])) is not None:
            eos_ids.add(eos)

        template: str | dict[str, str] | None = tok_cfg.get("chat_template")
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(
            tok,
            special_tokens=special,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=template,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def spec(self) -> dict[str, Any]:
        """The tokenizer as its ``tokenizer.json`` describes it (model, normalizer, ...)."""
        spec: dict[str, Any] = json.loads(self._tok.to_str())
        return spec

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry itself (e.g. ``Ġthe``), not its decoded text."""
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it), so a long prompt
        # tokenised on a worker thread leaves the event loop and the engine thread running.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` to the prompt string (extra keyword arguments reach the template);
        the router renders with the same code (:mod:`edgeinfer.shared.chat_template`)."""
        try:
            return render_chat(
                self.chat_template, self.special_tokens, messages, add_generation_prompt, **extra
            )
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc), param="messages") from exc


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas.

    It decodes a small window ``ids[prefix_offset:]`` and emits only what extends the already
    emitted part ``ids[prefix_offset:read_offset]`` (vLLM's technique), so the cost per token is
    constant, multi-token characters are held back until complete, and the deltas concatenate to
    ``decode(output_ids)`` for byte-level BPE tokenizers.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one output token; returns the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens
        )
        full = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        # U+FFFD at the end means the last token ended inside a UTF-8 sequence: wait for the rest.
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Drop the tokens before the window so memory stays bounded on long generations.
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += delta
        return delta
