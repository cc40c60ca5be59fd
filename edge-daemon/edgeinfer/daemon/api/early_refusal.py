"""Refusals a large body's shape proves, so the daemon never decodes that body.

The shape (:mod:`~edgeinfer.daemon.api.body_shape`) is the body with every long value
replaced by a marker that says how long it was. Two answers follow from it alone:

- a body naming another model gets its 404, as it would after a full parse (the model's name
  is a short string, kept as it is);
- a prompt (``prompt``, or the messages a chat template shows) that holds at least the
  context's length in tokens whatever it says (:func:`~edgeinfer.daemon.api.prompt_length.
  check_chars`, :func:`~edgeinfer.daemon.api.prompt_length.check_chat`) gets its
  ``context_length_exceeded`` 400.

Nothing else is concluded from a shape: any other error in it could be an artefact of the
markers, so the body is then decoded in full and parsed as usual (:func:`refuse_by_length`
returns). Neither answer depends on the order in which a full parse would check things, other
than these two coming first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edgeinfer.daemon.api.body_shape import Long
from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.fields import Fields
from edgeinfer.daemon.api.prompt_length import check_chars, check_chat, too_long
from edgeinfer.daemon.api.protocol import Kind, ModelInfo, chat_renderer, check_model
from edgeinfer.daemon.api.tools import parse_tools
from edgeinfer.daemon.engine.errors import InvalidRequestError

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def refuse_by_length(
    kind: Kind, body: dict[str, Any], long: Mapping[str, Long], model: ModelInfo
) -> None:
    """Raise the 404 or 400 the shape ``body`` (markers described by ``long``) proves."""
    f = Fields(body)
    check_model(f, model)
    limit = model.max_model_len
    if kind == "completion":
        prompt = body.get("prompt")
        for p in prompt if isinstance(prompt, list) else [prompt]:
            if not isinstance(p, str) or (v := long.get(p)) is None:
                continue
            if v.is_ids:
                if v.items >= limit:
                    raise too_long(limit, v.items, "prompt")
            else:
                check_chars(model.tokenizer, v.chars, limit, "prompt")
        return
    messages = body.get("messages")
    if not isinstance(messages, list) or not any(
        isinstance(m, dict) and isinstance(c := m.get("content"), str) and c in long
        for m in messages
    ):
        return
    try:
        tools = parse_tools(body, model.tokenizer, model.tool_call_parser)
        chat, render = chat_renderer(f, model, tools)
        check_chat(model.tokenizer, chat, limit, render, long)
    except APIError as exc:
        if exc.code == CONTEXT_LENGTH_EXCEEDED:
            raise
    except InvalidRequestError:
        pass  # the template refused the shape: the full parse says how
