"""The processes of ``bench soak`` other than its clients, and the two faults it injects into them.

Every process is a real one on loopback (the gateway is ``dspark-router serve``, the workers ``dspark-router
worker``, Redis a private ``redis-server``), so that a fault is what an operator would see: Redis stopped and
started again on the same port with nothing kept, and a worker ``kill -9``-ed in the middle of its jobs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks.local_redis import LocalRedis, free_port

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    """One torch thread everywhere: tiny models gain nothing from more, and greedy answers stay bit-identical
    between the gateway's pools and the workers, which the duplicate check relies on."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


@dataclass
class Processes:
    """The gateway, the Redis workers and Redis; each process's pid is kept under a label for the RSS series
    (``worker-1`` is the replacement of the killed ``worker-0``, ``redis-1`` the restarted ``redis-0``)."""

    config: Path
    logs: Path
    redis: LocalRedis
    pool: str
    gateway: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)
    faults: list[dict[str, float | str]] = field(default_factory=list)
    port: int = 0

    def start(self, workers: int, ready_timeout_s: float = 300.0) -> str:
        """Redis, ``workers`` workers and the gateway; returns the gateway's base URL once /readyz says 200."""
        self.redis.start()
        self.labels["redis-0"] = self.redis.proc.pid
        for _ in range(workers):
            self.start_worker()
        self.port = free_port()
        command = [sys.executable, "-m", "router", "serve", "--config", str(self.config), "--port", str(self.port)]
        command += ["--log-level", "warning"]
        log = (self.logs / "gateway.log").open("w")
        self.gateway = subprocess.Popen(command, env=_env(), stdout=log, stderr=log)
        self.labels["gateway"] = self.gateway.pid
        base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + ready_timeout_s
        while not _ready(base):
            if self.gateway.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not become ready; see {self.logs / 'gateway.log'}")
            time.sleep(0.5)
        return base

    def start_worker(self) -> None:
        label = f"worker-{len(self.workers)}"
        command = [sys.executable, "-m", "router", "worker", "--config", str(self.config), "--pool", self.pool]
        log = (self.logs / f"{label}.log").open("w")
        self.workers.append(subprocess.Popen(command, env=_env(), stdout=log, stderr=log))
        self.labels[label] = self.workers[-1].pid

    def restart_redis(self, at_s: float, outage_s: float) -> None:
        """Redis down for ``outage_s`` seconds, then up again on the same port, empty."""
        self.redis.stop()
        time.sleep(outage_s)
        self.redis.start()
        self.labels[f"redis-{sum(k.startswith('redis') for k in self.labels)}"] = self.redis.proc.pid
        self.faults.append({"fault": "redis_restart", "at_s": at_s, "outage_s": outage_s})

    def kill_worker(self, at_s: float) -> None:
        """``kill -9`` of the oldest live worker, and a replacement started at once."""
        victim = next(w for w in self.workers if w.poll() is None)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        self.start_worker()
        self.faults.append({"fault": "worker_kill", "at_s": at_s, "pid": victim.pid})

    def exit_codes(self) -> dict[str, int | None]:
        """Each worker's and the gateway's exit status, None while it runs: -9 is the fault's kill, anything else
        a process that died unasked."""
        started = {f"worker-{i}": w for i, w in enumerate(self.workers)}
        return {label: process.poll() for label, process in {**started, "gateway": self.gateway}.items()}

    def log_tails(self, chars: int = 2000) -> dict[str, str]:
        """The end of each worker's log: the temporary folder goes with the run, and a worker that failed says
        why there."""
        paths = {f"worker-{i}": self.logs / f"worker-{i}.log" for i in range(len(self.workers))}
        return {label: path.read_text(errors="replace")[-chars:] for label, path in paths.items()}

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of every labelled process still alive, in MiB (a dead child not yet reaped is not)."""
        out = {}
        for label, pid in self.labels.items():
            try:
                process = psutil.Process(pid)
                if process.status() != psutil.STATUS_ZOMBIE:
                    out[label] = process.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                continue
        return out

    def close(self) -> None:
        for process in [self.gateway, *self.workers]:
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
        self.redis.stop()


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
