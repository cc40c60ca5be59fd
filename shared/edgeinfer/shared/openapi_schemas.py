"""JSON Schemas (2020-12) of the OpenAI request bodies, and every component of the OpenAPI document.

Request schemas state what the daemon enforces (``edgeinfer.daemon.api.protocol`` and
``SamplingParams``): a body that breaks one of these constraints gets a 400 naming the field, so
the document doubles as the contract schemathesis checks. Constraints that tie two fields
together (``min_tokens <= max_tokens``, the prompt plus ``max_tokens`` fitting the context) are
only described. Unknown fields are ignored, as vLLM does, hence ``additionalProperties: true``.
"""

from __future__ import annotations

from typing import Any

from edgeinfer.shared.openapi_responses import (
    CHAT_COMPLETION,
    CHAT_COMPLETION_CHUNK,
    CHAT_LOGPROBS,
    COMPLETION,
    COMPLETION_CHUNK,
    COMPLETION_LOGPROBS,
    DETOKENIZE_RESPONSE,
    ERROR,
    HEALTH,
    MODEL_LIST,
    PROMPT_LOGPROBS,
    TOKENIZE_RESPONSE,
    USAGE,
    Schema,
    ref,
)

# SamplingParams' limits (edgeinfer.daemon.engine.sampling_params); shared/ cannot import them.
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_N = 16  # edgeinfer.daemon.api.protocol
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CACHE_SALT_CHARS = 256  # edgeinfer.daemon.api.cache_salt
_INT64 = {"minimum": -(2**63), "maximum": 2**63 - 1}


def _opt(kind: str, description: str, **constraints: Any) -> Schema:
    """An optional field: null means the default, as the daemon treats a missing field."""
    return {"type": [kind, "null"], "description": description, **constraints}


def _refused(description: str) -> Schema:
    """A field the daemon refuses unless it is null or empty (unsupported OpenAI features)."""
    return {"type": ["array", "null"], "maxItems": 0, "description": description}


_STOP_STRING = {"type": "string", "minLength": 1}

SAMPLING: Schema = {
    "temperature": _opt("number", "0 (or below 1e-5) decodes greedily.", minimum=0),
    "top_p": _opt("number", "Nucleus sampling mass.", exclusiveMinimum=0, maximum=1),
    "top_k": _opt("integer", "0 or -1 disables top-k.", minimum=-1),
    "min_p": _opt("number", "Minimum probability relative to the top token.", minimum=0, maximum=1),
    "seed": _opt("integer", "Seed of this request's sampler.", **_INT64),
    "presence_penalty": _opt("number", "OpenAI's, over output tokens.", minimum=-2, maximum=2),
    "frequency_penalty": _opt("number", "OpenAI's, over output tokens.", minimum=-2, maximum=2),
    "repetition_penalty": _opt("number", "vLLM's, over prompt and output.", exclusiveMinimum=0),
    "stop": {
        "description": f"Up to {MAX_STOP_STRINGS} non-empty stop strings.",
        "anyOf": [
            _STOP_STRING,
            {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS},
            {"type": "null"},
        ],
    },
    "stop_token_ids": {
        "type": ["array", "null"],
        "items": {"type": "integer", "minimum": 0},
        "description": "Token ids that end the generation.",
    },
    "ignore_eos": _opt("boolean", "Keep generating past the end-of-sequence token."),
    "include_stop_str_in_output": _opt("boolean", "Keep the matched stop string in the text."),
    "skip_special_tokens": _opt("boolean", "Leave special tokens out of the text."),
    "min_tokens": _opt(
        "integer", "Tokens generated before a stop may end it (<= max_tokens).", minimum=0
    ),
    "max_tokens": _opt(
        "integer",
        "Most tokens to generate; prompt + max_tokens must fit the model's context.",
        minimum=1,
    ),
}

_JSON_SCHEMA = {"type": ["object", "boolean", "string", "null"], "description": "A JSON schema."}
_CHOICE = {"type": ["array", "null"], "items": {"type": "string"}, "minItems": 1}

