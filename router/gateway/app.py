"""The endpoints: OpenAI's chat and text completions, models, and the router's own route, metrics and probes.

Each endpoint reads the body as JSON and hands it to the :class:`~router.sdk.Router` unchanged: parsing, policy,
dispatch, spill and fallback are the SDK's, so an HTTP client gets exactly what an in-process caller gets, and
the gateway only adds what HTTP needs: keys and limits, the wire shapes, headers, and stopping the work when the
client goes away.

A stream's headers wait for its first chunk. By then the request is parsed, decided and admitted (a bad request
or full queues are still an ordinary 4xx), and the pool that will serve it is known, so ``x-dspark-pool`` is true
even after a fallback that happened before the first token.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from backends.errors import DSparkRouterError, InvalidRequestError
from router.decisions import Decision, RoutedChunk, RoutedResult
from router.errors import ModelNotFoundError
from router.gateway import docs, errors, shapes
from router.gateway.disconnect import ClientGone, unless_disconnected
from router.gateway.errors import ErrorBody, NotReadyError
from router.gateway.headers import decision_headers, request_id
from router.gateway.limits import ConcurrencyLimit, KeyGuard, SharedRates, read_body
from router.gateway.metrics import CLIENT_CLOSED, CountResponses, GatewayMetrics
from router.gateway.readiness import Readiness
from router.gateway.settings import GatewayConfig
from router.request import AUTO, MODEL_PREFIX, parse_body
from router.sdk import Router

ERROR_STATUSES = (400, 401, 404, 413, 429, 500, 502, 503, 504)
INPUTS = frozenset({"messages", "prompt"})


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "dspark-router"


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class ProbeStatus(BaseModel):
    ready: bool
    problem: str | None = None
    pools: dict[str, dict[str, int]]
    unavailable: dict[str, str] = Field(
        default_factory=dict,
        description="pools that take no requests now (cooled down, Redis unreachable) and why; the gateway stays "
        "ready while any pool accepts, since the others' traffic can go to their fallbacks",
    )


def _json(model: BaseModel, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), media_type="application/json", headers=headers)


def _sse(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


def _wire_args(body: dict[str, Any], endpoint: shapes.Endpoint) -> bool:
    """Check (and take out) what only HTTP adds to the SDK's arguments; everything else is the SDK's to judge.

    Which endpoint takes which input, the ``stream`` flag (it picks the SDK call, so it must be a real boolean),
    and the request id, which belongs in a header. Returns whether to stream.
    """
    for name in INPUTS - {endpoint.takes}:
        if name in body:
            raise InvalidRequestError(f"{name} belongs to the other completions endpoint", param=name)
    if endpoint.takes not in body:
        raise InvalidRequestError(f"{endpoint.takes} is required", param=endpoint.takes)
    if "request_id" in body:
        raise InvalidRequestError("unknown argument 'request_id'; send the x-request-id header", param="request_id")
    stream = body.pop("stream", None)
    if stream not in (None, True, False):
        raise InvalidRequestError("stream must be true or false", param="stream")
    if body.get("stream_options") is not None and stream is not True:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    return bool(stream)


class Gateway:
    """The state behind one app: the router it serves, its limits, its readiness, its metrics."""

    def __init__(self, router: Router, settings: GatewayConfig) -> None:
        self.router = router
        self.settings = settings
        shared = SharedRates(router.config.redis_url) if router.config.redis_url else None
        self.keys = KeyGuard(settings.keys(), shared)
        self.limit = ConcurrencyLimit(settings.max_concurrency, settings.max_waiting)
        self.readiness = Readiness()
        self.metrics = GatewayMetrics(lambda: self.limit.running, lambda: self.limit.waiting)
        self.started = int(time.time())

    async def body(self, request: Request) -> tuple[str | None, dict[str, Any]]:
        """Key and rate, then the body: an unknown caller learns nothing about the server, not even its limits. With
        the body, the caller's principal (its key's, where keys are configured), which no body field can name."""
        key = self.keys.admit(request)
        return (key.principal if key else None), parse_body(await read_body(request, self.settings.max_body_bytes))

    def check_ready(self) -> None:
        problem = self.readiness.problem()
        if problem is not None:
            raise NotReadyError(f"not ready: {problem}")

    async def complete(self, request: Request, endpoint: shapes.Endpoint) -> Response:
        rid = request_id(request)
        principal, body = await self.body(request)
        self.check_ready()
        stream = _wire_args(body, endpoint)
        try:
            if stream:
                return await self._stream(request, rid, principal, body, endpoint)
            result = await unless_disconnected(request.receive, self._whole(rid, principal, body))
        except ClientGone:
            self.metrics.disconnects.inc()
            return Response(status_code=int(CLIENT_CLOSED))
        return _json(endpoint.whole(result, int(time.time())), decision_headers(result.decision, rid))

    async def _whole(self, rid: str, principal: str | None, body: dict[str, Any]) -> RoutedResult:
        async with self.limit.slot():
            return await self.router.acomplete(request_id=rid, principal=principal, **body)

    async def _stream(
        self, request: Request, rid: str, principal: str | None, body: dict[str, Any], endpoint: shapes.Endpoint
    ) -> Response:
        chunks = self.router.astream(request_id=rid, principal=principal, **body)
        try:
            first: RoutedChunk = await unless_disconnected(request.receive, self._first(chunks))
        except BaseException:
            await chunks.aclose()
            raise
        out = endpoint.chunks(rid, int(time.time()), first.decision, body)
        return EventStream(self, first, chunks, out, decision_headers(first.decision, rid))

    async def _first(self, chunks: AsyncIterator[RoutedChunk]) -> RoutedChunk:
        """The stream's first chunk, holding a concurrency slot from here until the stream ends."""
        await self.limit.acquire()
        try:
            return await anext(chunks)
        except BaseException:
            self.limit.release()
            raise

    async def route(self, request: Request) -> Response:
        rid = request_id(request)
        decision = self.router.route(**(await self.body(request))[1])
        return _json(decision, decision_headers(decision, rid))

    def models(self, request: Request) -> ModelList:
        self.keys.admit(request)
        names = [AUTO, *self.router.pools]
        return ModelList(data=[ModelCard(id=f"{MODEL_PREFIX}{name}", created=self.started) for name in names])

    def probe(self) -> ProbeStatus:
        pools = {name: {"depth": p.depth, "capacity": p.capacity} for name, p in self.router.pools.items()}
        unavailable = self.router.unavailable()
        problem = self.readiness.problem()
        if problem is None and len(unavailable) == len(pools):
            problem = "no pool takes requests: " + "; ".join(unavailable.values())
        return ProbeStatus(ready=problem is None, problem=problem, pools=pools, unavailable=unavailable)


