"""The client mix of ``bench soak``: what agents send a gateway over an hour, each request with an id and an
:class:`Outcome` that says whether its answer arrived whole, once.

Kinds: ``plain`` and ``stream`` completions through the openai SDK, ``abandon`` (a stream dropped after its
second chunk), ``tools`` (a forced tool call), ``json_schema`` (structured output) and ``bad`` (bodies of the kind
the gateway's fuzz test sends: wrong types, values out of range, not JSON at all, posted raw with httpx). Every
good request is greedy and names its pool, so its answer is known in advance: :func:`references` asks each one
once, before any load, and a stream is *duplicated* when its deltas, concatenated, are not that answer (or, cut
short by an error or by the client, not a prefix of it). A request is *lost* when it got neither an answer nor a
typed error: a transport failure, a stream that stopped without ``finish_reason``, no outcome at all.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai

KINDS = {"plain": 3, "stream": 3, "abandon": 1, "tools": 1, "json_schema": 1, "bad": 1}
"""Each kind's weight in the mix."""
POOLS = ("dspark", "standard", "remote")
PROMPTS = (
    "Complete the function:\ndef add(a, b):\n    ",
    "Reply with the capital of France.",
    "Write a haiku about queues.",
    "List three prime numbers.",
)
MAX_TOKENS = 12
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer"],
}
BAD_JSON = (
    {"model": "dspark-router/auto", "messages": "hello", "max_tokens": 3},
    {"model": "dspark-router/auto", "messages": [{"role": "wizard", "content": "hi"}]},
    {"model": "dspark-router/auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5},
    {"model": "dspark-router/auto", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
    {"model": "dspark-router/auto", "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5},
    {"model": "dspark-router/nowhere", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "dspark-router/auto", "messages": [{"role": "user", "content": "hi"}], "tools": [{"x": None}]},
    {"model": "dspark-router/auto", "messages": [{"role": "user", "content": "hi"}], "n": [1, {"a": 2}]},
    {"messages": [{"role": "user", "content": {"nested": [None, 2**70]}}]},
    {"model": "dspark-router/auto", "messages": [], "stop": ["a", "b", "c", "d", "e", "f"]},
)
BAD_BODIES: tuple[bytes, ...] = (*(json.dumps(body).encode() for body in BAD_JSON), b"{not json", b"")
"""Bodies like the fuzz test's: a field of the wrong type, out of range, unknown pool or none, not JSON."""


@dataclass(frozen=True)
class Ask:
    """One request of the mix: its id, kind, the pool it names and its prompt."""

    id: str
    kind: str
    pool: str
    prompt: int

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": f"dspark-router/{self.pool}",
            "messages": [{"role": "user", "content": PROMPTS[self.prompt]}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "seed": 7,
        }
        if self.kind == "tools":
            body.update(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
        elif self.kind == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
        return body

    @property
    def answer_key(self) -> tuple[str, int]:
        """Which reference answer this request must match: streams and plain calls share the plain one."""
        return ("plain" if self.kind in ("plain", "stream", "abandon") else self.kind, self.prompt)


@dataclass
class Outcome:
    """What became of one request. ``status``: the HTTP status, or ``stream:<error type>`` for an error event
    after a stream's first chunk, or ``lost:<why>``; ``latency_s`` is to the whole answer (None when there was
    none); ``served`` is the pool the gateway says answered."""

    id: str
    kind: str
    started_s: float
    status: str
    latency_s: float | None = None
    served: str | None = None
    text: str | None = None
    complete: bool = False
    duplicated: bool = False

    @property
    def lost(self) -> bool:
        return self.status.startswith("lost")

    @property
    def server_error(self) -> bool:
        """A 5xx other than the typed 503 of an unreachable pool: what a soak must never see."""
        if self.status.startswith("stream:"):
            return self.status != "stream:service_unavailable"
        return self.status.isdigit() and int(self.status) >= 500 and self.status != "503"


def mix(seed: int) -> Iterator[Ask]:
    """An endless, seeded sequence of :class:`Ask`, kinds drawn by :data:`KINDS`' weights."""
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    i = 0
    while True:
        kind = rng.choices(kinds, weights)[0]
        yield Ask(f"soak-{i}", kind, POOLS[i % len(POOLS)], rng.randrange(len(PROMPTS)))
        i += 1


def _answer_text(completion: Any) -> str:
    message = completion.choices[0].message
    if message.tool_calls:
        return json.dumps([[c.function.name, c.function.arguments] for c in message.tool_calls])
    return message.content or ""


class Clients:
    """The SDK and raw clients of one soak, sharing a connection pool, and the reference answers."""

    def __init__(self, base: str, timeout_s: float = 120.0) -> None:
        self.http = httpx.AsyncClient(base_url=base, timeout=timeout_s, limits=httpx.Limits(max_connections=256))
        self.sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="soak", max_retries=0, http_client=self.http)
        self.references: dict[tuple[str, str, int], str] = {}
        self.clock = time.perf_counter()

    async def references_for_all(self) -> None:
        """Each pool's answer to each good body, asked one at a time before any load or fault."""
        for pool in POOLS:
            for prompt in range(len(PROMPTS)):
                for kind in ("plain", "tools", "json_schema"):
                    outcome = await self.send(Ask(f"ref-{pool}-{kind}-{prompt}", kind, pool, prompt))
                    if outcome.status != "200":
                        raise RuntimeError(f"the reference {kind} on {pool} failed: {outcome.status}")
                    self.references[(pool, kind, prompt)] = outcome.text or ""

    async def send(self, ask: Ask) -> Outcome:
        started = time.perf_counter()
        outcome = Outcome(ask.id, ask.kind, started - self.clock, "lost:no outcome")
        headers = {"x-request-id": ask.id}
        try:
            if ask.kind == "bad":
                await self._bad(ask, outcome, headers)
            elif ask.kind in ("stream", "abandon"):
                await self._stream(ask, outcome, headers)
            else:
                raw = await self.sdk.chat.completions.with_raw_response.create(**ask.body(), extra_headers=headers)
                outcome.status, outcome.served = "200", raw.headers.get("x-dspark-pool")
                outcome.text, outcome.complete = _answer_text(raw.parse()), True
        except openai.APIStatusError as exc:
            outcome.status = str(exc.status_code)
        except openai.APIError as exc:  # an error event in a stream whose status line said 200
            if isinstance(exc.body, dict) and exc.body.get("type"):
                outcome.status = f"stream:{exc.body['type']}"
            else:
                outcome.status = f"lost:{type(exc).__name__}"
        except httpx.HTTPError as exc:
            outcome.status = f"lost:{type(exc).__name__}"
        if outcome.complete:
            outcome.latency_s = time.perf_counter() - started
        self._check(ask, outcome)
        return outcome

    async def _bad(self, ask: Ask, outcome: Outcome, headers: dict[str, str]) -> None:
        body = BAD_BODIES[int(ask.id.rsplit("-", 1)[1]) % len(BAD_BODIES)]
        headers = {**headers, "content-type": "application/json"}
        response = await self.http.post("/v1/chat/completions", content=body, headers=headers)
        outcome.status, outcome.complete = str(response.status_code), True

    async def _stream(self, ask: Ask, outcome: Outcome, headers: dict[str, str]) -> None:
        deltas, finished = [], False
        body = {**ask.body(), "stream": True}
        async with self.sdk.chat.completions.with_streaming_response.create(**body, extra_headers=headers) as raw:
            outcome.status, outcome.served = "200", raw.headers.get("x-dspark-pool")
            try:
                async for chunk in await raw.parse():
                    if chunk.choices:
                        deltas.append(chunk.choices[0].delta.content or "")
                        finished = finished or chunk.choices[0].finish_reason is not None
                    if ask.kind == "abandon" and len(deltas) >= 2:
                        break
            finally:  # an error event ends the loop too: what came before it must still be a prefix
                outcome.text = "".join(deltas)
        outcome.complete = finished or ask.kind == "abandon"
        if not outcome.complete:
            outcome.status = "lost:stream ended without finish_reason"

    def _check(self, ask: Ask, outcome: Outcome) -> None:
        """Marks a stream whose text is not its reference answer (or, cut short, not a prefix of it)."""
        if ask.kind not in ("stream", "abandon") or outcome.text is None or not self.references:
            return
        kind, prompt = ask.answer_key
        expected = self.references.get((outcome.served or ask.pool, kind, prompt), "")
        whole = ask.kind == "stream" and outcome.status == "200"
        outcome.duplicated = outcome.text != expected if whole else not expected.startswith(outcome.text)

    async def close(self) -> None:
        await self.http.aclose()
