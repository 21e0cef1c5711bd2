"""A GPU script's stages: each a command of its own, run in order within the script's time, its outcome written into
the results folder the moment it ends (a run cut short still returns what it did).

What comes back from the machine is at most 8 files, so a script's results are few: ``summary.json`` (every stage's
command, seconds, exit code and what it reported, rewritten after each), ``log.txt`` (every stage's output, as it
printed it) and the files the stages write themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"
LOG = "log.txt"


class Stages:
    def __init__(self, results: Path, budget_s: float) -> None:
        self.results = results
        self.results.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget_s
        self.summary: dict[str, Any] = {"stages": {}}
        self._write()

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, command: list[str], reserve_s: float = 0.0) -> bool:
        """``command`` (a Python module's argv, run with this interpreter) within the time left, keeping
        ``reserve_s`` for the stages after it; False, and later stages skipped, where it failed or ran out."""
        limit = self.left_s() - reserve_s
        outcome: dict[str, Any] = {"command": " ".join(command)}
        if limit <= 0:
            outcome["skipped"] = "no time left"
            self._record(name, outcome)
            return False
        started = time.monotonic()
        print(f"== {name}: {' '.join(command)} ({limit:.0f} s at most)", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with (self.results / LOG).open("a") as log:
            log.write(f"== {name}: {' '.join(command)}\n")
            log.flush()
            process = subprocess.Popen(
                [sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            watchdog = threading.Timer(limit, process.kill)  # a stage that prints nothing is stopped too
            watchdog.start()
            try:
                for line in process.stdout:
                    sys.stdout.write(line)
                    log.write(line)
                    log.flush()
                code = process.wait()
            finally:
                watchdog.cancel()
        outcome |= {"seconds": round(time.monotonic() - started, 1), "exit_code": code}
        self._record(name, outcome)
        return code == 0

    def record(self, name: str, **facts: Any) -> None:
        """What a stage found besides its exit code (a file's digest, what it wrote)."""
        self.summary["stages"].setdefault(name, {}).update(facts)
        self._write()

    def _record(self, name: str, outcome: dict[str, Any]) -> None:
        self.summary["stages"][name] = outcome
        self._write()

    def _write(self) -> None:
        (self.results / SUMMARY).write_text(json.dumps(self.summary, indent=2) + "\n")
