"""JSON Schemas (2020-12) of the OpenAI response bodies, for the OpenAPI document.

What the daemon answers (``edgeinfer.daemon.api.responses``) and the router passes through or
makes itself (errors). ``openapi_schemas`` holds the request side and names every component.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "description": "OpenAI's error body: every non-2xx answer of the daemon and the router.",
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "examples": ["invalid_request_error"]},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"], "examples": ["context_length_exceeded"]},
            },
        }
    },
}

USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
        },
    },
}

# A log-probability is null where it is -inf (JSON has no infinities).
_LOGPROB = {"type": ["number", "null"]}
_FINISH = {
    "finish_reason": {"enum": ["stop", "length", "tool_calls", "abort", None]},
    "stop_reason": {"type": ["string", "integer", "null"]},
}
_TOKEN_ID_LISTS = {
    "token_ids": {"type": "array", "items": {"type": "integer"}},
    "prompt_token_ids": {"type": "array", "items": {"type": "integer"}},
}

COMPLETION_LOGPROBS: Schema = {
    "type": ["object", "null"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": _LOGPROB},
        "top_logprobs": {
            "type": "array",
            # null for an echoed first prompt token, which has no context to be scored in
            "items": {"type": ["object", "null"], "additionalProperties": _LOGPROB},
        },
        "text_offset": {"type": "array", "items": {"type": "integer"}},
    },
}

_CHAT_TOKEN: Schema = {
    "type": "object",
    "required": ["token", "logprob"],
    "properties": {
        "token": {"type": "string"},
        "logprob": _LOGPROB,
        "bytes": {"type": "array", "items": {"type": "integer"}},
    },
}

CHAT_LOGPROBS: Schema = {
    "type": ["object", "null"],
    "properties": {
        "content": {
            "type": "array",
            "items": {
                **_CHAT_TOKEN,
                "properties": {
                    **_CHAT_TOKEN["properties"],
                    "top_logprobs": {"type": "array", "items": _CHAT_TOKEN},
                },
            },
        }
    },
}


PROMPT_LOGPROBS: Schema = {
    "type": "array",
    "description": "vLLM's: per prompt token (the first null) the token itself and the "
    "prompt_logprobs most likely ones, keyed by token id.",
    "items": {
        "type": ["object", "null"],
        "additionalProperties": {
            "type": "object",
            "required": ["logprob", "rank", "decoded_token"],
            "properties": {
                "logprob": _LOGPROB,
                "rank": {"type": ["integer", "null"], "minimum": 1},
                "decoded_token": {"type": "string"},
            },
        },
    },
}


def _envelope(obj: str, choice: Schema, *, usage: bool) -> Schema:
    props: Schema = {
        "id": {"type": "string"},
        "object": {"const": obj},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": choice},
        "usage": ref("Usage") if usage else {"anyOf": [ref("Usage"), {"type": "null"}]},
    }
    required = ["id", "object", "created", "model", "choices"]
    return {
        "type": "object",
        "required": required + (["usage"] if usage else []),
        "properties": props,
    }


def _choice(fields: Schema, required: list[str]) -> Schema:
    return {
        "type": "object",
        "required": ["index", "finish_reason", *required],
        "properties": {"index": {"type": "integer"}, **fields, **_FINISH, **_TOKEN_ID_LISTS},
    }


_COMPLETION_CHOICE = _choice(
    {
        "text": {"type": "string"},
        "logprobs": ref("CompletionLogprobs"),
        "prompt_logprobs": ref("PromptLogprobs"),
    },
    ["text"],
)
COMPLETION = _envelope("text_completion", _COMPLETION_CHOICE, usage=True)
COMPLETION_CHUNK = _envelope("text_completion", _COMPLETION_CHOICE, usage=False)

# A call in an answer; streamed, its first delta has index, id, type, function.name and empty
# arguments, the next ones index and argument text.
_TOOL_CALL_OUT = {
    "type": "object",
    "properties": {
        "index": {"type": "integer"},
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
_MESSAGE_OUT = {
    "type": "object",
    "properties": {
        "role": {"const": "assistant"},
        "content": {"type": ["string", "null"]},
        "tool_calls": {"type": "array", "items": _TOOL_CALL_OUT},
    },
}
CHAT_COMPLETION = _envelope(
    "chat.completion",
    _choice({"message": _MESSAGE_OUT, "logprobs": ref("ChatLogprobs")}, ["message"]),
    usage=True,
)
CHAT_COMPLETION["properties"]["prompt_logprobs"] = ref("PromptLogprobs")
CHAT_COMPLETION_CHUNK = _envelope(
    "chat.completion.chunk",
    # The opening chunk of a choice carries only the role; finish_reason is absent there.
    {
        "type": "object",
        "required": ["index", "delta"],
        "properties": {
            "index": {"type": "integer"},
            "delta": _MESSAGE_OUT,
            "logprobs": ref("ChatLogprobs"),
            **_FINISH,
            **_TOKEN_ID_LISTS,
        },
    },
    usage=False,
)

MODEL_LIST: Schema = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object", "owned_by"],
                "properties": {
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                    "max_model_len": {"type": "integer"},
                },
            },
        },
    },
}

HEALTH: Schema = {
    "type": "object",
    "required": ["status"],
    "description": "A daemon: its phase ('serving', 'loading', 'draining', ...). The router: "
    "'ok' and how many daemons it can place requests on.",
    "properties": {"status": {"type": "string"}, "daemons": {"type": "integer", "minimum": 1}},
}

TOKENIZE_RESPONSE: Schema = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens"],
    "properties": {
        "count": {"type": "integer", "minimum": 0},
        "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": "array", "items": {"type": ["string", "null"]}},
    },
}
DETOKENIZE_RESPONSE: Schema = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}
