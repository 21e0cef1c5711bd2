"""The target's features over the distilled sequences, computed once and kept for every epoch of training.

Both drafters learn from what the frozen target computes over its own answers: the published drafter attends to
several of its layers' hidden states at every earlier position, and both are scored against the target's
next-token distribution at every answer position. A target forward costs far more than a drafter's training
step, so it runs once per sequence here, through the engine that serves the target (the packed engine on a
GGUF's blocks, whose numbers are the served ones whatever shares a forward; else transformers), and the results
are kept: the selected layers' hidden states, the last hidden state (after the final norm), from which the LM
head gives the target's logits over any draft vocabulary, and the log of each position's softmax normaliser,
which turns those logits into probabilities without the other rows of the LM head.

A corpus of millions of tokens holds tens of gigabytes of hidden states, more than memory, so a saved cache
keeps them in NumPy files read through memory maps (bfloat16 bits as int16, NumPy having no bfloat16; copy on
write, so nothing a process does reaches the files): training reads a batch's rows from disk, and the page cache
keeps what it reads often. Building them takes hours on a CPU, so it resumes: each group of sequences is written
into the maps as it comes and counted in a progress file, and a build interrupted continues after the last group
counted (the groups are the same for the same records).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from backends.dspark.drafter import target_features
from backends.loading import LoadedModel
from backends.progress import JobProgress
from backends.training.distill import Distilled

FEATURES_FILE = "features.safetensors"
"""Tokens, offsets and prompt lengths; written last, so its presence means the cache is whole."""
META_FILE = "features.json"
PROGRESS_FILE = "features_progress.json"
"""What a build into a folder is making and how many of its groups are written: what resuming reads."""
MAPPED = ("features", "final", "lse")
"""The tensors as long as the corpus, each in ``<name>.npy`` beside :data:`FEATURES_FILE`, read through a memory
map."""
FORWARD_TOKENS = 4096
"""Positions per group of sequences while caching (padding counted, where there is padding): large enough for the
matrix units, small enough for RAM."""
PACKED_WINDOW = 128
"""Tokens per packed-engine forward: its logits and hidden states stay under glibc's 32 MB threshold for mapping
fresh pages, so every window reuses the last one's memory instead of the kernel zeroing new pages (a fifth of the
time at 4,096 tokens a forward)."""


@dataclass
class FeatureCache:
    """Every distilled sequence, concatenated: sequence i is rows ``offsets[i]:offsets[i + 1]``."""

    tokens: torch.Tensor
    """[N] token ids."""
    offsets: torch.Tensor
    """[S + 1]."""
    prompt_lens: torch.Tensor
    """[S]: the answer of sequence i starts at row offsets[i] + prompt_lens[i]."""
    features: torch.Tensor
    """[N, len(layer_ids) * hidden]: the published drafter's injected context."""
    final: torch.Tensor
    """[N, hidden]: the target's last hidden state, whose LM-head row r is the logit of token r next."""
    lse: torch.Tensor
    """[N] float32: logsumexp of the target's logits at each position."""
    layer_ids: list[int]
    keys: list[str] | None = None
    """[S]: each sequence's :attr:`Distilled.key` (None in a cache written before they were kept)."""
    mapped_from: Path | None = None
    """The folder whose NumPy files the :data:`MAPPED` tensors are memory maps of, if any."""

    @property
    def sequences(self) -> int:
        return len(self.prompt_lens)

    def span(self, index: int) -> slice:
        return slice(int(self.offsets[index]), int(self.offsets[index + 1]))

    def save(self, folder: Path) -> None:
        """The cache in ``folder``: the mapped tensors written unless they are its memory maps already (a cache
        built into ``folder``), then the rest."""
        folder.mkdir(parents=True, exist_ok=True)
        if self.mapped_from is None or self.mapped_from.resolve() != folder.resolve():
            for name in MAPPED:
                tensor = getattr(self, name).cpu()
                np.save(folder / f"{name}.npy", tensor.view(_STORED[tensor.dtype]).numpy())
        dtypes = {name: _name(getattr(self, name).dtype) for name in MAPPED}
        meta = {"layer_ids": self.layer_ids, "dtypes": dtypes, "keys": self.keys}
        (folder / META_FILE).write_text(json.dumps(meta) + "\n")
        small = {"tokens": self.tokens, "offsets": self.offsets, "prompt_lens": self.prompt_lens}
        save_file({k: v.contiguous().cpu() for k, v in small.items()}, folder / FEATURES_FILE)

    @classmethod
    def load(cls, folder: Path) -> FeatureCache:
        tensors = load_file(folder / FEATURES_FILE)
        meta = json.loads((folder / META_FILE).read_text())
        for name in MAPPED:
            mapped = np.load(folder / f"{name}.npy", mmap_mode="c")
            tensors[name] = torch.from_numpy(mapped).view(getattr(torch, meta["dtypes"][name]))
        return cls(**tensors, layer_ids=meta["layer_ids"], keys=meta.get("keys"), mapped_from=folder)

    @classmethod
    def exists(cls, folder: Path, layer_ids: list[int]) -> bool:
        if not (folder / FEATURES_FILE).is_file():
            return False
        return json.loads((folder / META_FILE).read_text())["layer_ids"] == layer_ids

    def to(self, device: torch.device | str) -> FeatureCache:
        """The cache on ``device`` (training reads it where the drafter trains)."""
        names = ("tokens", "offsets", "prompt_lens", "features", "final", "lse")
        moved = {name: getattr(self, name).to(device) for name in names}
        stays = moved["features"].data_ptr() == self.features.data_ptr()
        mapped_from = self.mapped_from if stays else None
        return FeatureCache(**moved, layer_ids=self.layer_ids, keys=self.keys, mapped_from=mapped_from)


