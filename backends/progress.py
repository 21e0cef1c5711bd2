"""Progress for every long job (training, calibration, benchmarks): a live bar in a terminal, and plain
status lines every few steps when the output goes to a log file, where a live bar would print nothing.
Progress goes to stderr, so a command's JSON on stdout stays parseable."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class JobProgress(Progress):
    def __init__(self, log_every: int = 25) -> None:
        super().__init__(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._log_every = log_every

    def add_job(self, description: str, total: int, completed: int = 0) -> int:
        return self.add_task(description, total=total, completed=completed, status="")

    def step(self, task: int, advance: int = 1, status: str = "") -> None:
        """Advance; off a terminal, also print a line every ``log_every`` steps and at the end."""
        self.update(task, advance=advance, status=status)
        job = self.tasks[task]
        done = int(job.completed)
        if not self.console.is_terminal and (done % self._log_every < advance or done == job.total):
            self.console.print(f"{job.description}: {done}/{int(job.total)} {status} [{job.elapsed:.0f}s]")
