"""``bench engine``'s noisy host: the engine's decoding speed in a process that ran other work first, against a clean
process, on each way it is served; how much CPU it takes idle; how soon the console command answers.

The SDK lives inside agent frameworks, whose processes run torch, numpy or llama.cpp work of their own. When the
kernels ran on torch's OpenMP threads, one torch op in the caller's thread slowed every later step about 3x (182
against 62 tokens/s on a 2-core Xeon), for the rest of the process. The engine now runs on threads it owns
(``backends/packed/compute_pool.h``); this measures that nothing the host does reaches it.

Each measurement is a fresh process (``python -m benchmarks.engine_host PATH WORK``) that serves the default model
one way (``sdk``: ``Router.complete`` in-process; ``gateway``: the REST gateway on uvicorn in a thread, asked over
loopback HTTP; ``redis``: a Redis worker of a ``transport: redis`` pool in a thread, its jobs submitted by a router
in the same process), decodes one warm-up request, runs WORK on its main thread (``clean``: nothing; ``torch``: a
512x512 matmul; ``numpy``: the same in numpy; ``llama_cpp``: llama.cpp generating 32 tokens from the same GGUF),
then times :data:`REQUESTS` greedy requests of :data:`MAX_TOKENS` tokens on the standard pool. Processes run one
after another, each combination :data:`REPEATS` times, interleaved; a combination's figure is the median.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PATHS = ("sdk", "gateway", "redis")
WORK = ("clean", "torch", "numpy", "llama_cpp")
REQUESTS = 3
MAX_TOKENS = 96
REPEATS = 3
IDLE_S = 10.0
TARGETS = {"after_work_ratio": 0.95, "idle_core_share": 0.01, "help_s": 0.5, "route_s": 1.5}
MESSAGES = [
    {"role": "user", "content": "Write a Python function that sorts a list of dicts by a key, with a docstring."}
]
ROUTE_MESSAGE = "Extract the city as JSON: Ana moved to Porto last spring."


def _host_work(name: str) -> None:
    """WORK on the calling thread, as the host's own code would run it."""
    if name == "torch":
        import torch

        a = torch.randn(512, 512)
        (a @ a).sum()
    elif name == "numpy":
        import numpy as np

        a = np.random.default_rng(0).random((512, 512))
        (a @ a).sum()
    elif name == "llama_cpp":
        from llama_cpp import Llama

        from backends.convert import packaged_gguf

        llm = Llama(model_path=str(packaged_gguf()), n_ctx=256, verbose=False)
        llm("The capital of France is", max_tokens=32, temperature=0.0)


def _standard_body() -> dict[str, Any]:
    return {"model": "dspark-router/standard", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}


@contextmanager
def _serving_way(path: str, redis_url: str | None) -> Iterator[Callable[[], int]]:
    """A function that decodes one request the way ``path`` serves it and returns its completion tokens."""
    from router.sdk import Router

    if path == "sdk":
        with Router.from_config() as router:
            yield lambda: router.complete(**_standard_body()).usage.completion_tokens
        return
    if path == "gateway":
        import http.client

        from benchmarks.gateway import serving
        from router.gateway.app import create_app
        from router.gateway.settings import GatewayConfig

        with Router.from_config() as router:
            router.warmup()
            app = create_app(router, GatewayConfig(api_keys_env=None), warmup=False)
            with serving(app) as port:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

                def over_http() -> int:
                    connection.request(
                        "POST",
                        "/v1/chat/completions",
                        json.dumps(_standard_body()),
                        {"Content-Type": "application/json"},
                    )
                    answer = json.loads(connection.getresponse().read())
                    return answer["usage"]["completion_tokens"]

                yield over_http
        return
    import yaml

    from router.config import load_config
    from router.worker import Worker

    with tempfile.TemporaryDirectory() as folder:
        config_path = Path(folder) / "router.yaml"
        prefix = f"engine-host-{os.getpid()}"
        pool = {"backend": "autoregressive", "model": "default", "transport": "redis", "redis_url": redis_url}
        pool["redis"] = {"prefix": prefix}
        config_path.write_text(yaml.safe_dump({"pools": {"standard": pool}, "policy": {"classifier": None}}))
        config = load_config(config_path)
        worker = Worker("standard", config.pools["standard"], concurrency=4)
        serving = threading.Thread(target=worker.serve, name="worker", daemon=True)
        serving.start()
        with Router(config) as router:
            deadline = time.monotonic() + 120
            while not router.pools["standard"].live_workers():
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis worker did not come up in 120 s")
                time.sleep(0.1)
            yield lambda: router.complete(**_standard_body()).usage.completion_tokens
        worker.drain()
        serving.join(timeout=60)


