"""Pools over Redis with real ``dspark-router worker`` processes: answers, reclaim after ``kill -9``, dead letters,
cancellation, draining, outages and state shared by router replicas."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import asyncio
import copy
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import redis

from backends.default_model import DEFAULT_MODEL
from backends.errors import InvalidRequestError
from backends.types import GenerationRequest
from router import Router
from router.errors import JobDeadLetteredError, PoolUnavailableError, QueueFullError, ReplayDivergedError
from router.gateway.app import create_app
from router.gateway.settings import ApiKey
from router.redis_pool import RedisPool
from tests.test_gateway_support import Server, settings
from tests.test_router_support import config_data, router_models, write_config  # noqa: F401

MESSAGES = [{"role": "user", "content": "def parse(value):"}]
LONG = 300  # tokens: long enough to kill, cancel or drain a worker in the middle
# Seeded sampling: a restarted job must replay the same draws (and the tiny model's greedy text is one token
# repeated, which would hide a chunk sent twice).
SAMPLED = {"temperature": 1.0, "seed": 2}
REPO = Path(__file__).resolve().parents[1]


class Deployment:
    """One config, router replicas and worker processes on loopback, sharing one Redis under a fresh prefix."""

    def __init__(
        self, tmp_path: Path, models: dict[str, Path], url: str, health: dict | None = None, **redis_settings: float
    ) -> None:
        data = config_data(models)
        settings = {"prefix": f"test-{uuid.uuid4().hex[:8]}", "visibility_timeout_s": 1.5, "heartbeat_s": 0.25}
        data["pools"]["remote"] = {
            "backend": "autoregressive",
            "model": str(models["standard"]),
            "transport": "redis",
            "redis_url": url,
            "max_queue": 16,
            "timeout_s": 60,
            "redis": {**settings, **redis_settings},
            "health": health or {},  # by default the defaults (checked every 10 s while healthy)
        }
        data["redis_url"] = url  # shared state of the gateways (rate limits), beside the pool's queue
        self.tmp_path, self.url, self.data = tmp_path, url, data
        self.config = write_config(tmp_path / "router.yaml", data)
        self.prefix = settings["prefix"]
        self.workers: list[subprocess.Popen] = []
        self.routers: list[Router] = []
        self.client = redis.Redis.from_url(url)

    def router(self) -> Router:
        router = Router.from_config(self.config)
        self.routers.append(router)
        return router

    def start_workers(self, count: int, wait: bool = True, model: Path | None = None) -> list[subprocess.Popen]:
        """``model``: other model files than the routers' config names, as on a host deployed with other ones."""
        config = self.config
        if model is not None:
            data = copy.deepcopy(self.data)
            data["pools"]["remote"]["model"] = str(model)
            config = write_config(self.tmp_path / f"router-{model.name}.yaml", data)
        # One torch thread, as in this test process, so that greedy outputs agree bit for bit.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        command = [sys.executable, "-m", "router", "worker", "--config", str(config), "--pool", "remote"]
        started = []
        for _ in range(count):
            log = (self.tmp_path / f"worker-{len(self.workers)}.log").open("w")
            started.append(subprocess.Popen(command, env=env, stderr=log, stdout=log))
            self.workers.append(started[-1])
        if wait:
            self.wait_for(lambda: len(self.pool().live_workers()) >= self.alive(), "workers never came up", 60)
        return started

    def alive(self) -> int:
        return sum(worker.poll() is None for worker in self.workers)

    def pool(self) -> RedisPool:
        return (self.routers[0] if self.routers else self.router()).pools["remote"]

    def holder(self) -> int | None:
        """The pid of the worker process that holds the pool's one pending job, if any."""
        held = self.holders()
        return held[0] if held else None

    def holders(self) -> list[int]:
        """The pid of the worker process holding each pending job."""
        pending = self.client.xpending_range(f"{self.prefix}:remote:jobs", "workers", "-", "+", 1000)
        return [int(entry["consumer"].decode().rsplit("-", 2)[1]) for entry in pending]

    def logs(self) -> str:
        return "".join(path.read_text() for path in sorted(self.tmp_path.glob("worker-*.log")))

    @staticmethod
    def wait_for(condition, message: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, message
            time.sleep(0.02)

    def close(self) -> None:
        for router in self.routers:
            router.close()
        for worker in self.workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait(timeout=10)


@contextmanager
def deployment(tmp_path, models, url, workers: int = 1, health=None, **settings) -> Iterator[Deployment]:
    deployed = Deployment(tmp_path, models, url, health, **settings)
    try:
        deployed.start_workers(workers)
        yield deployed
    finally:
        deployed.close()


@pytest.fixture(scope="module")
def expected(router_models, tmp_path_factory) -> str:
    """The in-process greedy answer to the long request: what every Redis path must deliver, exactly once."""
    with Router.from_config(
        write_config(tmp_path_factory.mktemp("expected") / "r.yaml", config_data(router_models))
    ) as r:
        result = r.complete(messages=MESSAGES, max_tokens=LONG, model="standard", **SAMPLED)
    assert result.finish_reason == "length"  # the request runs its whole length: there is a middle to act in
    assert len(set(result.token_ids)) > 50
    return result.text


def long_stream(router: Router, on_first=None) -> tuple[list[str], str]:
    deltas, final = [], None
    for chunk in router.stream(messages=MESSAGES, max_tokens=LONG, model="remote", **SAMPLED):
        if chunk.result is not None:
            final = chunk.result
        elif chunk.delta:
            deltas.append(chunk.delta)
            if len(deltas) == 1 and on_first is not None:
                on_first()
    assert final is not None and final.decision.pool == "remote"
    return deltas, final.text


class Streams:
    """Requests streamed at once, each on a thread of its own: its deltas, its result or its error, and an event
    set when it first answered."""

    def __init__(self, router: Router, asks: list[dict]) -> None:
        self.deltas: list[list[str]] = [[] for _ in asks]
        self.outcomes: list[object] = [None] * len(asks)
        self.first = [threading.Event() for _ in asks]
        self.clients = [threading.Thread(target=self._stream, args=(router, i, ask)) for i, ask in enumerate(asks)]

    def _stream(self, router: Router, i: int, ask: dict) -> None:
        try:
            for chunk in router.stream(**ask):
                if chunk.result is not None:
                    self.outcomes[i] = chunk.result
                elif chunk.delta:
                    self.deltas[i].append(chunk.delta)
                    self.first[i].set()
        except Exception as exc:
            self.outcomes[i] = exc
            self.first[i].set()

    def start(self, i: int) -> bool:
        """Start request i and wait for its first answer."""
        self.clients[i].start()
        return self.first[i].wait(60)

    def join(self) -> None:
        for client in self.clients:
            client.join(90)

    @property
    def failed(self) -> list[Exception]:
        return [o for o in self.outcomes if isinstance(o, Exception)]


def test_two_replicas_and_two_workers_serve_like_in_process(tmp_path, router_models, redis_url, expected):
    with deployment(tmp_path, router_models, redis_url, workers=2) as deployed:
        replicas = [deployed.router(), deployed.router()]
        assert len(replicas[1].pools["remote"].live_workers()) == 2

        def remote(seed: int) -> str:
            args = {"messages": MESSAGES, "max_tokens": 40, "temperature": 1.0, "seed": seed, "model": "remote"}
            result = replicas[seed % 2].complete(**args)
            assert result.usage.completion_tokens == len(result.token_ids) and result.decision.pool == "remote"
            return result.text

        with ThreadPoolExecutor(8) as clients:
            answers = list(clients.map(remote, range(8)))
        local = [
            replicas[0].complete(messages=MESSAGES, max_tokens=40, temperature=1.0, seed=seed, model="standard").text
            for seed in range(8)
        ]
        assert answers == local and len(set(local)) > 1  # seeded sampling: the same draws, whichever worker ran it
        with pytest.raises(InvalidRequestError):  # the worker's typed error arrives as the same type
            replicas[0].complete(messages=[{"role": "user", "content": "word " * 600}], max_tokens=4, model="remote")
        deployed.wait_for(lambda: replicas[1].pools["remote"].depth == 0, "finished jobs stayed in the stream")


def test_a_killed_workers_job_is_reclaimed_and_each_token_arrives_once(tmp_path, router_models, redis_url, expected):
    with deployment(tmp_path, router_models, redis_url, workers=2) as deployed:
        router, killed = deployed.router(), []

        def kill_holder():
            deployed.wait_for(lambda: deployed.holder() is not None, "no worker holds the job")
            killed.append(deployed.holder())
            os.kill(killed[0], signal.SIGKILL)

        deltas, text = long_stream(router, on_first=kill_holder)
        assert "".join(deltas) == text == expected
        assert deployed.holder() is None and "reclaimed" in deployed.logs()
        assert any(w.pid == killed[0] and w.wait(5) == -signal.SIGKILL for w in deployed.workers)


def test_a_killed_worker_fails_only_the_requests_it_held_and_never_the_pool(
    tmp_path, router_models, tiny_model_paths, redis_url
):
    """Two workers on different model files (the tiny llama and the tiny gpt2, whose seeded draws differ from the
    first token), so that no job of the killed one can be replayed by the other: each fails alone with the typed
    error, every other request is answered, and the pool, allowed a single failure, is never cooled down: one
    worker's death is not the pool's."""
    with deployment(tmp_path, router_models, redis_url, health={"allowed_fails": 1}) as deployed:
        deployed.start_workers(1, model=tiny_model_paths["gpt2"])
        router, count = deployed.router(), 4

        def ask(i: int) -> dict:
            return {"messages": MESSAGES, "max_tokens": LONG, "temperature": 1.0, "seed": i, "model": "remote"}

        streams = Streams(router, [ask(i) for i in range(count)])
        for i in range(count):  # one after the other: the two workers take turns
            assert streams.start(i), "a request was never answered"
        held = deployed.holders()
        finished = sum(outcome is not None for outcome in streams.outcomes)  # a seeded draw may reach EOS early
        killed = held[0]
        os.kill(killed, signal.SIGKILL)
        streams.join()
        failed = streams.failed
        assert len(failed) == held.count(killed) >= 1 and len(held) + finished >= count
        assert all(isinstance(error, ReplayDivergedError) for error in failed), failed
        assert failed[0].status_code == 502 and failed[0].to_openai()["error"]["code"] == "replay_diverged"
        answered = [(o, d) for o, d in zip(streams.outcomes, streams.deltas) if not isinstance(o, Exception)]
        assert answered and all("".join(deltas) == o.text for o, deltas in answered)
        health = router.health["remote"]
        assert router.unavailable() == {} and health.failures_total == 0 and router.pools["remote"].serving()
        for i in (i for i, o in enumerate(streams.outcomes) if isinstance(o, Exception)):  # the survivor serves them
            again = router.complete(**ask(i))
            assert not again.text.startswith("".join(streams.deltas[i]))
        assert deployed.holder() is None


def test_on_the_packed_engine_a_killed_workers_jobs_replay_exactly(tmp_path, router_models, redis_url):
    """The default model (the packed engine) on two workers: greedy requests decoded in busy batches, one worker
    killed mid-stream; the survivor batches the reclaimed jobs with others and still regenerates exactly what was
    streamed, so no request fails, and each answer is the one the same request gets alone."""
    with deployment(tmp_path, router_models, redis_url, workers=0) as deployed:
        deployed.start_workers(2, model=DEFAULT_MODEL)
        router, count = deployed.router(), 6
        asks = [
            {"messages": [{"role": "user", "content": f"Count from {i} to {i + 300}, one number a line."}],
             "max_tokens": 96, "temperature": 0.0, "model": "remote"}
            for i in range(count)
        ]  # fmt: skip
        streams = Streams(router, asks)
        for client in streams.clients:
            client.start()
        assert all(started.wait(60) for started in streams.first), "a request was never answered"
        held = deployed.holders()
        killed = max(set(held), key=held.count)
        os.kill(killed, signal.SIGKILL)
        streams.join()
        assert not streams.failed and held.count(killed) >= 1
        assert all("".join(deltas) == o.text for o, deltas in zip(streams.outcomes, streams.deltas))
        assert "reclaimed" in deployed.logs()
        alone = [router.complete(**ask).text for ask in asks]  # one at a time, on the survivor
        assert [o.text for o in streams.outcomes] == alone


def test_a_job_that_keeps_killing_its_workers_is_dead_lettered(tmp_path, router_models, redis_url):
    with deployment(tmp_path, router_models, redis_url, workers=3, max_deliveries=2) as deployed:
        router, killed = deployed.router(), []

        def kill_each_holder():
            for _ in range(2):
                deployed.wait_for(lambda: deployed.holder() not in (None, *killed), "the job was not redelivered")
                killed.append(deployed.holder())
                os.kill(killed[-1], signal.SIGKILL)

        with pytest.raises(JobDeadLetteredError, match="delivered 2 times") as failed:
            long_stream(router, on_first=kill_each_holder)
        assert failed.value.status_code == 502 and failed.value.to_openai()["error"]["code"] == "dead_lettered"
        assert deployed.client.xlen(f"{deployed.prefix}:remote:dead") == 1
        assert router.health["remote"].failures_total == 0  # its workers' deaths, not the pool's failures
        assert deployed.alive() == 1 and router.pools["remote"].depth == 0


def test_a_client_that_goes_away_stops_the_worker(tmp_path, router_models, redis_url):
    with deployment(tmp_path, router_models, redis_url) as deployed:
        router = deployed.router()
        for _ in router.stream(messages=MESSAGES, max_tokens=LONG, temperature=0, model="remote"):
            break
        deployed.wait_for(lambda: router.pools["remote"].depth == 0, "the cancelled job never finished")
        replies = [k for k in deployed.client.scan_iter(f"{deployed.prefix}:reply:*")]
        entries = deployed.client.xrange(replies[0])
        assert b"StreamClosed" in entries[-1][1][b"error"]
        assert len(entries) < LONG / 2  # stopped well before max_tokens


def _reply_entries(deployed) -> list[list[dict]]:
    replies = deployed.client.scan_iter(f"{deployed.prefix}:reply:*")
    return [[fields for _, fields in deployed.client.xrange(key)] for key in replies]


def test_a_job_that_does_not_stream_writes_only_its_answer(tmp_path, router_models, redis_url):
    """Nobody reads the chunks of a job whose caller does not stream, and each was a Redis round trip in the worker:
    its reply stream holds only the answer (a streamed job's holds every chunk), and its time to first token is still
    told apart from its latency, from the worker's own."""
    with deployment(tmp_path, router_models, redis_url) as deployed:
        router = deployed.router()
        whole = router.complete(messages=MESSAGES, max_tokens=40, model="remote", **SAMPLED)
        (entries,) = _reply_entries(deployed)
        assert [list(f) for f in entries] == [[b"result"]] and whole.usage.completion_tokens > 1
        assert 0 < whole.measured.ttft_s < whole.measured.latency_s
        deltas, text = long_stream(router)
        streamed = max(_reply_entries(deployed), key=len)
        assert text == "".join(deltas) and sum(b"seq" in f for f in streamed) == len(deltas) > 1


def test_a_caller_that_gives_up_on_a_job_that_does_not_stream_stops_the_worker(tmp_path, router_models, redis_url):
    """No chunk arrives to raise in: while the reply stream is silent the pool asks the caller every read, so a
    cancelled request still sets the job's cancel key and the worker stops."""
    with deployment(tmp_path, router_models, redis_url) as deployed:
        router = deployed.router()

        async def give_up() -> None:
            ask = {"messages": MESSAGES, "max_tokens": LONG, "model": "remote", **SAMPLED}
            task = asyncio.ensure_future(router.acomplete(**ask))
            await asyncio.to_thread(deployed.wait_for, lambda: deployed.holder() is not None, "no worker took the job")
            task.cancel()

        asyncio.run(give_up())
        deployed.wait_for(lambda: router.pools["remote"].depth == 0, "the cancelled job never finished")
        (entries,) = _reply_entries(deployed)
        assert len(entries) == 1 and b"StreamClosed" in entries[0][b"error"]


def test_sigterm_drains_a_worker_without_losing_its_job(tmp_path, router_models, redis_url, expected):
    with deployment(tmp_path, router_models, redis_url) as deployed:
        router, worker = deployed.router(), deployed.workers[0]
        deltas, text = long_stream(router, on_first=lambda: worker.send_signal(signal.SIGTERM))
        assert "".join(deltas) == text == expected
        assert worker.wait(timeout=20) == 0
        assert router.pools["remote"].live_workers() == []  # it deregistered


def test_redis_outage_gives_503_then_recovers_by_itself(tmp_path, router_models, private_redis):
    """Served and ready within a second of Redis's return, with the default health settings: a cooled-down pool is
    probed on a back-off of well under a second, not at the 10 s check interval; meanwhile the 503 says how long
    is left."""
    with deployment(tmp_path, router_models, private_redis.url) as deployed:
        router = deployed.router()
        before = router.complete(messages=MESSAGES, max_tokens=8, temperature=0, model="remote").text
        private_redis.stop()
        started = time.monotonic()
        with pytest.raises(PoolUnavailableError) as down:
            router.complete(messages=MESSAGES, max_tokens=8, temperature=0, model="remote")
        assert time.monotonic() - started < 3 and down.value.status_code == 503
        deployed.wait_for(lambda: "cooled down" in router.unavailable().get("remote", ""), "never cooled down")
        assert router.complete(messages=MESSAGES, max_tokens=8, temperature=0, model="standard").text == before
        with Server(create_app(router, settings(), warmup=False)) as gateway:
            refused = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.InternalServerError) as cooled:
                refused.chat.completions.create(model="dspark-router/remote", messages=MESSAGES, max_tokens=8)
        left = float(cooled.value.message.split("cooled down for ")[1].split("s more")[0])
        assert cooled.value.status_code == 503 and int(cooled.value.response.headers["retry-after"]) == math.ceil(left)
        assert left > 20  # the default cooldown of 30 s, most of it still ahead
        private_redis.start()
        returned = time.monotonic()
        while True:  # neither the router nor the worker is restarted: both reconnect
            try:
                again = router.complete(messages=MESSAGES, max_tokens=8, temperature=0, model="remote")
                break
            except PoolUnavailableError:
                assert time.monotonic() - returned < 1.0, "service was not back within 1 s of Redis"
                time.sleep(0.02)
        assert again.text == before and deployed.alive() == 1
        assert router.unavailable() == {}  # ready again with its first success, not at a later probe
        assert time.monotonic() - returned < 2.0


