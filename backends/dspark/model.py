"""A causal LM with span heads: the base model, unchanged, plus the heads that draft past its next token."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache

from backends.dspark.heads import DSparkConfig, SpanHeads
from backends.loading import LoadedModel, load_model


class DSparkModel:
    def __init__(self, loaded: LoadedModel, heads: SpanHeads) -> None:
        self.loaded = loaded
        self.heads = heads
        self.base = loaded.model.base_model
        self.lm_head = loaded.model.get_output_embeddings()
        self.config = loaded.model.config

    @property
    def dspark_config(self) -> DSparkConfig:
        return self.heads.config

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "auto", dtype: str = "auto") -> DSparkModel:
        """Base model and heads from one folder; a folder without heads is a ModelLoadError."""
        loaded = load_model(path, device=device, dtype=dtype)
        heads = SpanHeads.load(path, device=loaded.device, dtype=loaded.model.dtype)
        return cls(loaded, heads)

    @classmethod
    def with_new_heads(cls, loaded: LoadedModel, num_heads: int = 3) -> DSparkModel:
        """Fresh, untrained heads (each starts as a copy of the LM head): the start of heads-only training."""
        config = DSparkConfig(num_heads=num_heads, hidden_size=loaded.model.config.get_text_config().hidden_size)
        heads = SpanHeads(config).to(device=loaded.device, dtype=loaded.model.dtype)
        return cls(loaded, heads)

    def forward(self, tokens: list[int], cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``tokens`` to the cache; the last hidden state and base logits at each of their positions."""
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.loaded.device)
        hidden = self.base(input_ids=input_ids, cache=cache, use_cache=True).last_hidden_state[0]
        return hidden, self.lm_head(hidden)

    def save(self, path: str | Path) -> None:
        """Base model, tokenizer and heads in one Hugging Face folder."""
        self.loaded.model.save_pretrained(path)
        self.loaded.tokenizer.save_pretrained(path)
        self.heads.save(path)
