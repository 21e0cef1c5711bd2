"""The published DSpark drafter's checkpoint layout: DeepSpec's ``Qwen3DSparkModel`` folders.

A drafter folder holds ``config.json`` and ``model.safetensors``. The config is the target's own config with the
drafter's keys laid over it (``num_hidden_layers`` becomes the drafter's depth; ``block_size``,
``num_target_layers``, ``target_layer_ids``, ``mask_token_id``, ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov`` are added), exactly as DeepSpec's
``build_draft_config`` writes it, so a released drafter (``deepseek-ai/dspark_qwen3_4b_block7``) loads here and
one trained here loads in DeepSpec, vLLM and SGLang (``DSparkDrafter.export`` writes the whole layout). Two keys are
ours and other readers ignore them: ``confidence_temperatures``, the Sequential Temperature Scaling result, and
``draft_vocab_size``, the size of a reduced draft vocabulary (:mod:`backends.dspark.vocab`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from backends.errors import ModelLoadError

DRAFTER_DIR = "dspark_drafter"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "Qwen3DSparkModel"
DEFAULT_BLOCK_SIZE = 7
DEFAULT_LAYERS = 2
"""Backbone layers of a fresh drafter: the paper's two already beat a 5-layer DFlash."""
# DeepSpec samples 512 anchors per training sequence and requires the key; it means nothing at inference.
DEFAULT_NUM_ANCHORS = 512
OWN_KEYS = ("confidence_temperatures", "draft_vocab_size")
"""Keys of ours that DeepSpec's readers ignore."""
REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "block_size",
    "num_target_layers",
    "target_layer_ids",
    "mask_token_id",
    "markov_rank",
    "enable_confidence_head",
)


def default_target_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """Evenly spread layers from the second to the third-last, as DeepSpec picks them (Qwen3-4B: 1, 9, 17, 25,
    33). The last layer is never used: Hugging Face returns it after the final norm, not as a layer output."""
    if num_target_layers < 5:
        return list(range(num_target_layers - 1)) or [-1]
    last = num_target_layers - 3
    return sorted({round(1 + i * (last - 1) / (count - 1)) for i in range(count)})


def is_drafter_dir(path: Path) -> bool:
    """Whether ``path`` holds a published drafter (a target's own folder has a config.json too, of another
    architecture)."""
    file = path / CONFIG_FILE
    if not file.is_file():
        return False
    try:
        return ARCHITECTURE in json.loads(file.read_text()).get("architectures", [])
    except (json.JSONDecodeError, AttributeError):
        return False


@dataclass
class DrafterConfig:
    """The drafter's shape. Its width is the target's: it shares the target's embedding and LM head."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = DEFAULT_BLOCK_SIZE
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    confidence_temperatures: list[float] | None = None
    draft_vocab_size: int | None = None
    """Tokens the drafter proposes (its ``draft_vocab`` weights: target ids), None for the whole vocabulary."""
    target_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        ids = self.target_layer_ids
        if not ids or ids != sorted(set(ids)) or ids[0] < -1 or ids[-1] > self.num_target_layers - 2:
            raise ModelLoadError(
                f"target_layer_ids {ids} must be strictly increasing within -1..{self.num_target_layers - 2} "
                "(-1 is the embedding output; the target's last layer is not a usable feature)",
                param="drafter",
            )
        if self.markov_head_type != "vanilla" or self.markov_rank < 1:
            raise ModelLoadError(
                f"only the vanilla Markov head with markov_rank >= 1 is implemented, got "
                f"{self.markov_head_type!r} with rank {self.markov_rank}",
                param="drafter",
            )
        if self.enable_confidence_head and not self.confidence_head_with_markov:
            raise ModelLoadError("a confidence head without the Markov features is not implemented", param="drafter")

    @property
    def context_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def for_target(
        cls,
        target: PretrainedConfig,
        *,
        mask_token_id: int,
        num_layers: int = DEFAULT_LAYERS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        markov_rank: int = 256,
        target_layer_ids: list[int] | None = None,
    ) -> DrafterConfig:
        """A drafter shaped like the target's layers (Qwen3-style, whatever the target's family)."""
        text = target.get_text_config()
        heads = int(text.num_attention_heads)
        hidden = int(text.hidden_size)
        layers = int(text.num_hidden_layers)
        rope = getattr(text, "rope_parameters", None) or {}
        return cls(
            hidden_size=hidden,
            intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * hidden),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            vocab_size=int(text.vocab_size),
            num_target_layers=layers,
            target_layer_ids=target_layer_ids or default_target_layer_ids(layers),
            mask_token_id=mask_token_id,
            block_size=block_size,
            markov_rank=markov_rank,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 1e-6),
            rope_theta=float(rope.get("rope_theta") or getattr(text, "rope_theta", None) or 1_000_000.0),
            target_config=text.to_dict(),
        )

    def to_json(self) -> dict[str, Any]:
        """The target's config with the drafter's keys over it, as DeepSpec's ``build_draft_config`` writes it."""
        drafter = {
            "architectures": [ARCHITECTURE],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": self.target_layer_ids,
            "num_anchors": self.target_config.get("num_anchors", DEFAULT_NUM_ANCHORS),
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
        }
        if self.confidence_temperatures is not None:
            drafter["confidence_temperatures"] = self.confidence_temperatures
        if self.draft_vocab_size is not None:
            drafter["draft_vocab_size"] = self.draft_vocab_size
        target = {k: v for k, v in self.target_config.items() if k not in OWN_KEYS}
        return {**target, **drafter}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> DrafterConfig:
        missing = [key for key in REQUIRED_KEYS if key not in raw]
        if missing:
            raise ModelLoadError(f"drafter config.json lacks {', '.join(missing)}", param="drafter")
        heads = int(raw["num_attention_heads"])
        rope = raw.get("rope_parameters") or {}
        return cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw.get("intermediate_size") or 4 * int(raw["hidden_size"])),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            vocab_size=int(raw["vocab_size"]),
            num_target_layers=int(raw["num_target_layers"]),
            target_layer_ids=[int(i) for i in raw["target_layer_ids"]],
            mask_token_id=int(raw["mask_token_id"]),
            block_size=int(raw["block_size"]),
            markov_rank=int(raw["markov_rank"]),
            markov_head_type=str(raw.get("markov_head_type", "vanilla")),
            enable_confidence_head=bool(raw["enable_confidence_head"]),
            confidence_head_with_markov=bool(raw.get("confidence_head_with_markov", False)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 1_000_000.0),
            attention_bias=bool(raw.get("attention_bias", False)),
            confidence_temperatures=raw.get("confidence_temperatures"),
            draft_vocab_size=raw.get("draft_vocab_size"),
            target_config=raw,
        )

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> DrafterConfig:
        file = path / CONFIG_FILE
        if not file.is_file():
            raise ModelLoadError(f"{str(path)!r} holds no DSpark drafter ({CONFIG_FILE} missing)", param="drafter")
        raw = json.loads(file.read_text())
        if ARCHITECTURE not in raw.get("architectures", []):
            raise ModelLoadError(
                f"{str(path)!r} is not a DSpark drafter (architectures {raw.get('architectures')})", param="drafter"
            )
        return cls.from_json(raw)
