"""Tiny random-weight checkpoints with a real byte-level BPE tokenizer, built in about a second.

Used by the test suite and by the ``tiny`` model preset. The weights are written by transformers
itself, so a checkpoint is a faithful Hugging Face directory that transformers can also load as a
numerical reference.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)

# ChatML, with block tags on their own lines so that trim_blocks/lstrip_blocks matter.
CHAT_TEMPLATE = (
    "{% for message in messages %}\n"
    "  {% if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "    {{ raise_exception('unknown role ' + message['role']) }}\n"
    "  {% endif %}\n"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still tell a story when the words
are simple and the sentences are short. Once upon a time there was a little town by the sea, and
in that town lived a baker who woke up every morning before the sun to bake bread for everyone.
The children liked the sweet rolls, the fishermen liked the dark rye, and the teacher liked the
soft white loaves that she shared with her students at lunch. What is the capital of France? The
capital of France is Paris. What is the capital of Italy? The capital of Italy is Rome. Hello,
how are you today? I am fine, thank you, and how are you? Please write a short poem about the
moon. The moon is bright, the night is long, the stars above all sing a song.
Numbers count too: one, two, three, four, five, six, seven, eight, nine, ten, 2024, 3.14, 100%.
Servers answer requests; a scheduler batches prompts, a cache keeps keys and values, and tokens
stream back to the user one by one until the model writes the end of the sentence. The weather
was cold in the winter and warm in the summer, and the river that ran through the valley carried
water from the mountains down to the fields where farmers grew wheat, corn, apples and grapes.
"Where are you going?" asked the girl. "To the market," said the old man, "to buy some milk,
eggs, cheese and honey." They walked together along the road, talking about the weather, their
families and the news from the city, until the bells of the church rang twelve times at noon.
"""

_CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
}


@functools.lru_cache(maxsize=8)
def tokenizer_json(vocab_size: int) -> str:
    """Train (once per process and size) a byte-level BPE tokenizer on :data:`CORPUS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus makes every pair frequent enough to fill the vocabulary.
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer.to_str()


def write_tokenizer(path: Path, vocab_size: int) -> tuple[int, list[int]]:
    """Write tokenizer files into ``path``; returns ``(bos_id, eos_ids)``."""
    from tokenizers import Tokenizer

    text = tokenizer_json(vocab_size)
    vocab = Tokenizer.from_str(text).get_vocab(with_added_tokens=True)
    (path / "tokenizer.json").write_text(text, encoding="utf-8")
    bos_id = vocab[BOS_TOKEN]
    eos_ids = [vocab[EOS_TOKEN], vocab[IM_END]]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        # The dict spelling is common on the Hub; keeping it here exercises that parser path.
        "eos_token": {
            "__type": "AddedToken",
            "content": EOS_TOKEN,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
        "add_bos_token": True,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_ids}
    (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return bos_id, eos_ids


def build_tiny_checkpoint(
    path: str | Path,
    *,
    architecture: str = "LlamaForCausalLM",
    dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    rope_scaling: dict[str, Any] | None = None,
    sharded: bool = False,
) -> Path:
    """Write a seeded random-weight checkpoint plus tokenizer into ``path`` and return it."""
    import transformers

    if architecture not in _CONFIG_CLASSES:
        raise ValueError(f"unsupported architecture {architecture!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bos_id, eos_ids = write_tokenizer(path, vocab_size)

    config_kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_id,
        # config.json names only the plain EOS; generation_config.json lists both stop tokens.
        "eos_token_id": eos_ids[0],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})},
    }
    if architecture == "Qwen3ForCausalLM":
        config_kwargs["head_dim"] = hidden_size // num_heads
    if architecture == "MistralForCausalLM":
        config_kwargs["sliding_window"] = None
    config = getattr(transformers, _CONFIG_CLASSES[architecture])(**config_kwargs)
    model_class = getattr(transformers, architecture)

    generator = torch.Generator().manual_seed(seed)
    # Model construction draws from the global RNG; fork it so callers' RNG state is untouched.
    with torch.random.fork_rng(devices=[]):
        model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and "norm" in name:
                # Norm gains near 1, but not exactly 1, so a norm weight that fails to load shows.
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.ndim == 1:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            else:
                # A larger std than transformers' 0.02 gives peaked logits, so greedy ties are rare.
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    model = model.to(dtype)
    model.save_pretrained(path, max_shard_size="60KB" if sharded else "10GB")
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_ids}
    (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return path
