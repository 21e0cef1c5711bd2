"""``transformers serve --continuous-batching`` on a free loopback port: the remote engine of the tests and the
contender of ``bench batching``, started one way for both."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks.local_redis import free_port

KV_TOKENS = 16_384
"""The engine's paged KV cache, in tokens. Left to itself it sizes the cache to 80-90% of free memory and zeroes
it before it answers: some 18 GB on a 24 GB machine, which took 55 s on one thread of an Intel Xeon (the test of
the remote engine spent 67 s in its setup); capped, it starts in 9 s. 16,384 tokens hold bench batching's 16
concurrent requests (a prompt and 64 new tokens each) several times over."""
PAGE_TOKENS = 256
"""transformers' default page of its paged cache, which ``--cb-num-blocks`` counts in."""


@contextmanager
def transformers_serve(
    model: Path, threads: int, start_timeout_s: float = 180.0
) -> Iterator[tuple[subprocess.Popen, str]]:
    """(process, api_base) once the engine answers ``/health`` and has served one request; the process is killed
    afterwards (a caller may kill it sooner). It runs offline, with ``threads`` OpenMP threads and a KV cache of
    ``KV_TOKENS``.

    The engine loads the model on its first request, not at start: on two busy cores that took longer than a
    client's timeout, so the first request is made here, within ``start_timeout_s``."""
    binary = Path(sys.executable).with_name("transformers")
    if not binary.exists():
        raise RuntimeError(f"transformers' console script is missing beside {sys.executable}")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    blocks = str(KV_TOKENS // PAGE_TOKENS)
    command = [str(binary), "serve", "--continuous-batching", "--cb-num-blocks", blocks, "--host", "127.0.0.1"]
    command += ["--port", str(port), str(model)]
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not _healthy(base):
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"transformers serve did not start: {log.read()[-2000:]}")
                time.sleep(0.2)
            _load(base, model, deadline - time.monotonic())
            yield process, f"{base}/v1"
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


def _load(base: str, model: Path, timeout_s: float) -> None:
    body = {"model": str(model), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=max(timeout_s, 1.0))
    if response.status_code != 200:
        raise RuntimeError(f"transformers serve could not load {model}: {response.text[:500]}")


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
