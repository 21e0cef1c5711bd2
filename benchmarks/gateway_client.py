"""The HTTP side of ``bench gateway``, in a process of its own, as an agent's client would be.

A client in the server's own interpreter would share its lock and add thread handoffs that no real client pays;
run as a file (``python benchmarks/gateway_client.py ...``) this imports nothing of the project either (importing
the ``benchmarks`` package loads torch). Two modes:

* ``calls PORT``: one keep-alive connection (the standard library's ``http.client``, the leanest Python client);
  each line on stdin is a JSON ``{"path", "body", "first_content"}``, answered by one line with the seconds the
  call took: the whole answer received and its JSON parsed, or with ``first_content`` the first SSE chunk that
  carries content;
* ``load URL BODY CLIENTS SECONDS``: that many concurrent keep-alive aiohttp clients posting ``BODY`` for that long
  after a one-second warm-up; prints one JSON object with requests per second and latencies.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import time
from typing import Any

WARMUP_S = 1.0


def _call(connection: http.client.HTTPConnection, path: str, body: dict[str, Any], first_content: bool) -> float:
    started = time.perf_counter()
    body = {**body, "stream": True} if first_content else body
    connection.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{path} answered {response.status}: {response.read()[:300]!r}")
    if not first_content:
        json.loads(response.read())
        return time.perf_counter() - started
    elapsed = None
    while line := response.readline():
        if elapsed is None and line.startswith(b"data: {") and b'"delta":{"content":' in line:
            elapsed = time.perf_counter() - started
    if elapsed is None:
        raise RuntimeError("the stream carried no content")
    return elapsed


def calls(port: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for line in sys.stdin:
        command = json.loads(line)
        print(_call(connection, command["path"], command["body"], command.get("first_content", False)), flush=True)


async def _client(session: Any, url: str, body: bytes, until: float, out: dict[str, Any]) -> None:
    headers = {"content-type": "application/json"}
    while (started := time.perf_counter()) < until:
        async with session.post(url, data=body, headers=headers) as response:
            await response.read()
            out["non_200"] += response.status != 200
        if started >= out["measure_from"]:
            out["latencies"].append(time.perf_counter() - started)


async def load(url: str, body: bytes, clients: int, seconds: float) -> dict[str, Any]:
    import aiohttp

    now = time.perf_counter()
    out: dict[str, Any] = {"non_200": 0, "latencies": [], "measure_from": now + WARMUP_S}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*(_client(session, url, body, now + WARMUP_S + seconds, out) for _ in range(clients)))
    latencies = sorted(out["latencies"])
    return {
        "clients": clients,
        "seconds": seconds,
        "requests": len(latencies),
        "requests_per_s": len(latencies) / seconds,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
        "non_200": out["non_200"],
    }


if __name__ == "__main__":
    if sys.argv[1] == "calls":
        calls(int(sys.argv[2]))
    else:
        url, body, clients, seconds = sys.argv[2], sys.argv[3].encode(), int(sys.argv[4]), float(sys.argv[5])
        print(json.dumps(asyncio.run(load(url, body, clients, seconds))))
