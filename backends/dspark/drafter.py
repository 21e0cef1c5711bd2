"""The published DSpark drafter: a parallel backbone fed with the target's own features, plus its two small heads.

One drafter pass turns a block of gamma inputs (the anchor, the newest committed token, then gamma-1 mask tokens)
into hidden states h_1..h_gamma; the anchor's position predicts the first draft token. The block attends to
itself bidirectionally and, in every layer, to *injected context*: hidden states of several target layers at every
committed position, concatenated, mapped by one shared linear layer (``fc``) to the drafter's width and RMS-normed
(``hidden_norm``), then turned into keys and values by each layer's own projections. Those keys and values depend
only on committed tokens, so :class:`ContextCache` keeps them: a decoding round appends the features of the tokens
it committed and runs the backbone over the block alone.

The embedding and LM head are the target's own modules, shared and frozen (never parameters of this module); the
Markov head adds a low-rank transition bias B(x_{k-1}) = W1[x_{k-1}] W2 to each base logit row, and the
confidence head predicts c_k = sigmoid(w . [h_k ; W1[x_{k-1}]]), the chance that draft token k survives
verification given that the tokens before it did. Module and weight names are DeepSpec's (``Qwen3DSparkModel``),
so checkpoints move between the two unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from backends.dspark.drafter_config import WEIGHTS_FILE, DrafterConfig
from backends.dspark.vocab import DraftVocab
from backends.errors import ModelLoadError
from backends.packed.build import kernels
from backends.packed.linear import PackedLinear, q8_blocks
from backends.packed.model import PackedLlama
from backends.packed.weights import tiled

SHARED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
DRAFT_VOCAB = "draft_vocab"


class RMSNorm(nn.Module):
    """Normalised in float32 whatever the weights' dtype, as Qwen3's norm is, so bfloat16 keeps its scale; one
    fused op (``F.rms_norm``) rather than six, since a drafter round runs a dozen norms on a handful of tokens."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos and sin [..., len, head_dim] for absolute ``positions``: context and block share one position axis."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        heads, kv_heads, dim, width = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.hidden_size,
        )
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim
        self.q_proj = nn.Linear(width, heads * dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(width, kv_heads * dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(width, kv_heads * dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * dim, width, bias=config.attention_bias)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(dim, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Keys and values [B, kv_heads, len, head_dim] of ``x`` (block inputs or projected target context)."""
        batch, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, *rope), v

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        context: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, *rope)
        k, v = self.keys_values(x, rope)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DrafterMLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, context, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """B(x_{k-1}) = W1[x_{k-1}] W2: a rank-r transition table from any target token to the draft vocabulary, cheap
    enough to apply once per draft token."""

    def __init__(self, vocab_size: int, rank: int, draft_size: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_size, bias=False)

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev_ids))

    def step(self, base_row: torch.Tensor, previous: int) -> torch.Tensor:
        """U_k + B(x_{k-1}) for one block position: the sequential stage runs this gamma times a round."""
        return base_row + self.markov_w2(self.markov_w1.weight[previous])

    def greedy(self, base: torch.Tensor, anchor: int, vocab: DraftVocab) -> list[int]:
        """The sequential stage of a greedy round: each position's argmax of U_k + B(previous token) over ``base``
        [positions, draft size], left to right from ``anchor``, as target ids. Where W2 is served from blocks it
        runs as one compiled call (``PackedMatrix.greedy_chain``): in torch a step is some five operations of
        dispatch, and the stage was a third of the drafter's pass once its backbone was compiled."""
        matrix = getattr(self.markov_w2, "matrix", None)
        if matrix is not None:
            ids = vocab.ids if vocab.ids is not None else torch.empty(0, dtype=torch.long)
            table = self.markov_w1.weight.detach().float().contiguous()
            return matrix.greedy_chain(base.float().contiguous(), table, ids.cpu(), anchor)
        tokens, token = [], anchor
        for row in base:
            token = int(vocab.target_ids(torch.argmax(self.step(row, token).float())))
            tokens.append(token)
        return tokens


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class ContextCache:
    """The keys and values of the injected target context at every committed position, for every drafter layer:
    one buffer each, [layers, kv_heads, capacity, head_dim], grown by doubling, so a round writes what it committed
    in place and the block attends to a view (concatenating the context to the block in every layer of every round
    cost a copy of it each time). The packed backbone writes into the same buffers.

    Only committed tokens enter it, so it never needs cropping: a round appends what it committed and runs the
    backbone over the block without storing the block's own keys and values."""

    FIRST_CAPACITY = 256

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.zeros(num_layers, kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.values = self.keys.clone()
        self.length = 0

    def reserve(self, positions: int) -> None:
        """Room for ``positions`` committed positions in all."""
        capacity = self.keys.shape[2]
        if positions <= capacity:
            return
        layers, kv_heads, _, dim = self.keys.shape
        size = max(positions, 2 * capacity, self.FIRST_CAPACITY)
        keys = self.keys.new_zeros(layers, kv_heads, size, dim)
        values = keys.clone()
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s committed keys and values [1, kv_heads, length, head_dim]."""
        return self.keys[index, None, :, : self.length], self.values[index, None, :, : self.length]

    def write(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer ``index``'s keys and values [1, kv_heads, T, head_dim] of the next T positions (``length`` moves
        once every layer is written)."""
        end = self.length + keys.shape[2]
        self.keys[index, :, self.length : end] = keys[0]
        self.values[index, :, self.length : end] = values[0]


def state_layers(layer_ids: list[int]) -> tuple[int, ...]:
    """Where the target layers a drafter reads sit in a forward's ``hidden_states`` (embedding output first):
    layer i is entry i+1 and -1 the embedding output."""
    return tuple(i + 1 for i in layer_ids)


def target_features(hidden_states: Sequence[torch.Tensor], layer_ids: list[int]) -> torch.Tensor:
    """The drafter's context from a target forward's ``hidden_states``: its layers', concatenated along the
    width."""
    return torch.cat([hidden_states[i] for i in state_layers(layer_ids)], dim=-1)


class DSparkDrafter(nn.Module):
    def __init__(self, config: DrafterConfig, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(config.context_width, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        draft_size = config.draft_vocab_size or config.vocab_size
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank, draft_size)
        if config.draft_vocab_size:
            self.register_buffer(DRAFT_VOCAB, torch.arange(draft_size))
        self.confidence_head = (
            ConfidenceHead(config.hidden_size + config.markov_rank) if config.enable_confidence_head else None
        )
        # A tuple keeps the target's modules out of this module's parameters and state dict: they stay frozen
        # and are saved beside the drafter's own weights only because the published layout carries them.
        self.shared = (embed_tokens, lm_head)
        self.vocab = DraftVocab(lm_head, None)
        self.packed: Any = None
        """The compiled backbone once serving from packed blocks (:meth:`serve_from`), else None: torch layers."""

    def serve_from(self, packed: PackedLlama) -> None:
        """Serve from 8-bit blocks on the packed engine: the draft vocabulary's LM-head rows as the GGUF has them,
        and the Markov head's table, the context projection and the layers rounded to Q8_0; the backbone, context
        projection included, runs as one compiled call (``drafter_block.h``), which took the Zen 4's backbone pass
        from 0.89 ms in torch to 0.29 ms. A round then reads a quarter of the bytes; serving only, since training
        needs the float32 weights and their gradients."""
        self.vocab.serve_from(packed)
        self.markov_head.markov_w2 = PackedLinear.quantized(self.markov_head.markov_w2, packed.pool)
        if not self.config.attention_bias:
            self.packed = self._packed_backbone(packed.shape.max_positions + self.block_size, packed.pool)

    def _packed_backbone(self, positions: int, pool: Any) -> Any:
        """The compiled backbone (``kernels.cpp``'s ``PackedDrafter``) on this drafter's weights in Q8_0 tiles,
        with RoPE tables for ``positions``, run on the target's ``pool``."""
        config = self.config
        matrices = [self.fc.weight]
        norms = [self.hidden_norm.weight, self.norm.weight]
        for layer in self.layers:
            attention, mlp = layer.self_attn, layer.mlp
            matrices += [
                attention.q_proj.weight,
                torch.cat([attention.k_proj.weight, attention.v_proj.weight]),
                attention.o_proj.weight,
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                mlp.down_proj.weight,
            ]
            norms += [
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                attention.q_norm.weight,
                attention.k_norm.weight,
            ]
        cos, sin = rotary(torch.arange(positions), config.head_dim, config.rope_theta, torch.float32)
        half = config.head_dim // 2
        return kernels().PackedDrafter(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.intermediate_size,
            config.context_width,
            config.rms_norm_eps,
            [tiled(q8_blocks(weight)) for weight in matrices],
            [norm.detach().float().contiguous() for norm in norms],
            cos[:, :half].contiguous(),
            sin[:, :half].contiguous(),
            pool,
        )

    def bind_vocab(self) -> DSparkDrafter:
        """Take the draft vocabulary's LM-head rows from the target, where both now live (after ``to``, a load,
        or setting ``draft_vocab``)."""
        self.vocab = DraftVocab(self.shared[1], getattr(self, DRAFT_VOCAB, None))
        return self

    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        mask_token_id: int,
        *,
        seed: int = 0,
        draft_vocab: torch.Tensor | None = None,
        **shape: Any,
    ) -> DSparkDrafter:
        """A fresh drafter on ``target``'s embedding and LM head (``shape``: DrafterConfig.for_target's options),
        proposing only ``draft_vocab`` (target ids, most useful first) when given.

        Linear weights start small (std 0.02, as DeepSpec's init) and the Markov projection and confidence head
        at zero: an untrained drafter drafts from its backbone alone and is unsure of every token (c = 0.5)."""
        config = DrafterConfig.for_target(target.config, mask_token_id=mask_token_id, **shape)
        if draft_vocab is not None:
            config.draft_vocab_size = len(draft_vocab)
        torch.manual_seed(seed)
        drafter = cls(config, target.get_input_embeddings(), target.get_output_embeddings())
        with torch.no_grad():
            for module in drafter.modules():
                if isinstance(module, nn.Linear | nn.Embedding):
                    module.weight.normal_(0.0, 0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
            drafter.markov_head.markov_w2.weight.zero_()
            if drafter.confidence_head is not None:
                drafter.confidence_head.proj.weight.zero_()
            if draft_vocab is not None:
                getattr(drafter, DRAFT_VOCAB).copy_(draft_vocab)
        param = next(target.parameters())
        return drafter.to(device=param.device, dtype=param.dtype).bind_vocab()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, self.config.head_dim, self.config.rope_theta, self.norm.weight.dtype)

    def context_keys_values(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Each layer's keys and values for target ``features`` [B, T, context_width] at ``positions`` [B, T]."""
        context = self.hidden_norm(self.fc(features.to(self.norm.weight.dtype)))
        rope = self._rope(positions)
        return [layer.self_attn.keys_values(context, rope) for layer in self.layers]

    def new_context(self) -> ContextCache:
        """An empty context cache for one sequence."""
        config, weight = self.config, self.norm.weight
        dtype = torch.float32 if self.packed is not None else weight.dtype
        return ContextCache(len(self.layers), config.num_key_value_heads, config.head_dim, dtype, weight.device)

    def extend_context(self, cache: ContextCache, features: torch.Tensor) -> None:
        """Append the features [T, context_width] of the next T committed positions to ``cache``."""
        cache.reserve(cache.length + features.shape[0])
        if self.packed is not None:
            self.packed.extend(features.float().contiguous(), cache.keys, cache.values, cache.length)
        else:
            positions = torch.arange(cache.length, cache.length + features.shape[0], device=features.device)
            for index, (keys, values) in enumerate(self.context_keys_values(features[None], positions[None])):
                cache.write(index, keys, values)
        cache.length += features.shape[0]

    def backbone(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, L, H] of block inputs ``block_ids`` [B, L] at ``positions`` [B, L] attending to
        ``context`` (per layer) and to the block; ``mask`` [B, 1, L, T + L] (True: may attend) only in training,
        where many blocks of one sequence share a pass."""
        x = self.shared[0](block_ids).to(self.norm.weight.dtype)
        rope = self._rope(positions)
        for layer, layer_context in zip(self.layers, context):
            x = layer(x, rope, layer_context, mask)
        return self.norm(x)

    def draft_hidden(self, cache: ContextCache, anchor: int) -> torch.Tensor:
        """One decoding round's backbone pass: the block after ``anchor``, which sits at position cache.length."""
        device = self.norm.weight.device
        ids = torch.full((1, self.block_size), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = anchor
        if self.packed is not None:
            inputs = self.shared[0](ids[0]).float().contiguous()
            return self.packed.block(inputs, cache.keys, cache.values, cache.length)
        positions = torch.arange(cache.length, cache.length + self.block_size, device=device)[None]
        context = [cache.layer(i) for i in range(len(self.layers))]
        return self.backbone(ids, positions, context)[0]

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """U_k over the draft vocabulary."""
        return self.vocab.logits(hidden)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Calibrated logits of c_k (raw ones divided by the Sequential Temperature Scaling temperatures)."""
        features = torch.cat([hidden, self.markov_head.markov_w1(prev_ids).to(hidden.dtype)], dim=-1)
        logits = self.confidence_head(features).float()
        if self.config.confidence_temperatures is not None:
            temperatures = torch.tensor(self.config.confidence_temperatures, device=logits.device)
            logits = logits / temperatures[: logits.shape[-1]]
        return logits

    def save(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Config and the drafter's own weights (in ``dtype``, else as they are): the shared embedding and LM head
        are the target's and are taken from it at load, so a shipped drafter does not carry a second copy."""
        path = Path(path)
        self.config.save(path)
        weights = {k: _stored(v, dtype) for k, v in self.state_dict().items()}
        save_file(weights, path / WEIGHTS_FILE, metadata={"format": "pt"})

    def export(self, path: str | Path) -> None:
        """The full published layout that DeepSpec, vLLM and SGLang load: the shared embedding and LM head
        included, and a draft vocabulary widened to the whole one (the Markov projection is zero on the rows
        this drafter never proposes; those readers draft over every token)."""
        path = Path(path)
        config = DrafterConfig.from_json(self.config.to_json())
        config.draft_vocab_size = None
        config.save(path)
        weights = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items() if k != DRAFT_VOCAB}
        if self.vocab.ids is not None:
            w2 = weights["markov_head.markov_w2.weight"]
            full = w2.new_zeros((self.config.vocab_size, w2.shape[1]))
            weights["markov_head.markov_w2.weight"] = full.index_copy_(0, self.vocab.ids.cpu(), w2)
        # Copies: a target with tied embeddings shares one tensor, which safetensors refuses to write twice.
        weights.update(zip(SHARED_WEIGHTS, (m.weight.detach().cpu().clone() for m in self.shared)))
        save_file(weights, path / WEIGHTS_FILE, metadata={"format": "pt"})

    @classmethod
    def load(cls, path: str | Path, embed_tokens: nn.Module, lm_head: nn.Module) -> DSparkDrafter:
        """A drafter folder beside its target: the target's embedding and LM head are used, the copies in the file
        only checked for shape (a drafter trained for another target is refused)."""
        path = Path(path)
        config = DrafterConfig.load(path)
        if not (path / WEIGHTS_FILE).is_file():
            raise ModelLoadError(f"drafter {str(path)!r} has config.json but no {WEIGHTS_FILE}", param="drafter")
        if (config.vocab_size, config.hidden_size) != tuple(embed_tokens.weight.shape):
            raise ModelLoadError(
                f"drafter {str(path)!r} is {config.vocab_size} x {config.hidden_size}, its target "
                f"{tuple(embed_tokens.weight.shape)}: it was trained for another target",
                param="drafter",
            )
        weights = load_file(path / WEIGHTS_FILE)
        for name, module in zip(SHARED_WEIGHTS, (embed_tokens, lm_head)):
            if name in weights and weights.pop(name).shape != module.weight.shape:
                raise ModelLoadError(f"drafter {str(path)!r} was trained for another target ({name})", param="drafter")
        param = next(embed_tokens.parameters())
        drafter = cls(config, embed_tokens, lm_head)
        try:
            drafter.load_state_dict(weights)
        except RuntimeError as exc:
            raise ModelLoadError(f"drafter weights in {str(path)!r} do not fit its config: {exc}") from exc
        return drafter.to(device=param.device, dtype=param.dtype).bind_vocab().eval()


def _stored(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    tensor = tensor.detach().contiguous().cpu()
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