class EventStream(StreamingResponse):
    """Server-sent events from a routed stream, watched for disconnects the whole time.

    The concurrency slot is held until the stream ends, however it ends. A disconnect cancels the pump, and closing
    the router's stream then cancels its flight; an error after the first chunk is sent as an error event, since
    the status line is long gone, and the stream ends without ``[DONE]``, as OpenAI's does.
    """

    def __init__(
        self,
        gateway: Gateway,
        first: RoutedChunk,
        rest: AsyncIterator[RoutedChunk],
        out: shapes.Chunks,
        headers: dict[str, str],
    ) -> None:
        self.gateway, self.first, self.rest, self.out = gateway, first, rest, out
        self.events = self._events()
        super().__init__(self.events, headers={**headers, "cache-control": "no-cache"}, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(receive, self._pump(send))
        except ClientGone:
            self.gateway.metrics.disconnects.inc()
        finally:
            await self.events.aclose()
            await self.rest.aclose()
            self.gateway.limit.release()

    async def _pump(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # uvicorn's send raises once the connection is gone
            raise ClientGone("the client disconnected") from None

    async def _events(self) -> AsyncIterator[bytes]:
        for piece in self.out.opening():
            yield _sse(piece)
        chunk = self.first
        try:
            while chunk.result is None:
                for piece in self.out.delta(chunk.delta):
                    yield _sse(piece)
                chunk = await anext(self.rest)
        except DSparkRouterError as exc:
            yield b"data: " + json.dumps(exc.to_openai()).encode() + b"\n\n"
            return
        for piece in self.out.closing(chunk.delta, chunk.result):
            yield _sse(piece)
        yield b"data: [DONE]\n\n"


def create_app(router: Router, settings: GatewayConfig | None = None, *, warmup: bool = True) -> FastAPI:
    """The gateway over ``router`` (which the caller keeps and closes). ``warmup`` loads the models in the
    background at start-up; without it the gateway is ready at once, for a router its owner has warmed."""
    gateway = Gateway(router, settings or router.config.gateway)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if warmup:
            gateway.readiness.start(router)
        else:
            gateway.readiness.mark_ready()
        yield
        gateway.readiness.closing = True

    app = FastAPI(
        title="dspark-router",
        summary="An OpenAI-compatible gateway over the dspark-router SDK",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    errors.install(app, gateway.settings.retry_after_s)
    app.add_middleware(CountResponses, metrics=gateway.metrics)
    failures = {status: {"model": ErrorBody, "description": "an OpenAI-shaped error"} for status in ERROR_STATUSES}

    def completion_responses(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, Any]:
        stream = {"text/event-stream": {"schema": {"type": "string", "description": f"`data: <{chunk.__name__}>`"}}}
        return {200: {"model": model, "content": stream, "description": "the completion, or its stream"}, **failures}

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=completion_responses(shapes.ChatCompletion, shapes.ChatCompletionChunk),
        openapi_extra=docs.body("ChatCompletionRequest"),
    )
    async def chat_completions(request: Request) -> Response:
        return await gateway.complete(request, shapes.CHAT)

    @app.post(
        "/v1/completions",
        response_model=None,
        responses=completion_responses(shapes.TextCompletion, shapes.TextCompletionChunk),
        openapi_extra=docs.body("CompletionRequest"),
    )
    async def completions(request: Request) -> Response:
        return await gateway.complete(request, shapes.TEXT)

    @app.post(
        "/v1/route",
        response_model=None,
        responses={200: {"model": Decision, "description": "where the request would go, and why"}, **failures},
        openapi_extra=docs.body("RouteRequest"),
    )
    async def route(request: Request) -> Response:
        return await gateway.route(request)

    @app.get("/v1/models", response_model=ModelList, responses=failures)
    async def models(request: Request) -> ModelList:
        return gateway.models(request)

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=failures)
    async def model(request: Request) -> ModelCard:
        wanted = request.path_params["model_id"]
        for card in gateway.models(request).data:
            if wanted in (card.id, card.id.removeprefix(MODEL_PREFIX)):
                return card
        raise ModelNotFoundError(f"no model {wanted!r}; GET /v1/models lists them", param="model")

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        return Response(router.metrics_text() + gateway.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", response_model=ProbeStatus, responses={503: {"model": ProbeStatus}})
    async def readyz() -> Response:
        status = gateway.probe()
        return JSONResponse(status.model_dump(), status_code=200 if status.ready else 503)

    _document_bodies(app)
    return app


def _document_bodies(app: FastAPI) -> None:
    """Add the request schemas of :mod:`docs` to the generated OpenAPI document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            bodies, components = docs.request_schemas()
            schema.setdefault("components", {}).setdefault("schemas", {}).update({**components, **bodies})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
