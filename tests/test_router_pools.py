"""In-process worker pools: bounded admission, streaming, timeouts, and failures that stay with their request."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import threading
import time

import pytest

from backends.constraints import vocabulary
from backends.errors import InvalidRequestError, ModelLoadError
from backends.types import GenerationRequest
from router.config import PoolConfig
from router.errors import PoolClosedError, PoolTimeoutError, QueueFullError
from router.pools import InProcessPool
from tests.test_router_support import MESSAGES, copy_model, router_models, saturated_pool  # noqa: F401

TOO_LONG = [{"role": "user", "content": "word " * 600}]  # past the tiny model's 512-token context


def request(max_tokens: int = 6, messages=MESSAGES) -> GenerationRequest:
    return GenerationRequest(messages=messages, max_tokens=max_tokens, temperature=0.0)


def make_pool(
    path, *, backend="autoregressive", workers=1, max_batch=1, max_queue=1, timeout_s=30.0, dtype="auto"
) -> InProcessPool:
    config = PoolConfig(
        backend=backend,
        model=str(path),
        workers=workers,
        max_batch=max_batch,
        max_queue=max_queue,
        timeout_s=timeout_s,
        dtype=dtype,
    )
    return InProcessPool.from_config("p", config)


@pytest.fixture
def pool(router_models):
    pool = make_pool(router_models["standard"])
    yield pool
    pool.close()


def test_a_full_pool_refuses_at_once_and_recovers(pool):
    assert (pool.depth, pool.capacity) == (0, 2)
    with saturated_pool(pool):
        assert pool.full and pool.depth == 2
        started = time.monotonic()
        with pytest.raises(QueueFullError, match="full"):
            pool.submit(request())
        assert time.monotonic() - started < 0.5
    assert pool.depth == 0
    assert pool.complete(request()).usage.completion_tokens > 0


def test_a_batching_pool_admits_a_batch_per_worker_and_decodes_it_together(router_models):
    """Capacity is workers x max_batch running plus the queue; concurrent requests share one forward pass."""
    pool = make_pool(router_models["standard"], workers=1, max_batch=4, max_queue=2)
    try:
        assert pool.capacity == 6
        pool.warmup()
        engine = pool._replicas[0].engine
        rows = []
        engine.observers.append(lambda record: rows.append(record.rows))
        with engine.hold():
            futures = [pool.submit(request(max_tokens=12)) for _ in range(4)]
            deadline = time.monotonic() + 10
            while engine.depth < 4 and time.monotonic() < deadline:
                time.sleep(0.005)
        results = [f.result(timeout=30) for f in futures]
        assert max(rows) == 4
        assert all(r.token_ids == results[0].token_ids for r in results)
    finally:
        pool.close()


def test_stream_ends_with_the_full_result(pool):
    chunks = list(pool.stream(request(max_tokens=8)))
    result = chunks[-1].result
    assert result is not None and all(c.result is None for c in chunks[:-1])
    assert "".join(c.delta for c in chunks) == result.text
    assert result == pool.complete(request(max_tokens=8)).model_copy(update={"stats": result.stats})


def test_leaving_a_stream_early_frees_the_worker(pool):
    for _ in pool.stream(request(max_tokens=400)):
        break
    deadline = time.monotonic() + 10
    while pool.depth and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.depth == 0


def test_a_worker_failure_fails_only_its_request(pool):
    bad, good = pool.submit(request(messages=TOO_LONG)), pool.submit(request())
    with pytest.raises(InvalidRequestError, match="context"):
        bad.result(timeout=30)
    assert good.result(timeout=30).usage.completion_tokens > 0
    assert pool.complete(request()).finish_reason in ("length", "eos")


def test_timeout_ends_generation_between_forward_passes(router_models):
    pool = make_pool(router_models["standard"], timeout_s=0.01)
    started = time.monotonic()
    with pytest.raises(PoolTimeoutError, match=r"0\.01s"):
        pool.complete(request(max_tokens=400))
    assert time.monotonic() - started < 10
    pool.close()


def test_missing_model_is_a_load_error_per_request(tmp_path):
    pool = make_pool(tmp_path / "gone")
    for _ in range(2):
        with pytest.raises(ModelLoadError):
            pool.complete(request())
    assert pool.depth == 0
    pool.close()


def test_workers_run_at_the_same_time_on_their_own_replicas(router_models):
    """Both requests must be inside generation at once to pass the barrier: one shared engine would serialise them
    (each worker has its own engine and KV cache; only the weights are shared)."""
    pool = make_pool(router_models["dspark"], backend="dspark", workers=2, max_queue=0)
    barrier = threading.Barrier(2, timeout=20)
    met: set[int] = set()

    def meet_once(_) -> None:
        if threading.get_ident() not in met:
            met.add(threading.get_ident())
            barrier.wait()

    first, second = (pool.submit(request(), on_chunk=meet_once) for _ in range(2))
    assert first.result(timeout=30).stats.spans is not None
    assert second.result(timeout=30).text == first.result().text
    pool.close()


def test_pools_and_workers_on_one_model_share_one_copy_of_its_weights(router_models):
    """Two pools (DSpark and standard) of two workers each on one folder hold one model in memory; a pool on
    another precision loads its own."""
    dspark = make_pool(router_models["dspark"], backend="dspark", workers=2)
    standard = make_pool(router_models["dspark"], backend="autoregressive", workers=2)
    other = make_pool(router_models["dspark"], backend="autoregressive", dtype="bfloat16")
    for pool in (dspark, standard, other):
        pool.warmup()
    models = {id(backend.loaded.model) for pool in (dspark, standard) for backend in pool.replicas}
    assert len(models) == 1 and len(dspark.replicas) == len(standard.replicas) == 2
    assert id(other.replicas[0].loaded.model) not in models
    assert dspark.submit(request()).result(timeout=30).text == standard.submit(request()).result(timeout=30).text
    for pool in (dspark, standard, other):
        pool.close()


def test_a_closed_pool_refuses(pool):
    pool.close()
    with pytest.raises(PoolClosedError):
        pool.submit(request())


def test_dspark_decoding_options_reach_the_decoder(router_models):
    config = PoolConfig(
        backend="dspark", model=str(router_models["dspark"]), decoding={"max_span": 2, "thresholds": {2: 0.0}}
    )
    pool = InProcessPool.from_config("d", config)
    spans = pool.complete(request(max_tokens=12)).stats.spans
    assert set(spans.proposed_span_hist) == {2}
    pool.close()


def test_a_warmed_pool_has_built_its_grammar_vocabulary(router_models, tmp_path):
    """The grammar engine's view of the vocabulary (0.4 s for the default model's 49k tokens, once a process) is
    built when a pool loads its backend, not by the first request with a schema. A copy of the model, so no other
    test's load shares its tokenizer."""
    pool = make_pool(copy_model(router_models["standard"], tmp_path / "model"))
    try:
        pool.warmup()
        assert pool.replicas[0].loaded.tokenizer in vocabulary._cache
    finally:
        pool.close()
