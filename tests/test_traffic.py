"""Drafting from the traffic: a pool's earlier answers draft the next requests' tokens, never change an output,
stay within their memory cap, and are kept per tenant (per API key at the gateway) unless the pool shares them."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.autoregressive import AutoregressiveBackend
from backends.default_model import DEFAULT_MODEL
from backends.dspark.backend import DSparkBackend
from backends.dspark.traffic import MAX_DRAFT, TrafficCache, TrafficCaches
from backends.traffic_settings import TrafficSettings
from backends.types import DSparkOptions, GenerationRequest, TrafficOptions
from benchmarks.trace_jobs import JOBS, requests
from router.gateway.settings import ApiKey
from router.sdk import Router
from tests.test_gateway_support import serve
from tests.test_router_support import make_router, write_config

REPO = Path(__file__).resolve().parents[1]

TEMPLATE = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


def test_a_shared_continuation_drafts_and_a_longer_match_drafts_more():
    cache = TrafficCache(TrafficSettings())
    for value in (100, 101, 102):
        cache.insert([1, 2, 3, *TEMPLATE, value, 4, 5, 6, 20, 21, 22, 23])
    short = cache.speculate([50, 4, 5, 6], MAX_DRAFT)  # three tokens match: three drafted
    assert short.tokens == [20, 21, 22] and short.match == 3 and short.probs == [1.0, 1.0, 1.0]
    long = cache.speculate([1, 2, 3, *TEMPLATE[:6]], MAX_DRAFT)  # nine match: up to nine drafted
    assert long.match == 9 and len(long.tokens) == 9 and long.tokens[:4] == TEMPLATE[6:]
    assert long.probs[:4] == [1.0] * 4 and long.probs[4] == pytest.approx(1 / 3)  # the values disagree, then follow one
    assert long.votes[:5] == [3] * 5 and long.tokens[4] == 102  # ties go to the most recent answer
    assert cache.speculate([50, 51, 52], MAX_DRAFT) is None


def test_a_draft_stops_where_earlier_answers_disagree_too_much():
    cache = TrafficCache(TrafficSettings(min_token_prob=0.5))
    for ending in ([30, 31], [30, 32], [40, 41], [30, 31]):
        cache.insert([1, 2, 3, 4, *ending])
    draft = cache.speculate([1, 2, 3, 4], MAX_DRAFT)
    assert draft.tokens == [30, 31] and draft.probs == [0.75, 0.5] and draft.shares == [0.75, 2 / 3]
    assert draft.votes == [4, 3]
    assert TrafficCache(TrafficSettings(min_token_prob=0.6)).speculate([1, 2, 3, 4], 4) is None  # nothing cached
    cache.settings = TrafficSettings(min_token_prob=0.6)
    assert cache.speculate([1, 2, 3, 4], MAX_DRAFT).tokens == [30]
    asked = TrafficOptions(min_token_prob=0.8)  # a request's own options
    assert cache.speculate([1, 2, 3, 4], MAX_DRAFT, asked) is None


def test_where_earlier_answers_split_the_runner_ups_paths_are_a_trees_other_branches():
    """Four answers after one template: 30 31 twice, 30 32 once, 40 41 once. The draft follows 30 31; its forks
    are 40 41 (a quarter of the answers, at the first token) and 30 32 (a third of those that wrote 30, then
    followed as far as its own answers go), each with its path probability; they are asked for, never made
    otherwise."""
    cache = TrafficCache(TrafficSettings(min_token_prob=0.1))
    for ending in ([30, 31, 33], [30, 32, 34], [40, 41], [30, 31, 33]):
        cache.insert([1, 2, 3, 4, *ending])
    draft = cache.speculate([1, 2, 3, 4], MAX_DRAFT, forks=True)
    assert draft.tokens == [30, 31, 33] and draft.probs == pytest.approx([0.75, 0.5, 0.5])
    assert [fork.tokens for fork in draft.forks] == [[40, 41], [30, 32, 34]]
    assert draft.forks[0].probs == pytest.approx([0.25, 0.25]) and draft.forks[1].probs == pytest.approx(
        [0.75, 0.25, 0.25]
    )
    assert draft.forks[1].votes == [4, 3, 1]
    assert cache.speculate([1, 2, 3, 4], MAX_DRAFT).forks == ()


def test_the_memory_cap_holds_after_10000_answers_and_evicted_answers_never_draft():
    """Memory as Python allocates it (the array, the index and its lists), sampled as answers go in: once the cap is
    reached it stays flat (the evicted half is rebuilt away), and the oldest answer no longer drafts."""
    rng = random.Random(0)
    caches = TrafficCaches(TrafficSettings(max_tokens=20_000))
    caches.insert(None, [1, 2, 3, 4, 5, 6, 7, 8])
    cache = caches.for_scope(None)
    tracemalloc.start()
    at_cap, peak = None, 0
    try:
        for i in range(10_000):
            caches.insert(None, [rng.randrange(1000, 5000) for _ in range(rng.randint(20, 60))])
            if i % 50 == 0:
                held = tracemalloc.get_traced_memory()[0]
                if at_cap is None and cache.cached_tokens > 19_000:
                    at_cap = held
                peak = max(peak, held)
    finally:
        tracemalloc.stop()
    assert cache.cached_tokens <= 20_000 and cache.answers < 1_000
    assert at_cap is not None and peak < 2.5 * at_cap
    assert cache.speculate([1, 2, 3, 4], MAX_DRAFT) is None


@pytest.mark.parametrize("kind", ["random", "templated"])
def test_the_reported_memory_is_what_python_allocates(kind):
    """``memory_bytes`` (what bench trace and the cache gauge report) within 25% of what tracemalloc sees the cache
    allocate, on traffic whose n-grams never repeat and on an agent's template, where they mostly do (a constant per
    token was 14x below the one and 1.5x above the other)."""
    rng = random.Random(1)
    template = [rng.randrange(1000, 5000) for _ in range(30)]
    tracemalloc.start()
    try:
        cache = TrafficCache(TrafficSettings(max_tokens=200_000))
        for _ in range(2_000):
            if kind == "random":
                cache.insert([rng.randrange(1000, 50_000) for _ in range(rng.randint(20, 60))])
            else:
                cache.insert([t if rng.random() < 0.8 else rng.randrange(100, 200) for t in template])
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 0.75 * held < cache.memory_bytes < 1.25 * held


def test_caches_are_kept_per_scope_unless_the_pool_shares():
    answer = [1, 2, 3, 4, 5, 6]
    kept = TrafficCaches(TrafficSettings())
    kept.insert("a", answer)
    assert kept.for_scope("a") is kept.for_scope("a") and kept.for_scope("a").answers == 1
    assert kept.for_scope("b").answers == 0 and kept.for_scope("b").speculate([1, 2, 3], MAX_DRAFT) is None
    shared = TrafficCaches(TrafficSettings(shared=True))
    shared.insert("a", answer)
    assert shared.for_scope("a") is shared.for_scope("b") is shared.for_scope(None)


def test_one_scope_at_the_cap_loses_one_answer_per_answer_it_gains():
    """The pool's cap is the only eviction: a scope alone at the cap gives up its oldest answer for each new one, not
    two (as when its cache also kept a cap of its own, and the pool's count drifted from what it held)."""
    rng = random.Random(3)
    caches = TrafficCaches(TrafficSettings(max_tokens=1_000))
    for _ in range(100):
        caches.insert("a", [rng.randrange(1000, 5000) for _ in range(50)])
    assert (caches.for_scope("a").answers, caches.for_scope("a").cached_tokens) == (20, 1_000)


def test_the_pools_cap_holds_over_all_its_scopes():
    """A client that names a new tenant with every request makes a scope each: the pool's cap counts them all, the
    oldest answers go first whichever scope holds them, a scope left empty is forgotten, and memory stays flat."""
    rng = random.Random(2)
    caches = TrafficCaches(TrafficSettings(max_tokens=5_000))
    tracemalloc.start()
    held = []
    try:
        for i in range(3_000):
            caches.insert(f"tenant-{i}", [rng.randrange(1000, 5000) for _ in range(50)])
            if i % 500 == 499:
                held.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    scopes = caches.scopes()
    assert sum(cache.cached_tokens for cache in scopes.values()) <= 5_000 and len(scopes) == 100
    assert "tenant-2999" in scopes and "tenant-0" not in scopes and caches.for_scope("tenant-0").answers == 0
    assert max(held) < 1.5 * held[0]


@pytest.fixture(scope="module")
def published() -> DSparkBackend:
    return DSparkBackend.from_pretrained(DEFAULT_MODEL, drafter="dspark")


def _with_traffic(published: DSparkBackend, settings: TrafficSettings) -> DSparkBackend:
    return DSparkBackend(
        None,
        drafter=published.drafter,
        schedule=published.schedule,
        default="dspark",
        loaded=published.loaded,
        traffic=TrafficCaches(settings),
    )


def test_greedy_output_drafting_from_the_traffic_is_plain_decodings(published):
    """A job's requests in turn (each drafting from the answers before it), and one asked twice: every output is the
    autoregressive one, token for token, and the cache did draft."""
    backend, plain = _with_traffic(published, TrafficSettings()), AutoregressiveBackend(published.loaded)
    job = next(j for j in JOBS if j.name == "triage")
    bodies = [*requests(job, 5), *requests(job, 1)]
    drafted = 0
    for body in bodies:
        request = GenerationRequest(**{**body, "max_tokens": 48})
        result = backend.complete(request)
        assert result.token_ids == plain.complete(request).token_ids
        drafted += result.stats.spans.traffic_rounds
    assert drafted > 0
    off = GenerationRequest(**{**bodies[0], "max_tokens": 48, "dspark": DSparkOptions(traffic={"enabled": False})})
    assert backend.complete(off).stats.spans.traffic_rounds == 0


@pytest.mark.parametrize("job_name", ["extraction", "docstrings"])
def test_greedy_output_verifying_token_trees_is_plain_decodings(published, job_name):
    """Where the context's copy, the traffic's draft, its forks and the shipped answers' disagree, they are verified
    as one tree: under a JSON schema (each branch walked through the grammar) and without one, every output is the
    autoregressive one, token for token, and trees were verified; a request that leaves them off (the default)
    verifies none."""
    backend, plain = _with_traffic(published, TrafficSettings()), AutoregressiveBackend(published.loaded)
    job = next(j for j in JOBS if j.name == job_name)
    trees = 0
    for body in requests(job, 6):
        request = GenerationRequest(**{**body, "max_tokens": 64, "dspark": DSparkOptions(trees=True)})
        result = backend.complete(request)
        assert result.token_ids == plain.complete(request).token_ids
        trees += result.stats.spans.tree_rounds
    assert trees > 0
    assert backend.complete(GenerationRequest(**{**body, "max_tokens": 64})).stats.spans.tree_rounds == 0


def _traffic_rounds(backend: DSparkBackend, scope: str, repeats: int = 3) -> int:
    """A request asked ``repeats`` times in ``scope``: the last one's rounds drafted from earlier answers."""
    body = {"messages": [{"role": "user", "content": "List four colours, one a line."}], "max_tokens": 40}
    result = None
    for _ in range(repeats):
        result = backend.complete(GenerationRequest(**body, temperature=0, cache_scope=scope))
    return result.stats.spans.traffic_rounds


def test_a_request_never_drafts_from_another_tenants_answers_unless_the_pool_shares(published):
    kept = _with_traffic(published, TrafficSettings())
    assert _traffic_rounds(kept, "tenant-a") > 0
    assert _traffic_rounds(kept, "tenant-b", repeats=1) == 0
    assert set(kept.traffic.scopes()) == {"tenant-a", "tenant-b"}
    shared = _with_traffic(published, TrafficSettings(shared=True))
    assert _traffic_rounds(shared, "tenant-a") > 0
    assert _traffic_rounds(shared, "tenant-b", repeats=1) > 0


def test_a_key_cannot_reach_another_keys_cache_by_naming_its_tenant(tmp_path):
    """Two API keys at the gateway; the second names the first's tenant (``user`` and ``metadata.tenant``): its
    request drafts from nothing the first key's requests left, while the first key's own repeat does."""
    pool = {"backend": "dspark", "model": str(DEFAULT_MODEL), "drafter_path": "default", "drafter": "dspark"}
    data = {"pools": {"dspark": pool}, "policy": {"classifier": None, "default_pool": "dspark"}}
    body = {
        "model": "dspark-router/dspark",
        "messages": [{"role": "user", "content": "List four colours, one a line."}],
        "max_tokens": 40,
        "temperature": 0,
        "user": "acme",
        "metadata": {"tenant": "acme"},
    }
    keys = [ApiKey(key="sk-first", name="first"), ApiKey(key="sk-second", name="second")]
    with make_router(tmp_path, data) as router:
        router.warmup()
        with serve(router, api_keys=keys) as server:

            def rounds(key: str) -> int:
                answer = httpx.post(
                    f"{server.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
                )
                assert answer.status_code == 200, answer.text
                return answer.json()["usage"]["dspark"]["traffic_rounds"]

            first = [rounds("sk-first") for _ in range(3)]
            assert first[-1] > 0
            assert rounds("sk-second") == 0
        scopes = router.pools["dspark"].replicas[0].traffic.scopes()
        assert len(scopes) == 2 and all("acme" in scope for scope in scopes)


def test_the_gateways_metrics_show_what_the_pools_caches_hold(tmp_path):
    """Once the DSpark pool on the default model has answered, /metrics shows its traffic cache and its kept prompt
    prefixes holding what the pool itself counts."""
    pool = {"backend": "dspark", "model": str(DEFAULT_MODEL), "drafter_path": "default", "drafter": "dspark"}
    data = {"pools": {"dspark": pool}, "policy": {"classifier": None, "default_pool": "dspark"}}
    body = {"messages": [{"role": "user", "content": "List four colours, one a line."}], "max_tokens": 24}
    with make_router(tmp_path, data) as router:
        router.warmup()
        with serve(router) as server:
            answer = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "temperature": 0})
            assert answer.status_code == 200, answer.text
            text = httpx.get(f"{server.url}/metrics").text
        held = router.pools["dspark"].cache_bytes()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "dspark_router_cache_bytes")
    shown = {sample.labels["cache"]: sample.value for sample in family.samples if sample.labels["pool"] == "dspark"}
    assert shown == held and held["traffic"] > 0 and held["prefix"] > 0


