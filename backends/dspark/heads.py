"""Span heads: K-1 small residual blocks that let one forward pass predict the next 1..K tokens.

Head k maps the base model's last hidden state h at position t to a distribution over token t+1+k through a
residual block, h + SiLU(W_k h + b_k), and the base model's own LM head. W_k and b_k start at zero, so an
untrained head is a copy of next-token prediction and only has to learn the shift.
The config travels beside the model as ``dspark_config.json``, the weights as ``dspark_heads.safetensors``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from backends.errors import ModelLoadError

CONFIG_FILE = "dspark_config.json"
WEIGHTS_FILE = "dspark_heads.safetensors"


@dataclass
class DSparkConfig:
    """How many heads a model carries and the span policy it was tuned with (the pool's defaults)."""

    num_heads: int = 3
    hidden_size: int = 0
    span_lengths: list[int] = field(default_factory=lambda: [1, 2, 4])
    thresholds: dict[int, float] = field(default_factory=lambda: {2: 0.6, 4: 0.85})

    def save(self, path: Path) -> None:
        (path / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> DSparkConfig:
        file = path / CONFIG_FILE
        if not file.is_file():
            raise ModelLoadError(
                f"{str(path)!r} has no DSpark heads ({CONFIG_FILE} missing); train them with "
                "`dspark-router train --mode heads` or use the autoregressive backend",
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

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits of shape [num_heads, *hidden.shape[:-1], vocab]: head k predicts the token k+2 ahead."""
        bias = self.bias.view(self.config.num_heads, *[1] * (hidden.dim() - 1), self.config.hidden_size)
        shift = torch.einsum("...d,hed->h...e", hidden, self.weight) + bias
        return lm_head(hidden.unsqueeze(0) + F.silu(shift))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, path / WEIGHTS_FILE)

    @classmethod
    def load(cls, path: str | Path, device: torch.device, dtype: torch.dtype) -> SpanHeads:
        path = Path(path)
        heads = cls(DSparkConfig.load(path))
        if not (path / WEIGHTS_FILE).is_file():
            raise ModelLoadError(f"{str(path)!r} has {CONFIG_FILE} but no {WEIGHTS_FILE}", param="model")
        try:
            heads.load_state_dict(load_file(path / WEIGHTS_FILE))
        except RuntimeError as exc:
            raise ModelLoadError(f"DSpark heads in {str(path)!r} do not fit their config: {exc}") from exc
        return heads.to(device=device, dtype=dtype).eval()
