"""The packed engine owns its threads: every forward runs on the engine's pool, whatever the host process did with
OpenMP before, gives the same bits as the kernels did on torch's OpenMP threads, and the console command loads
only what the subcommand it runs needs."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from backends.autoregressive import AutoregressiveBackend
from backends.default_model import DEFAULT_MODEL
from backends.loading import load_shared
from backends.packed.model import PackedLlama
from backends.packed.pool import compute_pool, default_threads
from backends.types import GenerationRequest

REPO = Path(__file__).resolve().parents[1]
VOCAB = 49152
BEFORE_THE_POOL = "a23ee49605c80cf41c0b6480bb490cd18a7335847c1304cb559a548c5900d4ca"
"""sha256 of every output of :func:`_two_forwards` as the kernels gave them on torch's OpenMP threads (commit
8718bcc, the last before the engine's own pool), the same on its AVX2 and AVX-512 builds."""


def _ids(n: int, stride: int) -> torch.Tensor:
    return torch.tensor([(stride * i + 13) % VOCAB for i in range(n)])


def _two_forwards(model: PackedLlama) -> str:
    """A prefill of two prompts (one of 300 tokens: three of attention's splits, combined) with every layer's
    states, then a ragged verifying step of 4 and 1 tokens; the sha256 of all their outputs."""
    prompts = [_ids(300, 7919), _ids(40, 104729)]
    caches = [model.new_cache(320), model.new_cache(64)]
    keys, values = [k for k, _ in caches], [v for _, v in caches]
    tokens = torch.cat(prompts)
    seq = torch.cat([torch.full((len(p),), i) for i, p in enumerate(prompts)])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    prefill = model.engine.forward(tokens, seq, positions, keys, values, True, torch.tensor([299, 339]))
    step = model.engine.forward(
        _ids(5, 31337), torch.tensor([0, 0, 0, 0, 1]), torch.tensor([300, 301, 302, 303, 40]), keys, values, True, None
    )
    digest = hashlib.sha256()
    for tensor in (*prefill, *step):
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_forward_is_bit_for_bit_what_the_kernels_gave_on_openmp(threads):
    """However many threads split the work (one: no pool dispatch at all; three: more threads than this machine's
    cores), and on either instruction set (the digest was the same on both)."""
    assert _two_forwards(PackedLlama(DEFAULT_MODEL, threads)) == BEFORE_THE_POOL


def test_a_decode_after_the_hosts_torch_work_runs_on_the_engines_own_threads():
    """The host thread runs a torch op big enough for an OpenMP team (which, with the engine's own team on the same
    two cores, used to make every parallel loop of a step pay a wake-up: 3x a step). The decode's forwards then run
    on the engine's thread and the pool's workers, which take part, and on no OpenMP thread of the host's."""
    served = load_shared(DEFAULT_MODEL)
    pool = served.packed.pool
    a = torch.randn(512, 512)
    (a @ a).sum()  # this thread's OpenMP team now exists
    tasks_before = set(os.listdir("/proc/self/task"))
    engine_threads: list[int] = []
    backend = AutoregressiveBackend(served)
    backend.engine.observers.append(lambda record: engine_threads.append(threading.get_native_id()))
    result = backend.complete(GenerationRequest(prompt="def fibonacci(n):", max_tokens=8, temperature=0.0))
    assert result.usage.completion_tokens == 8
    ran = set(pool.last_call_ids())
    workers = set(pool.worker_ids())
    assert len(workers) == pool.threads - 1 == default_threads() - 1
    assert ran <= workers | set(engine_threads), "a forward ran on a thread that is neither the engine's nor its pool's"
    if workers:
        assert ran & workers, "the pool's workers took no part"
    host_openmp = {int(t) for t in tasks_before} - workers - {threading.get_native_id()}
    assert not ran & host_openmp


def test_the_pool_names_its_threads_and_one_thread_runs_alone():
    two, one = compute_pool(2), compute_pool(1)
    assert two is compute_pool(2), "one pool per thread count, shared"
    for tid in two.worker_ids():
        assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "dspark-pool"
    assert one.worker_ids() == []
    model = PackedLlama(DEFAULT_MODEL, 1)
    assert model.pool.threads == 1
    model.forward(_ids(20, 7), torch.zeros(20, dtype=torch.long), torch.arange(20), [model.new_cache(32)])
    assert model.pool.last_call_ids() in ([], [threading.get_native_id()])


def test_a_pool_asks_for_its_threads_and_pools_alike_share_a_copy():
    from router.config import PoolConfig

    assert PoolConfig(backend="autoregressive", model=str(DEFAULT_MODEL)).threads is None
    one = load_shared(DEFAULT_MODEL, threads=1)
    assert one.packed.pool.threads == 1 and one.threads == 1
    assert load_shared(DEFAULT_MODEL, threads=1) is one
    assert load_shared(DEFAULT_MODEL) is not one
    with pytest.raises(ValueError):
        PoolConfig(backend="autoregressive", model=str(DEFAULT_MODEL), threads=0)


def _imports_after(argv: list[str]) -> set[str]:
    """Which of torch, transformers, skops and the benchmarks the console command has imported once it has run
    ``argv`` (in a fresh interpreter)."""
    script = (
        "import sys\n"
        "from router.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "heavy = ('torch', 'transformers', 'skops', 'benchmarks.decode', 'sklearn.linear_model')\n"
        "print(' '.join(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO, check=True
    )
    return set(done.stdout.split("\n")[-2].split())


def test_the_console_command_loads_only_what_its_subcommand_runs():
    """``--help`` loaded torch, transformers and 13 benchmarks before argparse saw a word (5 s, 435 MB); ``route``
    loaded skops (4-5 s) and transformers for a decision that needs neither."""
    assert _imports_after(["--help"]) == set()
    assert _imports_after(["bench", "--help"]) == set()
    assert _imports_after(["route", "Extract the city: Ana lives in Porto."]) == set()
    assert "benchmarks.decode" in _imports_after(["bench", "decode", "--help"])
