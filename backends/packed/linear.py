"""Linear layers multiplied as the packed engine multiplies: from 8-bit (or the GGUF's own) blocks, with activations
rounded to int8 per block of 32.

A drafter's round on a CPU is bound by reading its weights, as the target's step is: the published drafter's two
layers hold 32 MB in float32 and its draft vocabulary's rows of the LM head 38 MB, read every round, which cost
more than a whole packed step of the target. Served from Q8_0 blocks they read a quarter of that. Only serving
swaps them in (:meth:`backends.dspark.drafter.DSparkDrafter.serve_from`, whose backbone runs the same blocks in one
compiled call, and :meth:`backends.dspark.vocab.DraftVocab.serve_from`): training keeps the float32 layers and
their gradients. A drafter only proposes, so its rounding changes what it drafts, never what
verification commits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf
import torch
from torch import nn

from backends.packed.build import kernels
from backends.packed.pool import compute_pool
from backends.packed.weights import KERNEL_TYPES, BlockTensor, tiled

QUANTIZED = gguf.GGMLQuantizationType.Q8_0
BLOCK = gguf.GGML_QUANT_SIZES[QUANTIZED][0]
"""Weights a block holds: a layer's input width must be a multiple of it."""


class PackedLinear(nn.Module):
    """``y = x W^T (+ b)`` through the kernels' ``matmul`` of a packed W [out_features, in_features]."""

    def __init__(
        self,
        matmul: Callable[[torch.Tensor], torch.Tensor],
        out_features: int,
        in_features: int,
        bias=None,
        matrix: Any = None,
    ) -> None:
        super().__init__()
        self.matmul, self.out_features, self.in_features = matmul, out_features, in_features
        self.bias = bias
        self.matrix = matrix
        """The kernels' ``PackedMatrix`` where the layer is a matrix of its own (for calls beyond ``matmul``, such as
        the Markov head's ``greedy_chain``), else None: rows of the engine's LM head."""

    @classmethod
    def of_blocks(cls, matrix: BlockTensor, pool: Any = None) -> PackedLinear:
        """A matrix in a GGUF block format the kernels read, multiplied on ``pool`` (None: the default one; a
        drafter's layers run on the pool of the target they serve beside)."""
        pool = pool or compute_pool()
        packed = kernels().PackedMatrix(tiled(matrix), KERNEL_TYPES[matrix.ggml_type], *matrix.shape, pool)
        return cls(packed.matmul, *matrix.shape, matrix=packed)

    @classmethod
    def quantized(cls, linear: nn.Linear, pool: Any = None) -> PackedLinear:
        """``linear``'s weight rounded to Q8_0 blocks (as llama.cpp's quantiser rounds them)."""
        packed = cls.of_blocks(q8_blocks(linear.weight), pool)
        packed.bias = None if linear.bias is None else linear.bias.detach()
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features).float().contiguous())
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


def q8_blocks(weight: torch.Tensor) -> BlockTensor:
    """A weight [out, in] rounded to Q8_0 blocks, as llama.cpp's quantiser rounds them."""
    array = weight.detach().float().cpu().numpy()
    return BlockTensor(torch.from_numpy(gguf.quants.quantize(array, QUANTIZED)), QUANTIZED, tuple(array.shape))
