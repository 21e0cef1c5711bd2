"""``python -m benchmarks.gpu.preflight``: what a GPU script needs, checked in seconds before minutes are spent.

Every module our code imports on the serving and training paths, at the versions it needs (transformers: the
``cache`` keyword of a model's forward, from 5.24; the machine's image had 5.17), the device, and the GGUF where one
is named. Prints one line a check and exits 1 at the first that fails, naming it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import version
from pathlib import Path

from packaging.version import Version

NEEDED = {
    "torch": ("torch", "2.4"),
    "transformers": ("transformers", "5.24"),
    "tokenizers": ("tokenizers", "0.20"),
    "safetensors": ("safetensors", "0.4"),
    "gguf": ("gguf", "0.10"),
    "pydantic": ("pydantic", "2.7"),
    "llguidance": ("llguidance", "1.0"),
    "jsonschema": ("jsonschema", "4.20"),
    "jinja2": ("jinja2", "3.1"),
    "yaml": ("pyyaml", None),
    "numpy": ("numpy", None),
    "sklearn": ("scikit-learn", None),
    "rich": ("rich", None),
    "matplotlib": ("matplotlib", None),
}
"""Module to its distribution and the least version it must have (None: any). The router's gateway, Redis and
litellm modules are not on these paths."""


def check(device: str, gguf: Path | None, sha256: str | None) -> list[str]:
    """The lines of every check that passed; raises SystemExit(1) at the first that fails."""
    passed = []
    for name, (distribution, least) in NEEDED.items():
        try:
            importlib.import_module(name)
        except ImportError as exc:
            _fail(f"{name}: not importable ({exc}); carry its wheel (python -m benchmarks.gpu.cargo prepare)")
        installed = version(distribution)
        if least is not None and Version(installed.split("+")[0]) < Version(least):
            _fail(f"{distribution} {installed}: {least} or newer is needed")
        passed.append(f"{distribution} {installed}")
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            _fail("cuda: torch sees no GPU")
        passed.append(f"cuda: {torch.cuda.get_device_name()}")
    if gguf is not None:
        from backends.convert import sha256_of

        if not gguf.is_file():
            _fail(f"{gguf}: no such file (the cargo's parts not all unpacked?)")
        digest = sha256_of(gguf)
        if sha256 is not None and digest != sha256:
            _fail(f"{gguf}: sha256 {digest}, expected {sha256}")
        passed.append(f"{gguf.name} sha256 {digest[:12]}")
    return passed


def _fail(message: str) -> None:
    print(f"preflight failed: {message}", flush=True)
    raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.preflight", description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gguf", type=Path, help="the model file a script will convert")
    parser.add_argument("--sha256", help="its expected digest")
    args = parser.parse_args(argv)
    for line in check(args.device, args.gguf, args.sha256):
        print(f"ok  {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
