"""The local autoregressive backend against transformers' own generate(), on two architectures."""

from __future__ import annotations

import asyncio

import pytest
import torch

from backends import AutoregressiveBackend, Backend, GenerationRequest
from tests.conftest import ARCHITECTURES

PROMPTS = [
    "def parse(value):\n    ",
    "import json\n\nclass Encoder:",
    "The result of the call is",
    "for index, item in enumerate(",
    "# compute the mean\nreturn sum(",
    "x",
]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def backend(request, tiny_model_paths) -> AutoregressiveBackend:
    return AutoregressiveBackend.from_pretrained(tiny_model_paths[request.param])


def _reference_greedy(backend: AutoregressiveBackend, prompt: str, max_new: int) -> list[int]:
    ids = backend.loaded.tokenizer(prompt)["input_ids"]
    out = backend.loaded.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    generated = out[0, len(ids) :].tolist()
    eos = [i for i, t in enumerate(generated) if t in backend.loaded.eos_ids]
    return generated[: eos[0]] if eos else generated


def test_is_a_backend(backend):
    assert isinstance(backend, Backend)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_generate_token_for_token(backend, prompt):
    result = backend.complete(GenerationRequest(prompt=prompt, max_tokens=48, temperature=0.0))
    assert result.token_ids == _reference_greedy(backend, prompt, 48)
    assert result.text == backend.loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.usage.completion_tokens == len(result.token_ids)
    assert result.stats.forward_passes == len(result.token_ids)
    assert result.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_seed_dependent(backend):
    def run(seed):
        return backend.complete(GenerationRequest(prompt="def f(", max_tokens=24, temperature=1.0, seed=seed))

    assert run(7).token_ids == run(7).token_ids
    assert len({tuple(run(s).token_ids) for s in range(4)}) > 1


def test_top_k_one_is_greedy(backend):
    sampled = backend.complete(GenerationRequest(prompt="def f(", max_tokens=16, temperature=1.3, top_k=1, seed=3))
    greedy = backend.complete(GenerationRequest(prompt="def f(", max_tokens=16, temperature=0.0))
    assert sampled.token_ids == greedy.token_ids


def test_eos_ends_the_completion(backend):
    eos = min(backend.loaded.eos_ids)

    def prefer_eos(_module, _inputs, logits):
        logits[..., eos] = logits.max() + 10.0
        return logits

    hook = backend.loaded.model.get_output_embeddings().register_forward_hook(prefer_eos)
    try:
        result = backend.complete(GenerationRequest(prompt="hello", max_tokens=8, temperature=0.0))
    finally:
        hook.remove()
    assert result.finish_reason == "eos"
    assert result.token_ids == []
    assert result.stats.forward_passes == 1


def test_chat_messages_use_the_chat_template(backend):
    request = GenerationRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)
    expected = backend.loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert backend.complete(request).usage.prompt_tokens == len(expected)


def test_stream_deltas_join_to_the_result(backend):
    chunks = list(backend.stream(GenerationRequest(prompt="def f(", max_tokens=20, temperature=0.0)))
    assert chunks[-1].result is not None
    assert "".join(c.delta for c in chunks) == chunks[-1].result.text
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_async_forms_agree_with_sync(backend):
    request = GenerationRequest(prompt="class A:", max_tokens=12, temperature=0.0)

    async def run():
        result = await backend.acomplete(request)
        chunks = [c async for c in backend.astream(request)]
        return result, chunks

    result, chunks = asyncio.run(run())
    assert result.token_ids == backend.complete(request).token_ids
    assert "".join(c.delta for c in chunks) == result.text


def test_an_abandoned_async_stream_stops_decoding(backend):
    """Leaving astream early must end the decode loop, not let it run to max_tokens for nobody."""
    passes = []
    hook = backend.loaded.model.base_model.register_forward_hook(lambda *_: passes.append(1))

    async def first_chunk_only():
        stream = backend.astream(GenerationRequest(prompt="def f(", max_tokens=400, temperature=0.0))
        async for _ in stream:
            break
        await stream.aclose()

    try:
        asyncio.run(first_chunk_only())
        assert backend.engine.wait_idle(30), "the request never left the batch"
    finally:
        hook.remove()
    assert len(passes) < 200