# Output constraints (edgeinfer.daemon.api.structured): at most one per request; grammars are
# compiled by llguidance.
STRUCTURED: Schema = {
    "response_format": {
        "type": ["object", "null"],
        "description": "OpenAI's: {type: text}, {type: json_object}, or {type: json_schema, "
        "json_schema: {name, schema, strict}}.",
        "required": ["type"],
        "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
    },
    "structured_outputs": {
        "type": ["object", "null"],
        "description": "vLLM's: one of json, regex, choice, grammar (Lark or GBNF/EBNF), "
        "json_object. disable_fallback, disable_any_whitespace and backend are accepted and "
        "change nothing; whitespace_pattern, structural_tag and disable_additional_properties "
        "are a 400.",
        "properties": {
            "json": _JSON_SCHEMA,
            "regex": _opt("string", "A regular expression."),
            "choice": _CHOICE,
            "grammar": _opt("string", "A Lark or GBNF/EBNF (llama.cpp) grammar."),
            "json_object": _opt("boolean", "Any JSON object."),
        },
    },
    "guided_json": {**_JSON_SCHEMA, "description": "vLLM's older structured_outputs.json."},
    "guided_regex": _opt("string", "vLLM's older structured_outputs.regex."),
    "guided_choice": {**_CHOICE, "description": "vLLM's older structured_outputs.choice."},
    "guided_grammar": _opt("string", "vLLM's older structured_outputs.grammar."),
    "guided_whitespace_pattern": {"type": "null", "description": "Not supported."},
}

COMMON: Schema = {
    "model": _opt("string", "The served model's id (GET /v1/models); any other is a 404."),
    "stream": _opt("boolean", "Answer as server-sent events."),
    "stream_options": {
        "type": ["object", "null"],
        "description": "Only with stream: true.",
        "properties": {
            "include_usage": _opt("boolean", "A last chunk with the usage."),
            "continuous_usage_stats": _opt(
                "boolean", "vLLM's: every chunk carries the usage so far."
            ),
        },
    },
    "n": _opt(
        "integer",
        "Choices per prompt (choice index = prompt index * n + i). The prompt is prefilled once "
        "and shared through the prefix cache; with a seed, choice i samples with seed + i.",
        minimum=1,
        maximum=MAX_N,
    ),
    "prompt_logprobs": _opt(
        "integer",
        "vLLM's: per prompt token its log-prob, rank and this many alternatives, returned as "
        "prompt_logprobs (the first token null). Such a request takes no prefix-cache hit.",
        minimum=0,
        maximum=MAX_LOGPROBS,
    ),
    "return_token_ids": _opt("boolean", "vLLM's: add prompt_token_ids and token_ids."),
    **STRUCTURED,
    "cache_salt": _opt(
        "string",
        "vLLM's: requests share prefix-cache blocks only when their "
        "salts are equal; never changes the generated tokens.",
        minLength=1,
        maxLength=MAX_CACHE_SALT_CHARS,
    ),
    "logit_bias": {
        "type": ["object", "null"],
        "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "Token id (below the vocabulary size) -> bias added to its logit "
        "before sampling.",
    },
    "use_beam_search": {"enum": [False, None], "description": "Not supported."},
    "allowed_token_ids": _refused("Not supported: only null or []."),
    "bad_words": _refused("Not supported: only null or []."),
    "logits_processors": {"type": "null", "description": "Not supported."},
    "truncate_prompt_tokens": {"type": "null", "description": "Not supported."},
}

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

COMPLETION_REQUEST: Schema = {
    "type": "object",
    "required": ["prompt"],
    "additionalProperties": True,
    "properties": {
        "prompt": {
            "description": "A string, a list of strings, a list of token ids, or a list of "
            "such; one choice per prompt. Token ids must be below the model's vocabulary size.",
            "anyOf": [
                {"type": "string"},
                _TOKEN_IDS,
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {"anyOf": [{"type": "string"}, _TOKEN_IDS]},
                },
            ],
        },
        **COMMON,
        **SAMPLING,
        "logprobs": _opt(
            "integer",
            "Alternatives per token (0: only the chosen token's).",
            minimum=0,
            maximum=MAX_LOGPROBS,
        ),
        "max_tokens": _opt(
            "integer",
            "Most tokens to generate; prompt + max_tokens must fit the model's context. 0 (with "
            "echo or prompt_logprobs) scores the prompt and generates nothing.",
            minimum=0,
        ),
        "echo": _opt(
            "boolean",
            "Put the prompt in front of each choice's text, and with logprobs its tokens' "
            "log-probs in front of the generated ones (the first token's null).",
        ),
        "add_special_tokens": _opt("boolean", "Add the tokenizer's BOS to string prompts."),
        "best_of": _opt("integer", "Must equal n (no server-side selection)."),
        "suffix": {"type": "null", "description": "Not supported."},
    },
}

_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}

_TOOL_CALL_IN = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "The arguments as JSON text."},
            },
        },
    },
}

MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],
    "additionalProperties": True,
    "description": "Rendered by the model's chat template, which decides the roles it accepts. "
    "Tool calls and results (role tool, with tool_call_id) reach templates that know tools as "
    "transformers passes them; other templates see them written in Hermes' format.",
    "properties": {
        "role": {"type": "string", "examples": ["system", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]
        },
        "tool_calls": {
            "type": ["array", "null"],
            "items": _TOOL_CALL_IN,
            "description": "An assistant's past calls.",
        },
        "tool_call_id": _opt("string", "The call a tool message answers (required there)."),
    },
}

