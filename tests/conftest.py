"""Shared fixtures: tiny models built on the spot (no downloads) and a Redis server of the tests' own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from backends.default_model import DEFAULT_DRAFTERS
from backends.modelfactory import build_model, save_pretrained, stdlib_texts, train_tokenizer
from backends.scheduling import PROFILE_FILE
from benchmarks.local_redis import LocalRedis

ARCHITECTURES = ("llama", "gpt2")

# Tiny models gain nothing from threads, and one thread keeps timings and float reductions steady.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def shipped_cost_curves():
    """The default model's stored cost curves as the checkout holds them, put back after the session: a test that
    loads it profiles this machine at the tests' one thread, a curve no user runs."""
    path = DEFAULT_DRAFTERS / PROFILE_FILE
    shipped = path.read_bytes()
    yield
    path.write_bytes(shipped)


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


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """REDIS_URL when set; else a private redis-server on a free port, stopped after the session."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    server = LocalRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
def private_redis(tmp_path_factory):
    """A redis-server a test may stop and restart, never a shared one."""
    server = LocalRedis(tmp_path_factory.mktemp("redis-private"))
    server.start()
    yield server
    server.stop()
