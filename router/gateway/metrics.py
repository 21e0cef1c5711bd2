"""The gateway's own Prometheus metrics, beside the router's: responses by endpoint and status, the concurrency
slots in use and waited for, and requests whose client went away before the answer.

They live in a registry of the app's own (as the router's live in the router's), so two gateways on one router, as
in the tests, never count into each other. Responses are counted by an ASGI wrapper around the whole app, so
refusals that never reach an endpoint (401, 413, 404) are counted like the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# No status was sent: the client disconnected first (nginx's code for it).
CLIENT_CLOSED = "499"


class GatewayMetrics:
    def __init__(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.responses = Counter(
            "dspark_router_gateway_responses", "HTTP responses", ["endpoint", "status"], registry=r
        )
        self.disconnects = Counter(
            "dspark_router_gateway_disconnects", "Completions cancelled because the client went away", registry=r
        )
        Gauge("dspark_router_gateway_running", "Completions holding a concurrency slot", registry=r).set_function(
            running
        )
        Gauge("dspark_router_gateway_waiting", "Completions waiting for a concurrency slot", registry=r).set_function(
            waiting
        )

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class CountResponses:
    """ASGI middleware: one count per HTTP request, labelled by its route's template (``other`` for no route)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_CLOSED

        async def counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting)
        except BaseException:
            status = "500" if status == CLIENT_CLOSED else status
            raise
        finally:
            self.metrics.responses.labels(getattr(scope.get("route"), "path", "other"), status).inc()
