"""The KV cache of every request in the running batch, and the ragged forward pass over it.

All rows share one ``DynamicCache`` of shape [rows, heads, slots, head_dim] per layer. A row owns a mask over
the slots (``valid``) and a length: the number of positions it has committed, which is also the RoPE position
of its next token. Keys are cached after RoPE, so where a position sits among the slots does not matter, only
whether the row may attend to it. That makes every per-request operation cheap and exact:

- a step feeds each row its own number of tokens (one for plain decoding, anchor plus draft for DSpark); the
  batch is padded to the longest, and a 4D mask lets each real query see its row's valid slots and its own
  earlier new tokens; padding queries see only themselves and their slots are never valid;
- a rejected draft (``rewind``) is masked out, not cut, since its slots sit between other rows' columns;
  ``compact`` packs each row's valid slots to the left once enough holes have built up;
- newcomers are prefilled in a forward of their own (a prompt never pads the running batch), several at once
  right-padded to the longest, which needs no mask: causal attention already keeps every real position from
  the padding after it. Each joins as a new row; a finished request leaves by dropping its row. (A prompt chunk
  riding along in the decode step would pad every running row to the chunk's width: 6 to 10 times the cost
  per prompt token, measured at 16 rows.)

A batch of one with no holes runs without a mask or position ids, exactly the solo forward of before.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import BaseModelOutputWithPast

from backends.errors import ModelLoadError
from backends.loading import LoadedModel
from backends.steps import BatchRows, ForwardOut

COMPACT_SLACK = 32
"""Free slots per row tolerated before compaction: a gather of the whole cache, so not every step."""


class SlotLayer(DynamicLayer):
    """One layer's keys and values for the batch: views ``[:rows, :, :used]`` into buffers with room for more
    rows and more slots. A step writes its new positions in place (a DynamicLayer would copy the whole cache
    with ``torch.cat`` at every step), a newcomer is copied into the next free row, and a finished request's
    row is overwritten by the last row: only one row ever moves."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rows = self.used = 0
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        self._reserve(self.rows, self.used + new, key_states)
        keys, values = self._room
        keys[: self.rows, :, self.used : self.used + new] = key_states
        values[: self.rows, :, self.used : self.used + new] = value_states
        self.used += new
        return self._view()

    def add_row(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A newcomer's [1, heads, length, dim] cache as the next row; its slots past ``length`` are zeroed (they
        are masked, but a stale NaN would still poison the softmax)."""
        length = keys.shape[-2]
        used = max(self.used, length)
        self._reserve(self.rows + 1, used, keys)
        room_keys, room_values = self._room
        room_keys[self.rows, :, :used].zero_()
        room_values[self.rows, :, :used].zero_()
        room_keys[self.rows, :, :length] = keys[0]
        room_values[self.rows, :, :length] = values[0]
        self.rows, self.used = self.rows + 1, used
        self._view()

    def move_row(self, source: int, target: int) -> None:
        for room in self._room:
            room[target, :, : self.used] = room[source, :, : self.used]

    def drop_last_row(self) -> None:
        self.rows -= 1
        self._view()

    def crop(self, tokens_to_remove: int) -> None:
        self.used += tokens_to_remove  # negative: drop that many trailing slots
        self._view()

    def gather_slots(self, order: torch.Tensor) -> None:
        """Row r keeps its slots ``order[r]``, packed to the left (compaction)."""
        for room in self._room:
            live = room[: self.rows, :, : self.used]
            index = order[:, None, :, None].expand(-1, live.shape[1], -1, live.shape[3])
            room[: self.rows, :, : order.shape[1]] = live.gather(2, index)
        self.used = order.shape[1]
        self._view()

    def _reserve(self, rows: int, slots: int, like: torch.Tensor) -> None:
        if self._room is not None and self._room[0].shape[0] >= rows and self._room[0].shape[2] >= slots:
            return
        have_rows, have_slots = (self._room[0].shape[0], self._room[0].shape[2]) if self._room else (0, 0)
        # Only the short dimension doubles: doubling both at every growth made the room 4x at each newcomer or
        # long prompt, tens of GB for 64 rows of a 30-layer model.
        rows = have_rows if have_rows >= rows else max(rows, 2 * have_rows, 1)
        slots = have_slots if have_slots >= slots else max(slots, 2 * have_slots, 64)
        shape = (rows, like.shape[1], slots, like.shape[3])
        grown = (like.new_zeros(shape), like.new_zeros(shape))
        if self._room is not None:
            for old, room in zip(self._room, grown):
                room[: self.rows, :, : self.used] = old[: self.rows, :, : self.used]
        self._room = grown
        self.device, self.dtype, self.is_initialized = like.device, like.dtype, True

    def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._room
        self.keys, self.values = keys[: self.rows, :, : self.used], values[: self.rows, :, : self.used]
        return self.keys, self.values


def batch_cache(config) -> DynamicCache:
    """A DynamicCache of :class:`SlotLayer`; the batch needs full attention in every layer (no sliding window)."""
    cache = DynamicCache(config=config)
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        raise ModelLoadError("batched decoding needs a model with full attention in every layer", param="model")
    cache.layers = [SlotLayer() for _ in cache.layers]
    return cache


class BatchedKV(BatchRows):
    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__()
        self.base = loaded.model.base_model
        self.lm_head = loaded.model.get_output_embeddings()
        self.config = loaded.model.config
        self.device = loaded.device
        self.dtype = loaded.model.dtype
        self.pad_id = loaded.tokenizer.pad_token_id or 0
        self.cache = batch_cache(self.config)
        self.valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def prefill(
        self,
        members: list[object],
        prompts: list[list[int]],
        hidden_states: bool = False,
        scopes: list[str | None] | None = None,
    ) -> list[ForwardOut]:
        """Newcomers' prompts, right-padded into one forward with a cache of their own; each then joins the batch
        as a row. One prompt alone is exactly the solo prefill. No prefix cache here (``scopes`` unused): the
        packed engine has one."""
        counts = [len(tokens) for tokens in prompts]
        ids, real = self._padded(prompts, counts)
        cache = DynamicCache(config=self.config)
        out = self.base(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=hidden_states)
        for row, (member, length) in enumerate(zip(members, counts)):
            self._join(member, cache, row, length)
        return [replace(o, logits=o.logits[-1:]) for o in self._outputs(out, real, counts, hidden_states)]

    def step(self, inputs: list[list[int]], hidden_states: bool = False) -> list[ForwardOut]:
        """One forward pass over every row, row r fed ``inputs[r]`` (at least one token each); holes left by
        rewinds are packed first when they have grown."""
        self.compact()
        counts = [len(tokens) for tokens in inputs]
        ids, real = self._padded(inputs, counts)
        width = ids.shape[1]
        if self.rows == 1 and bool(self.valid.all()):
            mask = positions = None
        else:
            positions = torch.tensor(self.lengths, device=self.device)[:, None] + torch.arange(
                width, device=self.device
            )
            mask = self._mask(real, width)
        out = self.base(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=hidden_states,
        )
        self.valid = torch.cat([self.valid, real], dim=1)
        self.lengths = [length + n for length, n in zip(self.lengths, counts)]
        return self._outputs(out, real, counts, hidden_states)

    def rewind(self, member: object, tokens: int) -> None:
        """Mask out the last ``tokens`` positions of ``member``'s row (its rejected draft)."""
        if tokens <= 0:
            return
        r = self._index(member)
        slots = self.valid[r].nonzero().flatten()[-tokens:]
        self.valid[r, slots] = False
        self.lengths[r] -= tokens
        self._trim()

    def remove(self, member: object) -> None:
        """The last row takes the leaving row's place: one row is copied, not the whole cache."""
        r, last = self._index(member), self.rows - 1
        if r != last:
            for layer in self.cache.layers:
                layer.move_row(last, r)
            self.members[r], self.lengths[r] = self.members[last], self.lengths[last]
            self.valid[r] = self.valid[last]
        del self.members[last], self.lengths[last]
        for layer in self.cache.layers:
            layer.drop_last_row()
        self.valid = self.valid[:last]
        self._trim()
        self.compact()

    def compact(self) -> None:
        """Pack each row's valid slots to the left, when the holes outgrow ``COMPACT_SLACK``."""
        longest = max(self.lengths, default=0)
        if self.slots <= longest + COMPACT_SLACK:
            return
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]
        for layer in self.cache.layers:
            layer.gather_slots(order)
        lengths = torch.tensor(self.lengths, device=self.device)
        self.valid = torch.arange(longest, device=self.device)[None, :] < lengths[:, None]

    def _padded(self, inputs: list[list[int]], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [len(inputs), longest], each row right-padded, and the mask of its real positions."""
        width = max(counts)
        ids = torch.full((len(inputs), width), self.pad_id, dtype=torch.long)
        for r, tokens in enumerate(inputs):
            ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        real = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]
        return ids.to(self.device), real.to(self.device)

    def _outputs(
        self, out: BaseModelOutputWithPast, real: torch.Tensor, counts: list[int], hidden_states: bool
    ) -> list[ForwardOut]:
        """Each row's outputs at its ``counts[r]`` real positions; the LM head runs on those alone."""
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden[real]).split(counts)
        results = []
        for r, n in enumerate(counts):
            states = tuple(h[r : r + 1, :n] for h in out.hidden_states) if hidden_states else None
            results.append(ForwardOut(hidden[r, :n], logits[r], states))
        return results

    def _mask(self, real: torch.Tensor, width: int) -> torch.Tensor:
        """[rows, 1, width, slots + width] additive mask: a real query sees its row's valid slots and the real
        new tokens up to itself; a padding query sees only itself, so no row of the softmax is empty."""
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=self.device))
        new = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device)[None]
        old = self.valid[:, None, :] & real[:, :, None]
        allowed = torch.cat([old, new], dim=-1)[:, None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    def _join(self, member: object, cache: DynamicCache, row: int, length: int) -> None:
        """Row ``row`` of a prefill's cache, its first ``length`` positions, as the batch's next row."""
        for layer, new in zip(self.cache.layers, cache.layers):
            layer.add_row(new.keys[row : row + 1, :, :length], new.values[row : row + 1, :, :length])
        width = max(self.slots, length)
        row = torch.arange(width, device=self.device)[None, :] < length
        self.valid = torch.cat([_pad_slots(self.valid, width), row])
        self.members.append(member)
        self.lengths.append(length)

    def _trim(self) -> None:
        """Drop trailing slots no row uses (a batch of one then never carries holes)."""
        used = self.valid.any(dim=0).nonzero()
        keep = int(used.max()) + 1 if used.numel() else 0
        if keep < self.slots:
            self.cache.crop(keep - self.slots)
            self.valid = self.valid[:, :keep]


def _pad_slots(valid: torch.Tensor, width: int) -> torch.Tensor:
    """A [rows, slots] mask widened to ``width`` slots, the new ones invalid."""
    missing = width - valid.shape[1]
    return valid if missing == 0 else torch.cat([valid, valid.new_zeros((valid.shape[0], missing))], dim=1)
