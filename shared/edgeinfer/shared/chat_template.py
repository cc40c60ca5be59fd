"""Chat templates rendered as transformers renders them: one implementation for the engine that
prefills a prompt and the router that predicts its block keys (no torch, no transformers).

Templates run in a Jinja sandbox configured like transformers' so prompts are byte-identical to
``AutoTokenizer.apply_chat_template(..., tokenize=False)``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgeinfer.shared.errors import EdgeInferError

# A checkpoint's template: one source, or several by name (tokenizer_config.json's list form).
ChatTemplate = str | dict[str, str]


class ChatTemplateError(EdgeInferError):
    """The template cannot render these messages (or the model has no usable template)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers) render their body."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API declares a class-level set

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; transformers replaces it with plain json.dumps.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def template_source(template: ChatTemplate | None, tools: Any) -> str:
    """The source to render: the only one, or of several the ``tool_use`` one when tools are
    given and it exists, else ``default``."""
    if template is None:
        raise ChatTemplateError(
            "this model has no chat template (no 'chat_template' in tokenizer_config.json and "
            "no chat_template.jinja); send a plain completion prompt instead"
        )
    if isinstance(template, dict):
        name = "tool_use" if tools is not None and "tool_use" in template else "default"
        if name not in template:
            raise ChatTemplateError(
                f"this model has several chat templates and none is named 'default': "
                f"{sorted(template)}"
            )
        return template[name]
    return template


def render_chat(
    template: ChatTemplate | None,
    special_tokens: dict[str, str],
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render ``messages`` to the prompt string (extra keyword arguments reach the template)."""
    tools = extra.pop("tools", None)
    documents = extra.pop("documents", None)
    compiled = _compile_template(template_source(template, tools))
    # Like transformers: keys whose value is None are dropped, since templates test presence.
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    variables = {**special_tokens, **extra}
    try:
        return compiled.render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
