"""``dspark-router bench gateway``: what the REST gateway costs over calling the same ``Router`` in-process.

One router, warmed up, serves both sides: the gateway runs on uvicorn in a thread of this process, so an HTTP
call and an in-process call reach the very same pools. Measured side by side in one run:

* **added latency** of a short greedy completion and of ``/v1/route`` (the decision alone): each call is made
  in-process and over HTTP alternately (which goes first alternates too), after a warm-up. The HTTP calls come
  from a client process of their own (``benchmarks/gateway_client.py``), over one keep-alive connection of the
  standard library's ``http.client``, so that what is measured is the gateway and not a client library (``httpx``,
  under the openai SDK, spends about another millisecond per call of its own); each includes sending the JSON and
  parsing the answer. Added = the gateway's percentile minus the in-process one;
* **time to first token** over SSE (the first content chunk) against the in-process stream's first delta;
* **requests per second of /v1/route** under 64 concurrent keep-alive clients (aiohttp) on loopback, from that
  client process too, so that load and server each have a core of the two.

Targets: added p50 under 2 ms, p99 under 10 ms; /v1/route at least 500 requests per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.output import write_json

if TYPE_CHECKING:
    from router.sdk import Router

CLIENT = Path(__file__).with_name("gateway_client.py")
TARGETS = {"added_p50_ms": 2.0, "added_p99_ms": 10.0, "route_requests_per_s": 500.0}
BODY = {
    "model": "dspark-router/auto",
    "messages": [{"role": "user", "content": "Complete the function:\ndef add(a, b):\n    "}],
    "max_tokens": 8,
    "temperature": 0,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="router YAML (default: the embedded two-pool config on the default model)")
    p.add_argument("--requests", type=int, default=300, help="timed calls per side and measurement")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens of the short greedy completion")
    p.add_argument("--clients", type=int, default=64, help="concurrent keep-alive clients for /v1/route")
    p.add_argument("--seconds", type=float, default=5.0, help="how long the /v1/route load runs")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", type=Path, help="write the report here")


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ms = sorted(1000 * s for s in seconds)
    return {"p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))]}


def _side_by_side(
    in_process: Callable[[], float], gateway: Callable[[], float], calls: int, tick: Callable[[], None]
) -> dict[str, Any]:
    """Both sides ``calls`` times, interleaved and alternating which goes first, after a tenth as many untimed."""
    for _ in range(max(5, calls // 10)):
        in_process(), gateway()
    here, there = [], []
    for i in range(calls):
        if i % 2:
            there.append(gateway())
            here.append(in_process())
        else:
            here.append(in_process())
            there.append(gateway())
        tick()
    ours, theirs = _percentiles(here), _percentiles(there)
    return {
        "in_process": ours,
        "gateway": theirs,
        "added_p50_ms": theirs["p50_ms"] - ours["p50_ms"],
        "added_p99_ms": theirs["p99_ms"] - ours["p99_ms"],
        "calls": calls,
    }


def _timed(call: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        started = time.perf_counter()
        call()
        return time.perf_counter() - started

    return run


def _first_delta_in_process(router: Router, body: dict[str, Any]) -> Callable[[], float]:
    def run() -> float:
        started, elapsed = time.perf_counter(), None
        for chunk in router.stream(**body):  # read to the end, as the SSE client does, so the pool is idle after
            if elapsed is None and chunk.delta:
                elapsed = time.perf_counter() - started
        if elapsed is None:
            raise RuntimeError("the stream carried no text")
        return elapsed

    return run


class Client:
    """The HTTP client process (``gateway_client.py calls``): one call per request, timed over there."""

    def __init__(self, port: int) -> None:
        self._process = subprocess.Popen(
            [sys.executable, str(CLIENT), "calls", str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def timed(self, path: str, body: dict[str, Any], *, first_content: bool = False) -> Callable[[], float]:
        line = json.dumps({"path": path, "body": body, "first_content": first_content}) + "\n"

        def run() -> float:
            self._process.stdin.write(line)
            self._process.stdin.flush()
            answer = self._process.stdout.readline()
            if not answer:
                raise RuntimeError("the HTTP client process died (its error is above)")
            return float(answer)

        return run

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=30)


def _route_load(url: str, body: dict[str, Any], clients: int, seconds: float) -> dict[str, Any]:
    command = [sys.executable, str(CLIENT), "load", url, json.dumps(body), str(clients), str(seconds)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=seconds + 120)
    return json.loads(done.stdout)


@contextmanager
def serving(app: Any) -> Iterator[int]:
    """uvicorn on a loopback port the OS picks, in a thread of this process; yields the port."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="bench-gateway", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from backends.progress import JobProgress
    from router.gateway.app import create_app
    from router.gateway.settings import GatewayConfig
    from router.sdk import Router

    body = {**BODY, "max_tokens": args.max_tokens}
    route_body = {k: v for k, v in body.items() if k != "max_tokens"}
    report: dict[str, Any] = {"request": body, "cpus": os.cpu_count(), "targets": TARGETS}
    with Router.from_config(args.config) as router:
        router.warmup()
        settings = GatewayConfig(api_keys_env=None, max_concurrency=max(64, args.clients))
        with serving(create_app(router, settings, warmup=False)) as port, JobProgress(log_every=100) as progress:
            client = Client(port)
            task = progress.add_job("bench gateway", total=3 * args.requests + 1)

            def tick(status: str) -> Callable[[], None]:
                return lambda: progress.step(task, status=status)

            report["completion"] = _side_by_side(
                _timed(lambda: router.complete(**body)),
                client.timed("/v1/chat/completions", body),
                args.requests,
                tick("completion"),
            )
            report["route"] = _side_by_side(
                _timed(lambda: router.route(**route_body)),
                client.timed("/v1/route", route_body),
                args.requests,
                tick("route"),
            )
            report["ttft"] = _side_by_side(
                _first_delta_in_process(router, body),
                client.timed("/v1/chat/completions", body, first_content=True),
                args.requests,
                tick("time to first token"),
            )
            progress.update(task, status=f"/v1/route, {args.clients} clients")
            client.close()
            url = f"http://127.0.0.1:{port}/v1/route"
            report["route_throughput"] = _route_load(url, route_body, args.clients, args.seconds)
            progress.step(task, status="done")
    report["met"] = {
        "added_p50_ms": all(report[k]["added_p50_ms"] < TARGETS["added_p50_ms"] for k in ("completion", "route")),
        "added_p99_ms": all(report[k]["added_p99_ms"] < TARGETS["added_p99_ms"] for k in ("completion", "route")),
        "route_requests_per_s": report["route_throughput"]["requests_per_s"] >= TARGETS["route_requests_per_s"],
    }
    return report


