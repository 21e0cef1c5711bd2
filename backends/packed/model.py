"""The target as the packed engine serves it: a Llama-family model read from its GGUF blocks.

:class:`PackedLlama` holds the blocks (:mod:`backends.packed.weights`) and one compiled ``PackedModel``
(``kernels.cpp``) that runs a whole forward in one call. It keeps the GGUF's row order: llama.cpp's converter
interleaves each head's query and key rows, so RoPE here rotates adjacent pairs, which gives the same attention
scores as transformers' rotate-half on the original order. Everything else (hidden states, logits) comes out in
the reference model's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from transformers import AutoConfig

from backends.errors import ModelLoadError
from backends.packed.build import kernels
from backends.packed.linear import PackedLinear
from backends.packed.pool import compute_pool
from backends.packed.weights import KERNEL_TYPES, BlockTensor, read_packed, tiled

KEY_CHUNK = 16
"""Positions a key cache stores side by side (kernels.cpp's attention scores one vector of them at once)."""
CACHE_DTYPE = torch.float16
"""What the KV cache stores, as llama.cpp's default cache does: a decoding step's attention reads every cached key
and value, so it runs at memory speed, and half the bytes take half the time (after 4,096 tokens the float32 cache
was 189 MB a step, twice the weights). Keys and values of the 135M model stay below 25 in magnitude, far inside
fp16's range, and its 11-bit precision is finer than the int8 rounding of every activation the weights meet."""


@dataclass(frozen=True)
class PackedShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int


class PackedLlama:
    def __init__(self, folder: Path, threads: int | None = None) -> None:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        if config.model_type != "llama":
            raise ModelLoadError(f"the packed engine runs Llama-family models, not {config.model_type}", param="model")
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
        if rope.get("rope_type", "default") != "default":
            raise ModelLoadError(f"the packed engine has no {rope['rope_type']} RoPE scaling", param="model")
        self.shape = PackedShape(
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            ffn=config.intermediate_size,
            layers=config.num_hidden_layers,
            vocab=config.vocab_size,
            eps=float(config.rms_norm_eps),
            rope_theta=float(rope["rope_theta"]),
            max_positions=config.max_position_embeddings,
        )
        tensors = read_packed(folder)
        matrices = [_tensor(tensors, "token_embd.weight"), tensors.get("output.weight") or tensors["token_embd.weight"]]
        norms = [_tensor(tensors, "output_norm.weight").data]
        for layer in range(self.shape.layers):
            block = f"blk.{layer}."
            matrices += [
                _rows([_tensor(tensors, block + n) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]),
                _tensor(tensors, block + "attn_output.weight"),
                _rows([_tensor(tensors, block + n) for n in ("ffn_gate.weight", "ffn_up.weight")]),
                _tensor(tensors, block + "ffn_down.weight"),
            ]
            norms += [_tensor(tensors, block + n).data for n in ("attn_norm.weight", "ffn_norm.weight")]
        self.lm_head = matrices[1]
        stored = [_bytes(matrices[0])] + [_kernel_layout(m) for m in matrices[1:]]
        self.weight_bytes = sum(m.numel() for m in stored[1:])
        """Bytes a forward reads from the weight matrices (the LM head and every layer; the embedding gives one row
        a token): the weight-read floor's numerator."""
        cos, sin = rope_tables(self.shape)
        self.pool = compute_pool(threads)
        """The threads every forward runs on (:mod:`backends.packed.pool`), and the drafters' calls beside it."""
        s = self.shape
        self.engine = kernels().PackedModel(
            s.hidden,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.ffn,
            s.eps,
            stored,
            [KERNEL_TYPES[m.ggml_type] for m in matrices],
            [m.shape[0] for m in matrices],
            [n.float().contiguous() for n in norms],
            cos,
            sin,
            self.pool,
        )

    def head_rows(self, ids: torch.Tensor | None) -> PackedLinear:
        """The LM head's rows for ``ids`` (all of them for None) as a layer of their own, in the GGUF's blocks: a
        drafter's logits over its draft vocabulary read its 8-bit rows, a quarter of the float32 copy's bytes."""
        head = self.lm_head
        if ids is None:
            return PackedLinear(lambda x: self.engine.matmul(1, x), *head.shape)
        data = head.data.reshape(head.shape[0], -1)[ids.cpu()].contiguous()
        return PackedLinear.of_blocks(BlockTensor(data, head.ggml_type, (len(ids), head.shape[1])), self.pool)

    def new_cache(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's keys and values in fp16, room for ``capacity`` positions (rounded up to a multiple of 16):
        values [layers, kv_heads, positions, head_dim], keys [layers, kv_heads, positions / 16, head_dim, 16], 16
        positions side by side so attention scores 16 at once."""
        s = self.shape
        chunks = -(-capacity // KEY_CHUNK)
        keys = torch.zeros(s.layers, s.kv_heads, chunks, s.head_dim, KEY_CHUNK, dtype=CACHE_DTYPE)
        return keys, torch.zeros(s.layers, s.kv_heads, chunks * KEY_CHUNK, s.head_dim, dtype=CACHE_DTYPE)

    def grown_cache(
        self, cache: tuple[torch.Tensor, torch.Tensor], length: int, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A cache with room for ``capacity`` positions holding ``cache``'s first ``length``."""
        grown = self.new_cache(capacity)
        self.copy_positions(cache, grown, length)
        return grown

    @staticmethod
    def copy_positions(
        source: tuple[torch.Tensor, torch.Tensor], target: tuple[torch.Tensor, torch.Tensor], length: int
    ) -> None:
        """``source``'s first ``length`` positions into ``target``'s (with the rest of a partly filled key chunk,
        which the target's own next positions write over)."""
        chunks = -(-length // KEY_CHUNK)
        target[0][:, :, :chunks] = source[0][:, :, :chunks]
        target[1][:, :, :length] = source[1][:, :, :length]

    @staticmethod
    def move_positions(cache: tuple[torch.Tensor, torch.Tensor], slots: list[int], positions: list[int]) -> None:
        """The keys and values at ``slots`` to ``positions`` (a verified tree's kept branch into place)."""
        source, target = torch.tensor(slots), torch.tensor(positions)
        keys, values = cache
        keys[:, :, target // KEY_CHUNK, :, target % KEY_CHUNK] = keys[:, :, source // KEY_CHUNK, :, source % KEY_CHUNK]
        values[:, :, target] = values[:, :, source]

    @staticmethod
    def capacity(cache: tuple[torch.Tensor, torch.Tensor]) -> int:
        return cache[1].shape[2]

    def forward(
        self,
        tokens: torch.Tensor,
        seq: torch.Tensor,
        positions: torch.Tensor,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        states: bool = False,
        logit_rows: torch.Tensor | None = None,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Normed last hidden state [T, hidden], logits [T, vocab] (only of the tokens ``logit_rows`` names, when
        given) and (``states``) every layer's input plus the normed output [layers + 1, T, hidden]; token t is
        sequence ``seq[t]``'s, at ``positions[t]``. A token tree (``tree``: each token's cache slot, and its
        parent's index among the tokens, -1 for its sequence's cache) lets a token see only its ancestors; a token
        off the tree's first branch is written at a slot past its position (kernels.cpp's ``TreeView``)."""
        slots, parents = tree if tree is not None else (None, None)
        hidden, logits, layers = self.engine.forward(
            tokens, seq, positions, [k for k, _ in caches], [v for _, v in caches], states, logit_rows, slots, parents
        )
        return hidden, logits, layers if states else None


def rope_tables(shape: PackedShape) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim / 2], computed as transformers computes Llama's default RoPE."""
    exponents = torch.arange(0, shape.head_dim, 2, dtype=torch.int64).float() / shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta**exponents)
    freqs = torch.arange(shape.max_positions).float()[:, None] * inv_freq[None, :]
    return freqs.cos().contiguous(), freqs.sin().contiguous()


def _tensor(tensors: dict[str, BlockTensor], name: str) -> BlockTensor:
    if name not in tensors:
        raise ModelLoadError(f"the packed weights have no {name}", param="model")
    return tensors[name]


def _rows(parts: list[BlockTensor]) -> BlockTensor:
    """Matrices of one input width stacked by rows (query, key and value; gate and up): one product instead of
    several. Parts in different formats cannot share a row layout."""
    kinds = {p.ggml_type for p in parts}
    if len(kinds) != 1:
        raise ModelLoadError("the packed engine needs q, k, v (and gate, up) in one block format", param="model")
    rows = sum(p.shape[0] for p in parts)
    return BlockTensor(torch.cat([p.data for p in parts]), parts[0].ggml_type, (rows, parts[0].shape[1]))


def _kernel_layout(matrix: BlockTensor) -> torch.Tensor:
    """A matrix the kernels multiply by: quantised ones in tiles, float32 ones as their rows."""
    return _bytes(matrix) if matrix.ggml_type == GGMLQuantizationType.F32 else tiled(matrix)


def _bytes(matrix: BlockTensor) -> torch.Tensor:
    """A matrix as GGUF stores it: uint8 [rows, row bytes] (float32 rows as their raw bytes)."""
    data = matrix.data.contiguous()
    return data.view(torch.uint8).reshape(matrix.shape[0], -1) if data.dtype != torch.uint8 else data
