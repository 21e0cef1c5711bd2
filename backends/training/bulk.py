"""Answering a corpus in bulk where a GPU holds the target: transformers' ``generate`` over hundreds of prompts at
once.

The serving engine decodes each request in a Python loop of its own, which suits a CPU serving a few requests at
a time; a GPU answering tens of thousands of prompts would spend its time in those loops. Here a batch is one
``generate`` call over up to ``rows`` prompts of similar length and the same sampling settings (left-padded, one
KV cache for the batch), so each forward serves hundreds of rows. The answers are the float32 reference's: the
weights the packed engine serves, in another order of arithmetic, so a near-tie may break the other way.

Prompts under a grammar (a response format or tools) go through the serving engine instead, which constrains
them as the pool does. Sampled prompts of one batch share one generator seeded from the batch's first request:
the corpus is reproducible for a seed and a row count, not per request as the engine's private generators are.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import groupby

import torch

from backends.autoregressive import AutoregressiveBackend
from backends.corpus.recipe import TrainingPrompt
from backends.errors import InvalidRequestError
from backends.loading import prompt_ids
from backends.training.distill import Answers, Distilled, engine_answers


def bulk_answers(
    backend: AutoregressiveBackend, rows: int = 512, engine_batch: int = 64, grammar: bool = True
) -> Answers:
    """Unconstrained prompts in ``generate`` batches of ``rows``; constrained ones through the engine, or, with
    ``grammar`` off, through ``generate`` too (free answers to prompts that carry the format's notes)."""
    engine = engine_answers(backend, engine_batch)

    def answers(prompts: list[TrainingPrompt], todo: list[int]) -> Iterator[Distilled | None]:
        to_engine = {i for i in todo if grammar and _constrained(prompts[i])}
        yield from engine(prompts, [i for i in todo if i in to_engine])
        encoded = []
        for i in (i for i in todo if i not in to_engine):
            try:
                encoded.append((i, prompt_ids(backend.loaded, prompts[i].request)))
            except InvalidRequestError:
                yield None
        encoded.sort(key=lambda item: (_settings(prompts[item[0]]), len(item[1])))
        for _, group in groupby(encoded, key=lambda item: _settings(prompts[item[0]])):
            group = list(group)
            for start in range(0, len(group), rows):
                yield from _generate(backend, prompts, group[start : start + rows])

    return answers


def _constrained(prompt: TrainingPrompt) -> bool:
    return prompt.request.response_format is not None or bool(prompt.request.tools)


def _settings(prompt: TrainingPrompt) -> tuple[float, float, int, tuple[str, ...]]:
    """What a generate call shares: sampling, the answer's length limit and the stop strings."""
    request = prompt.request
    sampling = (0.0, 1.0) if request.greedy else (request.temperature, request.top_p)
    return (*sampling, request.max_tokens, tuple(request.stop))


@torch.inference_mode()
def _generate(
    backend: AutoregressiveBackend, prompts: list[TrainingPrompt], batch: list[tuple[int, list[int]]]
) -> Iterator[Distilled]:
    loaded = backend.loaded
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else min(loaded.eos_ids)
    width = max(len(ids) for _, ids in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (_, tokens) in enumerate(batch):
        ids[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = 1
    first = prompts[batch[0][0]].request
    sampled = not first.greedy
    if sampled:
        torch.manual_seed(first.seed if first.seed is not None else 0)
    out = loaded.model.generate(
        input_ids=ids.to(loaded.device),
        attention_mask=mask.to(loaded.device),
        max_new_tokens=first.max_tokens,
        do_sample=sampled,
        temperature=first.temperature if sampled else None,
        top_p=first.top_p if sampled else None,
        top_k=0 if sampled else None,
        eos_token_id=sorted(loaded.eos_ids),
        pad_token_id=pad,
    )
    stops = loaded.eos_ids | _special_stops(loaded.tokenizer, first.stop)
    for row, (index, tokens) in enumerate(batch):
        completion = out[row, width:].tolist()
        end = next((k for k, token in enumerate(completion) if token in stops), len(completion))
        yield Distilled(index, prompts[index].source, tokens, completion[:end])


def _special_stops(tokenizer, stop: list[str]) -> frozenset[int]:
    """The stop strings that are special tokens, as ids (the corpus stops only at chat-template markers)."""
    return frozenset(tokenizer.convert_tokens_to_ids(s) for s in stop if s in tokenizer.all_special_tokens)