def show(report: dict[str, Any]) -> None:
    """The numbers in a table that fits 80 columns."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Gateway against the same Router in-process (ms)")
    for column in ("measurement", "in-process", "gateway", "added", "target"):
        table.add_column(column, justify="left" if column == "measurement" else "right")
    rows = [("completion", "short greedy completion"), ("route", "/v1/route decision"), ("ttft", "first token, SSE")]
    for key, label in rows:
        for level in ("p50", "p99"):
            part = report[key]
            target = f"< {TARGETS[f'added_{level}_ms']:g}" if key != "ttft" else ""
            table.add_row(
                f"{label} {level}",
                f"{part['in_process'][f'{level}_ms']:.2f}",
                f"{part['gateway'][f'{level}_ms']:.2f}",
                f"{part[f'added_{level}_ms']:+.2f}",
                target,
            )
    console = Console(width=80)
    console.print(table)
    load = report["route_throughput"]
    console.print(
        f"/v1/route with {load['clients']} keep-alive clients: {load['requests_per_s']:.0f} requests/s "
        f"(target >= {TARGETS['route_requests_per_s']:g}), p50 {load['p50_ms']:.1f} ms, p99 {load['p99_ms']:.1f} ms, "
        f"{load['non_200']} not 200"
    )
    missed = [name for name, met in report["met"].items() if not met]
    console.print("targets: all met" if not missed else f"targets missed: {', '.join(missed)}")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = run_benchmark(args)
    show(report)
    write_json(args.json, report)
    return 0