@torch.inference_mode()
def build_feature_cache(
    loaded: LoadedModel,
    records: list[Distilled],
    layer_ids: list[int],
    dtype: torch.dtype | None = None,
    folder: Path | None = None,
) -> FeatureCache:
    """One target forward per group of similar-length sequences, hidden states in ``dtype`` (else what the target
    computes in; bfloat16 halves a large corpus's cache, and training computes in bfloat16 anyway). Kept where
    the model runs, or (``folder``) written into memory-mapped files there as they come, for :meth:`save`."""
    hidden = loaded.model.config.get_text_config().hidden_size
    lengths = torch.tensor([len(r.tokens) for r in records])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    total = int(offsets[-1])
    store = loaded.device if folder is None else torch.device("cpu")
    dtype = dtype or (torch.float32 if loaded.packed is not None else loaded.model.dtype)
    plan = {"layer_ids": list(layer_ids), "dtype": _name(dtype), "sequences": len(records), "tokens": total}
    done = _groups_done(folder, plan)
    shapes = {"features": ((total, len(layer_ids) * hidden), dtype), "final": ((total, hidden), dtype)}
    shapes["lse"] = ((total,), torch.float32)
    mapped = {name: _allocate(folder, name, shape, kind, store, done > 0) for name, (shape, kind) in shapes.items()}
    forward = _packed_forward if loaded.packed is not None else _transformers_forward
    groups = _groups(records)
    with JobProgress(log_every=200) as progress:
        finished = sum(len(group) for group in groups[:done])
        task = progress.add_job("target features", total=len(records), completed=finished)
        for number, group in enumerate(groups[done:], start=done):
            for index, (layers, last, normaliser) in zip(
                group, forward(loaded, [records[i].tokens for i in group], layer_ids)
            ):
                rows = slice(int(offsets[index]), int(offsets[index + 1]))
                mapped["features"][rows] = layers.to(dtype)
                mapped["final"][rows] = last.to(dtype)
                mapped["lse"][rows] = normaliser.to(store)
            if folder is not None:
                (folder / PROGRESS_FILE).write_text(json.dumps({**plan, "groups_done": number + 1}) + "\n")
            progress.step(task, len(group))
    tokens = torch.tensor([t for r in records for t in r.tokens], device=store)
    prompt_lens = torch.tensor([len(r.prompt) for r in records], device=store)
    keys = [r.key for r in records]
    return FeatureCache(
        tokens, offsets.to(store), prompt_lens, **mapped, layer_ids=list(layer_ids), keys=keys, mapped_from=folder
    )


def sample_within(
    records: list[Distilled], max_tokens: int, seed: int, seen: frozenset[str] = frozenset()
) -> list[Distilled]:
    """A seeded sample of ``records`` holding at most ``max_tokens`` tokens in all, in corpus order, where the whole
    corpus's features would not fit the disk or the time there is: each source keeps its share of the corpus's
    tokens. Within a source, records whose key is in ``seen`` (what a drafter trained further already saw) are
    taken only once its unseen ones run out: a continued run learns from new text where a source has some and
    replays its lineage's where it has none. Sampling unseen text alone took nearly all of it from the one source
    that still had some, and a drafter continued on that forgot the others as served (its model card)."""
    rng = random.Random(seed)
    by_source: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        by_source.setdefault(record.source, []).append(index)
    corpus_tokens = sum(len(r.tokens) for r in records)
    chosen = []
    for source in sorted(by_source):
        members = by_source[source]
        rng.shuffle(members)
        budget = max_tokens * sum(len(records[i].tokens) for i in members) // max(1, corpus_tokens)
        total = 0
        for index in sorted(members, key=lambda i: records[i].key in seen):
            if total + len(records[index].tokens) <= budget:
                chosen.append(index)
                total += len(records[index].tokens)
    return [records[i] for i in sorted(chosen)]


