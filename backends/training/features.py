"""The target's features over the distilled sequences, computed once and kept for every epoch of training.

Both drafters learn from what the frozen target computes over its own answers: the published drafter attends to
several of its layers' hidden states at every earlier position, and both are scored against the target's
next-token distribution at every answer position. A target forward costs far more than a drafter's training
step, so it runs once per sequence here, in the target's serving precision, and the results are kept on disk
(safetensors): the selected layers' hidden states, the last hidden state (after the final norm), from which the
LM head gives the target's logits over any draft vocabulary, and the log of each position's softmax normaliser,
which turns those logits into probabilities without the other rows of the LM head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from backends.dspark.drafter import target_features
from backends.loading import LoadedModel
from backends.progress import JobProgress
from backends.training.distill import Distilled

FEATURES_FILE = "features.safetensors"
META_FILE = "features.json"
FORWARD_TOKENS = 4096
"""Padded positions per target forward while caching: large enough for the matrix units, small enough for RAM."""


@dataclass
class FeatureCache:
    """Every distilled sequence, concatenated: sequence i is rows ``offsets[i]:offsets[i + 1]``."""

    tokens: torch.Tensor
    """[N] token ids."""
    offsets: torch.Tensor
    """[S + 1]."""
    prompt_lens: torch.Tensor
    """[S]: the answer of sequence i starts at row offsets[i] + prompt_lens[i]."""
    features: torch.Tensor
    """[N, len(layer_ids) * hidden]: the published drafter's injected context."""
    final: torch.Tensor
    """[N, hidden]: the target's last hidden state, whose LM-head row r is the logit of token r next."""
    lse: torch.Tensor
    """[N] float32: logsumexp of the target's logits at each position."""
    layer_ids: list[int]

    @property
    def sequences(self) -> int:
        return len(self.prompt_lens)

    def span(self, index: int) -> slice:
        return slice(int(self.offsets[index]), int(self.offsets[index + 1]))

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {
            "tokens": self.tokens,
            "offsets": self.offsets,
            "prompt_lens": self.prompt_lens,
            "features": self.features,
            "final": self.final,
            "lse": self.lse,
        }
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / FEATURES_FILE)
        (folder / META_FILE).write_text(json.dumps({"layer_ids": self.layer_ids}) + "\n")

    @classmethod
    def load(cls, folder: Path) -> FeatureCache:
        tensors = load_file(folder / FEATURES_FILE)
        return cls(**tensors, layer_ids=json.loads((folder / META_FILE).read_text())["layer_ids"])

    @classmethod
    def exists(cls, folder: Path, layer_ids: list[int]) -> bool:
        meta = folder / META_FILE
        return (folder / FEATURES_FILE).is_file() and json.loads(meta.read_text())["layer_ids"] == layer_ids

    def to(self, device: torch.device | str) -> FeatureCache:
        """The cache on ``device`` (training reads it where the drafter trains)."""
        names = ("tokens", "offsets", "prompt_lens", "features", "final", "lse")
        return FeatureCache(**{name: getattr(self, name).to(device) for name in names}, layer_ids=self.layer_ids)


@torch.inference_mode()
def build_feature_cache(
    loaded: LoadedModel, records: list[Distilled], layer_ids: list[int], dtype: torch.dtype | None = None
) -> FeatureCache:
    """One target forward per group of similar-length sequences (right-padded: causal attention keeps padding out
    of every real position), kept where the model runs, hidden states in ``dtype`` (else the model's; bfloat16
    halves a large corpus's cache, and training computes in bfloat16 anyway)."""
    model = loaded.model
    lm_head = model.get_output_embeddings()
    order = sorted(range(len(records)), key=lambda i: len(records[i].tokens))
    lengths = torch.tensor([len(r.tokens) for r in records])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    total, hidden = int(offsets[-1]), model.config.get_text_config().hidden_size
    store, dtype = loaded.device, dtype or model.dtype
    features = torch.empty(total, len(layer_ids) * hidden, dtype=dtype, device=store)
    final = torch.empty(total, hidden, dtype=dtype, device=store)
    lse = torch.empty(total, dtype=torch.float32, device=store)
    tokens = torch.tensor([t for r in records for t in r.tokens], device=store)
    with JobProgress(log_every=200) as progress:
        task = progress.add_job("target features", total=len(records))
        start = 0
        while start < len(order):
            width = len(records[order[start]].tokens)
            group = [order[start]]
            while start + len(group) < len(order):
                candidate = order[start + len(group)]
                if (len(group) + 1) * len(records[candidate].tokens) > FORWARD_TOKENS:
                    break
                group.append(candidate)
                width = len(records[candidate].tokens)
            ids = torch.full((len(group), width), loaded.tokenizer.pad_token_id or 0, dtype=torch.long)
            for row, index in enumerate(group):
                ids[row, : len(records[index].tokens)] = torch.tensor(records[index].tokens)
            out = model.base_model(input_ids=ids.to(loaded.device), output_hidden_states=True)
            layers = target_features(out.hidden_states, layer_ids)
            for row, index in enumerate(group):
                n = len(records[index].tokens)
                rows = slice(int(offsets[index]), int(offsets[index]) + n)
                features[rows] = layers[row, :n].to(dtype)
                final[rows] = out.last_hidden_state[row, :n].to(dtype)
                lse[rows] = torch.logsumexp(lm_head(out.last_hidden_state[row, :n]).float(), dim=-1)
            start += len(group)
            progress.step(task, len(group))
    prompt_lens = torch.tensor([len(r.prompt) for r in records], device=store)
    return FeatureCache(tokens, offsets.to(store), prompt_lens, features, final, lse, list(layer_ids))
