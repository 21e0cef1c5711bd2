"""A GGUF's tensors as they ship, copied once into the model folder: what the packed engine reads.

A GGUF stores each weight matrix as rows of fixed-size blocks (Q4_1: 32 weights in 20 bytes, ``w = d * q + m``;
Q8_0: 32 in 34 bytes, ``w = d * q``). The packed engine (:mod:`backends.packed.model`) multiplies by those blocks
directly, so nothing is dequantised ahead of time and a forward reads the 4-bit bytes, not float copies of them.
Conversion (:mod:`backends.convert`) writes the blocks here, beside the float32 Hugging Face folder that stays the
reference: :data:`PACKED_FILE`, one uint8 tensor per quantised matrix and float32 for the rest, each tensor's
GGML type in the file's metadata. Float16 and bfloat16 matrices are kept as float32; a block format the engine
has no kernel for leaves the folder without a packed file, served by transformers as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors import safe_open
from safetensors.torch import save_file

PACKED_FILE = "gguf_blocks.safetensors"
KERNEL_TYPES = {
    GGMLQuantizationType.F32: 0,
    GGMLQuantizationType.Q4_1: 3,
    GGMLQuantizationType.Q8_0: 8,
}
"""The GGML types the engine's kernels multiply by, with the ids the kernels know them by (GGML's own)."""
WIDENED = (GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
"""Kept as float32: exact, and too rare in a quantised GGUF to deserve kernels of their own."""


class UnsupportedBlocks(ValueError):
    """A GGUF tensor in a block format the packed engine cannot multiply by."""


@dataclass(frozen=True)
class BlockTensor:
    """One GGUF tensor: ``data`` is uint8 [rows, row bytes] for a quantised matrix, float32 otherwise."""

    data: torch.Tensor
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """The logical shape, rows first (a matrix is [out_features, in_features], as torch has it)."""


def read_gguf(path: Path) -> dict[str, BlockTensor]:
    """Every tensor of a GGUF file as stored; :class:`UnsupportedBlocks` names the first one no kernel reads."""
    tensors = {}
    for tensor in GGUFReader(path).tensors:
        kind = GGMLQuantizationType(tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if kind in WIDENED:
            data = torch.from_numpy(np.asarray(tensor.data, dtype=np.float32).copy())
            kind = GGMLQuantizationType.F32
        elif kind in KERNEL_TYPES:
            data = torch.from_numpy(np.array(tensor.data))
        else:
            raise UnsupportedBlocks(f"{tensor.name} is {kind.name}; the packed engine reads {_names()}")
        tensors[tensor.name] = BlockTensor(data, kind, shape)
    return tensors


def write_packed(tensors: dict[str, BlockTensor], out: Path) -> Path:
    """The tensors into ``out``/:data:`PACKED_FILE`, their types and shapes in its metadata."""
    meta = {name: {"type": int(t.ggml_type), "shape": list(t.shape)} for name, t in tensors.items()}
    path = out / PACKED_FILE
    save_file({name: t.data.contiguous() for name, t in tensors.items()}, path, metadata={"tensors": json.dumps(meta)})
    return path


def read_packed(folder: Path) -> dict[str, BlockTensor]:
    """What :func:`write_packed` wrote."""
    path = folder / PACKED_FILE
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["tensors"])
        return {
            name: BlockTensor(f.get_tensor(name), GGMLQuantizationType(info["type"]), tuple(info["shape"]))
            for name, info in meta.items()
        }


def pack_gguf(gguf: Path, out: Path) -> Path | None:
    """The GGUF's blocks into ``out``; None (and nothing written) where a tensor has a format no kernel reads."""
    try:
        tensors = read_gguf(gguf)
    except UnsupportedBlocks:
        return None
    return write_packed(tensors, out)


def _names() -> str:
    return ", ".join(t.name for t in (*KERNEL_TYPES, *WIDENED))