TOOL: Schema = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": _opt("string", "What the function does, for the model."),
                "parameters": _opt(
                    "object", "A JSON schema of the arguments (default: none); invalid: a 400."
                ),
            },
        },
    },
}

TOOL_FIELDS: Schema = {
    "tools": {
        "type": ["array", "null"],
        "items": ref("Tool"),
        "description": "Functions the model may call; names must be unique.",
    },
    "tool_choice": {
        "description": "none (calls not read), auto (default with tools: calls parsed from "
        "free text), required or {type: function, function: {name}} (a call forced by a "
        "grammar, its arguments valid for the schema). Anything but none needs tools.",
        "anyOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    },
                },
            },
            {"type": "null"},
        ],
    },
    "parallel_tool_calls": _opt("boolean", "With required: allow several calls (default true)."),
}

CHAT_REQUEST: Schema = {
    "type": "object",
    "required": ["messages"],
    "additionalProperties": True,
    "properties": {
        "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
        **COMMON,
        **SAMPLING,
        "max_tokens": _opt(
            "integer", "Most tokens to generate (default: the room the context leaves).", minimum=1
        ),
        "max_completion_tokens": _opt("integer", "Wins over max_tokens.", minimum=1),
        "logprobs": _opt("boolean", "Return the chosen tokens' log-probabilities."),
        "top_logprobs": _opt(
            "integer",
            "Alternatives per token; needs logprobs: true.",
            minimum=0,
            maximum=MAX_LOGPROBS,
        ),
        "add_generation_prompt": _opt("boolean", "Open the assistant's turn (default true)."),
        "chat_template_kwargs": _opt("object", "Extra variables for the chat template."),
        **TOOL_FIELDS,
        "functions": _refused("Not supported (legacy): only null or []; use tools."),
        "echo": {"enum": [False, None], "description": "Not supported on chat."},
        "function_call": {"type": "null", "description": "Not supported."},
        "audio": {"type": "null", "description": "Not supported."},
        "modalities": {
            "anyOf": [{"type": "null"}, {"const": ["text"]}],
            "description": "Text only.",
        },
        "web_search_options": {"type": "null", "description": "Not supported."},
    },
}

TOKENIZE_REQUEST: Schema = {
    "type": "object",
    "additionalProperties": True,
    "description": "vLLM's: a prompt string, or a chat's messages rendered as "
    "/v1/chat/completions prefills them (not both).",
    "properties": {
        "model": _opt("string", "The served model's id; any other is a 404."),
        "prompt": _opt("string", "Text to tokenise."),
        "messages": {"type": ["array", "null"], "items": ref("ChatMessage")},
        "tools": TOOL_FIELDS["tools"],
        "add_generation_prompt": _opt("boolean", "With messages: open the assistant's turn."),
        "add_special_tokens": _opt(
            "boolean", "With prompt: add BOS (default true); with messages only false."
        ),
        "chat_template_kwargs": _opt("object", "Extra variables for the chat template."),
        "return_token_strs": _opt("boolean", "Also return the vocabulary entries."),
    },
}
DETOKENIZE_REQUEST: Schema = {
    "type": "object",
    "required": ["tokens"],
    "additionalProperties": True,
    "properties": {
        "model": _opt("string", "The served model's id; any other is a 404."),
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
}
COMPONENT_SCHEMAS: dict[str, Schema] = {
    "CompletionRequest": COMPLETION_REQUEST,
    "ChatCompletionRequest": CHAT_REQUEST,
    "ChatMessage": MESSAGE,
    "Tool": TOOL,
    "Completion": COMPLETION,
    "CompletionChunk": COMPLETION_CHUNK,
    "ChatCompletion": CHAT_COMPLETION,
    "ChatCompletionChunk": CHAT_COMPLETION_CHUNK,
    "CompletionLogprobs": COMPLETION_LOGPROBS,
    "ChatLogprobs": CHAT_LOGPROBS,
    "PromptLogprobs": PROMPT_LOGPROBS,
    "TokenizeRequest": TOKENIZE_REQUEST,
    "TokenizeResponse": TOKENIZE_RESPONSE,
    "DetokenizeRequest": DETOKENIZE_REQUEST,
    "DetokenizeResponse": DETOKENIZE_RESPONSE,
    "Usage": USAGE,
    "ModelList": MODEL_LIST,
    "Health": HEALTH,
    "Error": ERROR,
}
