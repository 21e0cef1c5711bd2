"""Prometheus metrics of one router, in a registry of its own (never the process-global one), so two routers in
one process (or two tests) never share counts and the gateway can expose exactly its router's numbers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from backends.types import CACHES
from router.decisions import Decision, Measured
from router.pool import Pool

if TYPE_CHECKING:
    from backends.engine import StepRecord

TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter("dspark_router_decisions", "Routing decisions", ["pool", "rule"], registry=r)
        self.explored = Counter(
            "dspark_router_explored", "Requests sent to the other pool to explore", ["pool"], registry=r
        )
        self.score = Histogram(
            "dspark_router_classifier_score",
            "Classifier scores",
            buckets=tuple(i / 10 for i in range(1, 11)),
            registry=r,
        )
        self.accepted = Histogram(
            "dspark_router_mean_accepted_tokens",
            "Tokens committed per forward pass, per request",
            ["pool"],
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 6.0, 8.0),
            registry=r,
        )
        self.tokens_per_s = Histogram(
            "dspark_router_tokens_per_second",
            "Completion tokens per second, per request",
            ["pool"],
            buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500),
            registry=r,
        )
        self.latency = Histogram(
            "dspark_router_latency_seconds", "End-to-end latency", ["pool"], buckets=TIME_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "dspark_router_time_to_first_token_seconds",
            "Time to first token",
            ["pool"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "dspark_router_batch_size",
            "Requests in each batched forward pass of a local pool",
            ["pool"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.forward_tokens = Histogram(
            "dspark_router_tokens_per_forward",
            "Tokens fed to each batched forward pass (every request's next token plus verified drafts)",
            ["pool"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.verify_budget = Histogram(
            "dspark_router_verify_budget_tokens",
            "Draft tokens each drafting request may verify in a batched forward (Algorithm 1)",
            ["pool"],
            buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16),
            registry=r,
        )
        self.queue_wait = Histogram(
            "dspark_router_queue_wait_seconds",
            "Time before decoding started: the pool's queue and the wait for a place in its batch",
            ["pool"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("dspark_router_queue_depth", "Requests queued or running", ["pool"], registry=r)
        self.cache_bytes = Gauge(
            "dspark_router_cache_bytes",
            "Bytes a pool's caches hold in this process: kept prompt prefixes, earlier answers to draft from",
            ["pool", "cache"],
            registry=r,
        )
        self.overflows = Counter(
            "dspark_router_overflows", "Requests spilled from a full pool", ["from_pool", "to_pool"], registry=r
        )
        self.fallbacks = Counter(
            "dspark_router_fallbacks", "Requests retried on another pool", ["from_pool", "to_pool"], registry=r
        )
        self.errors = Counter("dspark_router_errors", "Requests that failed", ["pool", "type"], registry=r)
        self.shadow_runs = Counter(
            "dspark_router_shadow_runs",
            "Answered requests replayed on the other pool to measure speedup: measured, failed or skipped (full)",
            ["pool", "outcome"],
            registry=r,
        )
        self.speedup = Histogram(
            "dspark_router_measured_speedup",
            "DSpark over standard time per output token, measured by shadow runs",
            buckets=(0.5, 0.75, 1.0, 1.15, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0),
            registry=r,
        )

    def watch(self, pools: dict[str, Pool]) -> None:
        """Queue depth is read from the pools at scrape time, so it is never stale; pools that batch report
        every forward pass."""
        for name, pool in pools.items():
            self.queue_depth.labels(name).set_function(lambda pool=pool: pool.depth)
            for cache in CACHES:
                self.cache_bytes.labels(name, cache).set_function(
                    lambda pool=pool, cache=cache: pool.cache_bytes().get(cache, 0)
                )
            pool.observe(lambda record, name=name: self.stepped(name, record))

    def stepped(self, pool: str, record: StepRecord) -> None:
        self.batch_rows.labels(pool).observe(record.rows)
        self.forward_tokens.labels(pool).observe(record.tokens)
        for budget in record.budgets:
            self.verify_budget.labels(pool).observe(budget)

    def decided(self, decision: Decision) -> None:
        self.decisions.labels(decision.pool, decision.rule).inc()
        if decision.score is not None:
            self.score.observe(decision.score)
        if decision.explored:
            self.explored.labels(decision.pool).inc()

    def finished(self, decision: Decision, measured: Measured) -> None:
        pool = decision.pool
        self.latency.labels(pool).observe(measured.latency_s)
        self.ttft.labels(pool).observe(measured.ttft_s)
        self.tokens_per_s.labels(pool).observe(measured.tokens_per_s)
        self.queue_wait.labels(pool).observe(measured.queue_s)
        if measured.mean_accepted_tokens is not None:
            self.accepted.labels(pool).observe(measured.mean_accepted_tokens)

    def failed(self, pool: str, error: BaseException) -> None:
        self.errors.labels(pool, getattr(error, "error_type", type(error).__name__)).inc()

    def text(self) -> str:
        return generate_latest(self.registry).decode()
