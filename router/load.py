"""A pool's load as the ``time_saved`` objective reads it on every decision, so reading it must cost next to
nothing: counters the pool keeps anyway (in-process), or the stream's length and the workers' cached heartbeats
(Redis pools).

The batch a new request would join matters more than the depth: a request decodes with the others of its
worker's batch, and what one forward of that batch costs (``router/expected_time.py``) is what makes DSpark's
extra verification tokens cheap on an idle worker and dear on a full one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolLoad:
    depth: int
    """Requests admitted and not finished: queued plus running."""
    running: int
    """Requests decoding now, over all workers."""
    workers: int
    """Workers that decode (for Redis pools: those with a recent heartbeat)."""
    max_batch: int
    """Requests one worker decodes at once."""
    solo_tokens_per_forward: float | None = None
    """Tokens a lone request fed each forward pass, as measured on this pool's own passes of one row (a DSpark
    pool's anchor plus verified draft, k + 1, before load shortens it); None until measured, or remote."""
    draft_s: float = 0.0
    """Seconds of drafting each request's round costs outside the batched forward (the published drafter runs
    once per request): what makes long drafts dear once a batch fills, on top of the longer forward."""

    @property
    def slots(self) -> int:
        return self.workers * self.max_batch

    @property
    def queued(self) -> int:
        return max(0, self.depth - self.running)

    @property
    def batch(self) -> int:
        """The batch a new request would decode in, itself included: its least loaded worker's, or a full one
        once requests queue."""
        if self.queued or self.workers == 0:
            return self.max_batch
        return min(self.max_batch, self.running // self.workers + 1)
