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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from safetensors import safe_open
from safetensors.torch import save_file

from backends.precision import PACKED_FILE

TILE_ROWS = 16
"""Weight rows a tile interleaves: one lane of a 16-lane vector each (kernels.cpp)."""
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


def tiled(matrix: BlockTensor) -> torch.Tensor:
    """A Q4_1 or Q8_0 matrix as the kernels multiply by it: uint8 [tiles, blocks x tile bytes], each tile
    :data:`TILE_ROWS` rows (the last padded with zero blocks), so one vector lane holds one output row and a
    block's integer dot product needs no horizontal sum.

    The bytes are the GGUF's own, rearranged per tile and block of 32 columns: Q4_1's 16 nibble bytes a row go in
    4-byte groups (group g holds every row's bytes 4g..4g+3: low nibbles are columns 4g.., high nibbles 16 + 4g..),
    then the rows' fp16 ``d`` and fp16 ``m``; Q8_0's 32 signed bytes go in eight 4-byte groups, then the fp16
    ``d`` and each row's sum of ``q`` as int16 (what VNNI's unsigned-by-signed product needs to multiply signed
    activations). 320 bytes for 16 Q4_1 rows of a block (as in the GGUF), 576 for Q8_0 (544 in the GGUF).
    """
    rows = matrix.shape[0]
    block = GGML_QUANT_SIZES[matrix.ggml_type][1]
    data = matrix.data.reshape(rows, -1, block)
    pad = -rows % TILE_ROWS
    if pad:
        data = torch.cat([data, torch.zeros(pad, *data.shape[1:], dtype=torch.uint8)])
    tiles, blocks = data.shape[0] // TILE_ROWS, data.shape[1]
    per_tile = data.reshape(tiles, TILE_ROWS, blocks, block).transpose(1, 2)  # [tiles, blocks, 16, block bytes]
    if matrix.ggml_type == GGMLQuantizationType.Q4_1:
        d, m, q = per_tile[..., 0:2], per_tile[..., 2:4], per_tile[..., 4:]
        groups = q.reshape(tiles, blocks, TILE_ROWS, 4, 4).transpose(2, 3)
        parts = [groups, d, m]
    else:
        d, q = per_tile[..., 0:2], per_tile[..., 2:]
        groups = q.reshape(tiles, blocks, TILE_ROWS, 8, 4).transpose(2, 3)
        sums = q.contiguous().view(torch.int8).to(torch.int16).sum(-1, dtype=torch.int16)
        parts = [groups, d, sums.contiguous().view(torch.uint8)]
    flat = [part.reshape(tiles, blocks, -1) for part in parts]
    return torch.cat(flat, dim=-1).reshape(tiles, -1).contiguous()
