"""The prefix cache: a prompt that starts like a kept one copies that start and runs only the rest, with the same
logits, states and outputs as a full prefill, within its scope and its memory cap."""

from __future__ import annotations

import pytest
import torch

from backends.autoregressive import AutoregressiveBackend
from backends.default_model import DEFAULT_MODEL
from backends.dspark.backend import DSparkBackend
from backends.engine import BatchLimits
from backends.loading import prompt_ids
from backends.packed.kv import PackedKV
from backends.packed.prefix_cache import MIN_SHARED, PrefixCache
from backends.types import GenerationRequest
from benchmarks.trace_jobs import JOBS, requests

LAYERS = (0, 9, 28)


@pytest.fixture(scope="module")
def published() -> DSparkBackend:
    return DSparkBackend.from_pretrained(DEFAULT_MODEL, drafter="dspark")


def _job_prompts(loaded, name: str, count: int) -> list[list[int]]:
    job = next(j for j in JOBS if j.name == name)
    return [prompt_ids(loaded, GenerationRequest(**body)) for body in requests(job, count)]


def test_a_prompt_started_from_the_cache_has_a_full_prefills_logits_and_states(published):
    loaded = published.loaded
    first, second = _job_prompts(loaded, "extraction", 2)
    cached = PackedKV(loaded, PrefixCache(2**26, LAYERS))
    cached.prefill([object()], [first], hidden_states=True)
    out = cached.prefill([object()], [second], hidden_states=True)[0]
    full = PackedKV(loaded).prefill([object()], [second], hidden_states=True)[0]
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert out.cached == shared >= MIN_SHARED
    assert torch.equal(out.logits, full.logits)
    assert torch.equal(out.hidden, full.hidden[shared:])
    for layer in LAYERS:
        assert out.hidden_states[layer].shape == full.hidden_states[layer].shape
        assert torch.equal(out.hidden_states[layer], full.hidden_states[layer])
    with pytest.raises(KeyError, match="not kept"):
        out.hidden_states[1]


def test_greedy_outputs_with_the_prefix_cache_are_plain_decodings_and_name_their_cached_tokens(published):
    """A job's requests on both pools' loops, the cache on: every output is the one without it, token for token,
    and from the second request on the prompt's template came from the cache."""
    loaded = published.loaded
    plain = AutoregressiveBackend(loaded, BatchLimits(prefix_cache_mb=0))
    standard = AutoregressiveBackend(loaded)
    job = next(j for j in JOBS if j.name == "sql")
    for i, body in enumerate(requests(job, 3)):
        request = GenerationRequest(**{**body, "max_tokens": 32})
        expected = plain.complete(request)
        assert expected.stats.cached_prompt_tokens == 0
        for backend in (standard, published):
            result = backend.complete(request)
            assert result.token_ids == expected.token_ids
            assert (result.stats.cached_prompt_tokens >= MIN_SHARED) == (i > 0)
    assert plain.cache_bytes() == {"prefix": 0}
    assert 0 < standard.cache_bytes()["prefix"] <= BatchLimits().prefix_cache_mb * 2**20


def test_a_scope_never_starts_from_another_scopes_prompt(published):
    backend = AutoregressiveBackend(published.loaded)
    body = {"messages": [{"role": "user", "content": "Name three rivers of Europe, one a line, no more."}]}
    cached = []
    for scope in ("tenant-a", "tenant-b", "tenant-a"):
        request = GenerationRequest(**body, max_tokens=4, temperature=0, cache_scope=scope)
        cached.append(backend.complete(request).stats.cached_prompt_tokens)
    assert cached[0] == cached[1] == 0
    assert cached[2] > 0


def test_the_memory_cap_holds_and_the_least_recently_used_prompt_goes_first():
    shape = (2, 1, 4, 8)
    cache = PrefixCache(max_bytes=40_000)
    generator = torch.Generator().manual_seed(0)

    def kept(length: int, first: int) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor]]:
        prompt = [first, *torch.randint(100, (length - 1,), generator=generator).tolist()]
        keys = torch.zeros(*shape[:2], -(-length // 16), shape[3], 16, dtype=torch.float16)
        return prompt, (keys, torch.zeros(*shape[:2], length, shape[3], dtype=torch.float16))

    prompts = []
    for i in range(200):
        prompt, kv = kept(64, i)
        prompts.append(prompt)
        cache.add(None, prompt, kv, None)
        assert cache.nbytes <= cache.max_bytes
        if i == 3:  # the first prompt, read again, outlives the ones kept after it
            assert cache.longest(None, prompts[0], states=False).shared == 63
        if i == 10:
            assert cache.longest(None, prompts[1], states=False) is None
            assert cache.longest(None, prompts[0], states=False).shared == 63
    assert cache.longest(None, prompts[0], states=False) is None
    assert cache.longest(None, prompts[-1], states=False).shared == 63
    assert cache.longest(None, prompts[-1][:MIN_SHARED], states=False) is None  # the last token always runs
    assert cache.longest(None, prompts[-1], states=True) is None  # kept without states
    assert cache.longest("other", prompts[-1], states=False) is None
    assert not cache.keeps(None, prompts[-1], states=False)  # kept already
    assert cache.keeps(None, prompts[-1], states=True)  # kept without the states a drafter's prefill brings
    assert not cache.keeps(None, prompts[-1][:MIN_SHARED], states=False)  # too short to share