def test_depth_and_capacity_are_shared_by_replicas(tmp_path, router_models, redis_url):
    deployed = Deployment(tmp_path, router_models, redis_url)  # no worker: jobs wait in the stream
    try:
        one, other = deployed.router().pools["remote"], deployed.router().pools["remote"]
        request = GenerationRequest(messages=MESSAGES, max_tokens=2, temperature=0.0)
        futures = [one.submit(request) for _ in range(16)]
        assert other.depth == 16 and other.capacity == 16 and other.full
        with pytest.raises(QueueFullError):
            other.submit(request)
        deployed.start_workers(1)
        assert all(f.result(timeout=60).usage.completion_tokens == 2 for f in futures)
        assert other.depth == 0
    finally:
        deployed.close()


def test_two_gateways_share_the_workers_and_each_keys_rate(tmp_path, router_models, redis_url):
    """Two gateway replicas over one Redis: either serves the Redis pool's jobs, and a key's rate is one budget."""
    with deployment(tmp_path, router_models, redis_url, workers=2) as deployed:
        token = f"sk-team-{uuid.uuid4().hex}"  # a fresh key: its bucket outlives the test in a shared Redis
        keys = [ApiKey(key=token, requests_per_minute=6)]
        gateways = [Server(create_app(deployed.router(), settings(api_keys=keys), warmup=False)) for _ in range(2)]
        with gateways[0], gateways[1]:
            clients = [openai.OpenAI(base_url=f"{g.url}/v1", api_key=token, max_retries=0) for g in gateways]

            def ask(seed: int) -> str:
                response = clients[seed % 2].chat.completions.create(
                    model="dspark-router/remote", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=seed
                )
                return response.choices[0].message.content

            with ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(ask, range(6)))  # the key's whole burst, spread over both replicas
            local = [
                deployed.routers[0].complete(messages=MESSAGES, max_tokens=12, seed=seed, model="standard").text
                for seed in range(6)
            ]
            assert answers == local
            with pytest.raises(openai.RateLimitError) as limited:
                ask(6)
            assert int(limited.value.response.headers["retry-after"]) >= 1
            assert list(deployed.client.scan_iter("dspark-router:ratelimit:*"))