def test_a_request_on_worker_b_drafts_from_an_answer_worker_a_wrote_and_a_killed_worker_loses_nothing(
    tmp_path, redis_url
):
    """Two Redis workers of one DSpark pool, over a real Redis: worker A answers a request and is killed; worker B,
    started after, warmed from the pool's traffic stream, so the same request on B drafts from A's answer and gives
    the same text."""
    pool = {
        "backend": "dspark",
        "model": str(DEFAULT_MODEL),
        "drafter_path": "default",
        "drafter": "dspark",
        "transport": "redis",
        "redis_url": redis_url,
        "redis": {"prefix": f"traffic-{uuid.uuid4().hex[:8]}", "heartbeat_s": 0.25, "visibility_timeout_s": 1.5},
        "timeout_s": 120,
    }
    config = write_config(tmp_path / "router.yaml", {"pools": {"remote": pool}, "policy": {"classifier": None}})
    body = {
        "messages": [{"role": "user", "content": "List four colours, one a line."}],
        "max_tokens": 48,
        "temperature": 0,
        "model": "remote",
    }

    def worker(name: str) -> subprocess.Popen:
        log = (tmp_path / f"{name}.log").open("w")
        command = [sys.executable, "-m", "router", "worker", "--config", str(config), "--pool", "remote"]
        return subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=log)

    def live(router: Router, count: int) -> None:
        deadline = time.monotonic() + 120
        while len(router.pools["remote"].live_workers()) != count:
            assert time.monotonic() < deadline, "the workers did not come up"
            time.sleep(0.1)

    with Router.from_config(config) as router:
        a = worker("a")
        try:
            live(router, 1)
            first = router.complete(**body)
            assert first.stats.spans.traffic_rounds == 0  # nothing cached yet
            a.kill()
            a.wait(timeout=30)
            b = worker("b")
            try:
                live(router, 1)
                again = router.complete(**body)
            finally:
                b.terminate()
                b.wait(timeout=60)
        finally:
            a.kill()
    assert again.token_ids == first.token_ids
    assert again.stats.spans.traffic_rounds > 0
