"""Span heads: K-1 small residual blocks that let one forward pass predict the next 1..K tokens.

Head k maps the base model's last hidden state h at position t to a distribution over token t+1+k through a
residual block, h + SiLU(W_k h + b_k), and the base model's own LM head, over a reduced draft vocabulary when
the heads were trained with one (:mod:`backends.dspark.vocab`). W_k and b_k start at zero, so an untrained head
is a copy of next-token prediction and only has to learn the shift.
The config travels as ``dspark_config.json``, the weights (with ``draft_vocab``) as ``dspark_heads.safetensors``,
beside the model or in a drafter folder of their own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from backends.dspark.vocab import DraftVocab
from backends.errors import ModelLoadError
from backends.packed.model import PackedLlama

CONFIG_FILE = "dspark_config.json"
WEIGHTS_FILE = "dspark_heads.safetensors"


@dataclass
class DSparkConfig:
    """How many heads a model carries and the span policy it was tuned with (the pool's defaults)."""

    num_heads: int = 3
    hidden_size: int = 0
    span_lengths: list[int] = field(default_factory=lambda: [1, 2, 4])
    thresholds: dict[int, float] = field(default_factory=lambda: {2: 0.6, 4: 0.85})
    draft_vocab_size: int | None = None

    def save(self, path: Path) -> None:
        (path / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> DSparkConfig:
        file = path / CONFIG_FILE
        if not file.is_file():
            raise ModelLoadError(
                f"{str(path)!r} has no DSpark heads ({CONFIG_FILE} missing); train them with "
                "`dspark-router train heads` or use the autoregressive backend",
                param="model",
            )
        raw = json.loads(file.read_text())
        raw["thresholds"] = {int(k): float(v) for k, v in raw.get("thresholds", {}).items()}
        return cls(**raw)


class SpanHeads(nn.Module):
    """All heads' residual blocks as one stacked weight: a decode step drafts every offset with one batched
    matmul and one LM-head call, which matters when a step's whole budget is a few milliseconds."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.config = config
        size, heads = config.hidden_size, config.num_heads
        self.weight = nn.Parameter(torch.zeros(heads, size, size))
        self.bias = nn.Parameter(torch.zeros(heads, size))
        if config.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size))
        self.vocab: DraftVocab | None = None

    def serve_from(self, packed: PackedLlama) -> None:
        """Draft logits from the LM head's GGUF blocks on the packed engine (serving only)."""
        self.vocab.serve_from(packed)

    def bind_vocab(self, lm_head: nn.Module) -> SpanHeads:
        """Take the draft vocabulary's rows from the target's LM head (once both are where they will run)."""
        self.vocab = DraftVocab(lm_head, getattr(self, "draft_vocab", None))
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of shape [num_heads, *hidden.shape[:-1], draft vocab]: head k predicts the token k+2 ahead."""
        bias = self.bias.view(self.config.num_heads, *[1] * (hidden.dim() - 1), self.config.hidden_size)
        shift = torch.einsum("...d,hed->h...e", hidden, self.weight) + bias
        return self.vocab.logits(hidden.unsqueeze(0) + F.silu(shift))

    def save(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path)
        weights = {}
        for name, value in self.state_dict().items():
            value = value.detach().contiguous().cpu()
            weights[name] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
        save_file(weights, path / WEIGHTS_FILE)

    @classmethod
    def load(cls, path: str | Path, lm_head: nn.Module) -> SpanHeads:
        """Heads on ``lm_head``'s device and dtype."""
        path = Path(path)
        heads = cls(DSparkConfig.load(path))
        if not (path / WEIGHTS_FILE).is_file():
            raise ModelLoadError(f"{str(path)!r} has {CONFIG_FILE} but no {WEIGHTS_FILE}", param="model")
        try:
            heads.load_state_dict(load_file(path / WEIGHTS_FILE))
        except RuntimeError as exc:
            raise ModelLoadError(f"DSpark heads in {str(path)!r} do not fit their config: {exc}") from exc
        weight = lm_head.weight
        return heads.to(device=weight.device, dtype=weight.dtype).bind_vocab(lm_head).eval()