def child(path: str, work: str, redis_url: str | None) -> dict[str, Any]:
    """One fresh process's measurement (see the module's docstring); the SDK's clean process also measures the CPU
    the whole process takes over :data:`IDLE_S` seconds with no request running."""
    with _serving_way(path, redis_url) as decode:
        decode()
        _host_work(work)
        speeds = []
        for _ in range(REQUESTS):
            started = time.perf_counter()
            tokens = decode()
            speeds.append(tokens / (time.perf_counter() - started))
        report: dict[str, Any] = {"tokens_per_s": statistics.median(speeds), "runs": speeds}
        if path == "sdk" and work == "clean":
            time.sleep(1.0)  # the last request's threads settle
            before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
            time.sleep(IDLE_S)
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            report["idle_core_share"] = cpu / (time.monotonic() - started)
    return report


def _run_child(path: str, work: str, redis_url: str | None) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.engine_host", path, work, redis_url or ""]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{path}/{work} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _command_seconds(argv: list[str], repeats: int = 5) -> float:
    """Median wall seconds of the console command ``argv`` (models not loaded)."""
    binary = Path(sys.executable).with_name("dspark-router")
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([str(binary), *argv], capture_output=True, check=True, timeout=120)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def available_work() -> list[str]:
    """The kinds of host work this machine can run (llama.cpp is in the ``bench`` extra)."""
    import importlib.util

    return [w for w in WORK if w != "llama_cpp" or importlib.util.find_spec("llama_cpp") is not None]


def steps() -> int:
    """How many times :func:`measure` calls its ``tick``."""
    return REPEATS * len(PATHS) * len(available_work()) + 1


def measure(tick: Callable[[str], None]) -> dict[str, Any]:
    """Every path after every kind of host work, against its clean process; idle CPU; the console command."""
    from benchmarks.local_redis import local_redis

    work = available_work()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {p: {w: [] for w in work} for p in PATHS}
    with local_redis() as redis_url:
        for _ in range(REPEATS):
            for path in PATHS:
                for name in work:
                    tick(f"{path} after {name}")
                    runs[path][name].append(_run_child(path, name, redis_url))
    speeds = {p: {w: statistics.median(r["tokens_per_s"] for r in runs[p][w]) for w in work} for p in PATHS}
    ratios = {p: {w: speeds[p][w] / speeds[p]["clean"] for w in work if w != "clean"} for p in PATHS}
    idle = statistics.median(r["idle_core_share"] for r in runs["sdk"]["clean"])
    tick("console command")
    help_s, route_s = _command_seconds(["--help"]), _command_seconds(["route", ROUTE_MESSAGE])
    worst = min(min(r.values()) for r in ratios.values())
    return {
        "requests": REQUESTS,
        "max_tokens": MAX_TOKENS,
        "repeats": REPEATS,
        "tokens_per_s": speeds,
        "after_work_ratio": ratios,
        "idle_core_share": idle,
        "help_s": help_s,
        "route_s": route_s,
        "skipped": [w for w in WORK if w not in work],
        "targets": TARGETS,
        "met": {
            "after_work_ratio": worst >= TARGETS["after_work_ratio"],
            "idle_core_share": idle < TARGETS["idle_core_share"],
            "help_s": help_s < TARGETS["help_s"],
            "route_s": route_s < TARGETS["route_s"],
        },
    }


def format_lines(host: dict[str, Any]) -> list[str]:
    """The noisy-host table and its one-line neighbours, at most 80 columns wide."""
    work = list(next(iter(host["tokens_per_s"].values())))
    lines = ["noisy host: tok/s of the standard pool, clean and after host work (ratio)"]
    lines.append(f"{'path':<8}" + "".join(f"{w:>17}" for w in work))
    for path, speeds in host["tokens_per_s"].items():
        cells = [f"{speeds['clean']:.0f}"] + [
            f"{speeds[w]:.0f} ({host['after_work_ratio'][path][w]:.2f})" for w in work if w != "clean"
        ]
        lines.append(f"{path:<8}" + "".join(f"{c:>17}" for c in cells))
    lines.append(
        f"idle: {100 * host['idle_core_share']:.2f}% of a core; --help {host['help_s']:.2f} s, "
        f"route {host['route_s']:.2f} s"
    )
    return lines


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2], sys.argv[3] or None)))