def _groups_done(folder: Path | None, plan: dict) -> int:
    """How many groups an interrupted build of the same plan into ``folder`` wrote (0 for a fresh one)."""
    if folder is None or not (folder / PROGRESS_FILE).is_file():
        return 0
    progress = json.loads((folder / PROGRESS_FILE).read_text())
    done = progress.pop("groups_done", 0)
    return done if progress == plan else 0


Features = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""One sequence's selected layers [n, layers * hidden], last hidden state [n, hidden] and normalisers [n]."""


def _groups(records: list[Distilled]) -> list[list[int]]:
    """Sequences in order of length, as many to a forward as fit in :data:`FORWARD_TOKENS` padded to the
    longest."""
    order = sorted(range(len(records)), key=lambda i: len(records[i].tokens))
    groups: list[list[int]] = []
    for index in order:
        if groups and (len(groups[-1]) + 1) * len(records[index].tokens) <= FORWARD_TOKENS:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def _packed_forward(loaded: LoadedModel, sequences: list[list[int]], layer_ids: list[int]) -> list[Features]:
    """The packed engine over the sequences side by side, each at its own positions in a cache of its own (no
    padding), :data:`PACKED_WINDOW` tokens a forward; each token's numbers are the ones serving computes, whatever
    shares its forward."""
    packed = loaded.packed
    tokens = torch.tensor([t for ids in sequences for t in ids])
    seq = torch.cat([torch.full((len(ids),), i) for i, ids in enumerate(sequences)])
    positions = torch.cat([torch.arange(len(ids)) for ids in sequences])
    caches = [packed.new_cache(len(ids)) for ids in sequences]
    pieces = []
    for start in range(0, len(tokens), PACKED_WINDOW):
        window = slice(start, start + PACKED_WINDOW)
        last, logits, states = packed.forward(tokens[window], seq[window], positions[window], caches, states=True)
        pieces.append((target_features(states, layer_ids), last, logits.logsumexp(-1)))
    layers, last, normalisers = (torch.cat(parts) for parts in zip(*pieces))
    bounds = torch.tensor([0, *[len(ids) for ids in sequences]]).cumsum(0).tolist()
    return [(layers[a:b], last[a:b], normalisers[a:b]) for a, b in pairwise(bounds)]


def _transformers_forward(loaded: LoadedModel, sequences: list[list[int]], layer_ids: list[int]) -> list[Features]:
    """transformers over the sequences right-padded to the longest (causal attention keeps padding out of every
    real position)."""
    ids = torch.full((len(sequences), max(map(len, sequences))), loaded.tokenizer.pad_token_id or 0)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
    out = loaded.model.base_model(input_ids=ids.to(loaded.device), output_hidden_states=True)
    layers = target_features(out.hidden_states, layer_ids)
    lm_head = loaded.model.get_output_embeddings()
    found = []
    for row, sequence in enumerate(sequences):
        last = out.last_hidden_state[row, : len(sequence)]
        found.append((layers[row, : len(sequence)], last, torch.logsumexp(lm_head(last).float(), dim=-1)))
    return found


_STORED = {torch.float32: torch.float32, torch.float16: torch.float16, torch.bfloat16: torch.int16}
"""How each dtype is stored in NumPy, which has no bfloat16: as its bits."""


def _allocate(
    folder: Path | None, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, resume: bool
) -> torch.Tensor:
    """An uninitialised tensor: in memory, or a memory map of ``folder/<name>.npy`` (``resume``: the one there)."""
    if folder is None:
        return torch.empty(shape, dtype=dtype, device=device)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.npy"
    if resume:
        return torch.from_numpy(np.load(path, mmap_mode="r+")).view(dtype)
    numpy_dtype = torch.empty(0, dtype=_STORED[dtype]).numpy().dtype
    return torch.from_numpy(np.lib.format.open_memmap(path, mode="w+", dtype=numpy_dtype, shape=shape)).view(dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
