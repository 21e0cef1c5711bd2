"""Build small causal LMs from nothing: a byte-level BPE tokenizer trained on the spot and a fresh model.

Nothing may be downloaded here, so the tests' tiny models start from
this module: the same tokenizer recipe (ChatML-style chat template, EOS that the model config agrees with)
and the same model configs, saved in Hugging Face format.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

Architecture = Literal["llama", "gpt2", "qwen3"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE, so every string round-trips through encode/decode."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        bos_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(
    arch: Architecture,
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    context: int = 512,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised model whose config's EOS ids are the tokenizer's (so generate() agrees)."""
    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(END_OF_TEXT)]
    common = {"vocab_size": len(tokenizer), "eos_token_id": eos, "bos_token_id": eos[1], "pad_token_id": eos[1]}
    decoder = {
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": context,
        "tie_word_embeddings": True,
        **common,
    }
    if arch == "llama":
        config = LlamaConfig(num_key_value_heads=heads, **decoder)
    elif arch == "qwen3":  # grouped-query attention and an explicit head_dim, as Qwen3 checkpoints have
        config = Qwen3Config(num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads, **decoder)
    elif arch == "gpt2":
        config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=context, **common)
    else:
        raise ValueError(f"unknown architecture {arch!r}; choose llama, gpt2 or qwen3")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos[1]
    return model.eval()


def save_pretrained(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def stdlib_texts(limit: int = 40) -> list[str]:
    """Python sources that every interpreter carries: an offline corpus for tokenizers and smoke training."""
    sources = [inspect.getsource(module) for module in (ast, inspect, json, textwrap)]
    lines = "\n".join(sources).splitlines()
    chunk = max(1, len(lines) // limit)
    return ["\n".join(lines[i : i + chunk]) for i in range(0, len(lines), chunk)][:limit]
