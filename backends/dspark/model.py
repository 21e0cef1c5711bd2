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
        return cls(loaded, SpanHeads.load(path, loaded.model.get_output_embeddings()))

    @classmethod
    def with_new_heads(
        cls, loaded: LoadedModel, num_heads: int = 3, draft_vocab: torch.Tensor | None = None
    ) -> DSparkModel:
        """Fresh, untrained heads (each starts as a copy of the LM head, over ``draft_vocab`` when given): the
        start of heads-only training."""
        hidden = loaded.model.config.get_text_config().hidden_size
        config = DSparkConfig(
            num_heads=num_heads, hidden_size=hidden, draft_vocab_size=None if draft_vocab is None else len(draft_vocab)
        )
        heads = SpanHeads(config)
        if draft_vocab is not None:
            heads.draft_vocab.copy_(draft_vocab)
        heads.to(device=loaded.device, dtype=loaded.model.dtype)
        return cls(loaded, heads.bind_vocab(loaded.model.get_output_embeddings()))

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
