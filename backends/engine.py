"""The batching loop: one thread per backend that runs every admitted request's decode loop in one batch.

Each step of the loop:

1. *admit* waiting requests while the batch has room (``max_batch`` rows, ``max_kv_tokens`` reserved
   positions: prompt plus ``max_tokens`` per request); a request beyond ``max_queue`` waiting is refused with
   :class:`QueueFullError` at once;
2. *prefill* the newcomers, several prompts right-padded into one forward pass of their own (up to
   ``prefill_tokens`` padded positions, the oldest newcomer even past it), so newcomers stall the others for
   one prefill at most, and a step with many newcomers pays for one forward, not one each;
3. answer the published drafter's *budget* and *schedule* questions across the whole batch (Algorithm 1:
   the verification length of every request from every request's confidence and the cost of the forward,
   priced at what the engine's recent rounds cost beyond it, :class:`~backends.scheduling.RoundCost`);
4. run one *forward* pass over every row, each fed its own tokens, and hand each loop its outputs; the loops
   verify and commit on their own, and a request that has ended (EOS, stop, length, grammar, cancelled)
   leaves the batch at once.

Loops only ever see their own request, so with one request the engine is exactly the solo decoder; with many,
greedy output is the same token for token and seeded sampling the same draw for draw (each request samples
from its own generator), whatever else shares the batch.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from backends.batch_kv import BatchedKV
from backends.errors import BackendError, DSparkRouterError, InvalidRequestError, QueueFullError
from backends.loading import LoadedModel
from backends.packed.kv import PackedKV
from backends.packed.pool import serial_torch_on_this_thread
from backends.packed.prefix_cache import PrefixCache
from backends.scheduling import RoundCost, schedule_batch
from backends.sequence import Sequence
from backends.steps import Budget, Forward, KeepPath, Rewind, Schedule

IDLE_EXIT_S = 0.02
"""An engine's thread ends after this long with nothing to do, so an unused backend holds no thread; the next
request starts a new one, which costs well under a millisecond against any request's decoding. On the packed engine
the thread runs its own torch ops serially (:func:`~backends.packed.pool.serial_torch_on_this_thread`) and the
kernels on the engine's pool, so nothing the host process does with OpenMP reaches a step; transformers' engine runs
on torch's OpenMP threads, as any torch model does."""


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int = 16
    """Requests decoding at once."""
    max_kv_tokens: int = 65_536
    """Positions the running requests may hold in the KV cache, counted as prompt + max_tokens each."""
    max_queue: int = 256
    """Requests waiting for a place before new ones are refused."""
    prefill_tokens: int = 512
    """Prompt positions prefilled together in one forward, padding counted (newcomers times the longest of their
    prompts): what bounds the running batch's stall. 1 prefills one newcomer per step."""
    prefix_cache_mb: float = 64.0
    """Memory for prompts kept so a newcomer sharing their start copies it instead of running it
    (:mod:`backends.packed.prefix_cache`; the packed engine's; 0: none)."""


@dataclass(frozen=True)
class StepRecord:
    """What one forward pass of the batch did, for metrics: rows, tokens fed, and each drafting request's
    verification budget."""

    rows: int
    tokens: int
    budgets: list[int] = field(default_factory=list)
    prefilled: int = 0
    """Newcomers prefilled together just before this forward."""


Observer = Callable[[StepRecord], None]


class DecodeEngine:
    def __init__(
        self, loaded: LoadedModel, limits: BatchLimits | None = None, state_layers: tuple[int, ...] = ()
    ) -> None:
        """``state_layers``: the hidden-state layers its decode loops read (kept with cached prompt prefixes)."""
        self.limits = limits or BatchLimits()
        mb = self.limits.prefix_cache_mb
        self._prefixes = PrefixCache(int(mb * 2**20), state_layers) if mb > 0 and loaded.packed is not None else None
        self.kv = batch_kv(loaded, self._prefixes)
        self._loaded = loaded
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._held = 0
        self._stopping = False
        _ENGINES.add(self)
        self.observers: list[Observer] = []
        self.round_cost = RoundCost()

    @property
    def prefix_cache_bytes(self) -> int:
        """What the kept prompt prefixes hold (0 where the engine keeps none)."""
        return self._prefixes.nbytes if self._prefixes is not None else 0

    @property
    def depth(self) -> int:
        """Requests waiting or decoding."""
        return len(self._waiting) + len(self._running)

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Admit nothing new until the block ends (running requests go on): requests submitted meanwhile start
        together, as a closed-loop benchmark or a test of batching needs."""
        with self._wake:
            self._held += 1
        try:
            yield
        finally:
            with self._wake:
                self._held -= 1
                if self._waiting:
                    self._start()
                self._wake.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no request is waiting or decoding (a drain, a test); False if that took too long."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._waiting and not self._running, timeout_s)

    def submit(self, sequence: Sequence) -> None:
        """Queue a request (its loop made, not started) for the batch, or refuse it now: it could never fit, or
        the queue is full."""
        if sequence.reserved_tokens > self.limits.max_kv_tokens:
            raise InvalidRequestError(
                f"prompt plus max_tokens is {sequence.reserved_tokens} tokens, more than this pool's KV cache "
                f"holds for one request ({self.limits.max_kv_tokens})",
                param="max_tokens",
            )
        with self._wake:
            if len(self._waiting) >= self.limits.max_queue:
                raise QueueFullError(f"the batch is full and {len(self._waiting)} requests are waiting")
            self._waiting.append(sequence)
            self._start()
            self._wake.notify_all()

    def stop(self) -> None:
        """End the batching thread once the running requests are done (a new request starts it again)."""
        with self._wake:
            thread, self._stopping = self._thread, True
            self._wake.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._wake:
            self._stopping = False

    def _start(self) -> None:
        """The batching thread, unless it runs (called holding ``_wake``); it ends when idle or held, so the
        end of a hold starts it again."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._serve, name="decode-engine", daemon=True)
        _THREADS.add(self._thread)
        self._thread.start()

    def _serve(self) -> None:
        if self._loaded.packed is not None:
            serial_torch_on_this_thread()
        with torch.inference_mode():
            while self._admit():
                time.sleep(0)  # hand the GIL over once a step: event loops and stream readers keep up
                try:
                    self._step()
                except Exception as exc:  # the batch's own forward failed: its requests fail, the engine goes on
                    error = _typed(exc)
                    for sequence in list(self._running):
                        self._retire(sequence, error=error)
                    self.kv = batch_kv(self._loaded, self._prefixes)

    def _admit(self) -> bool:
        """Move waiting requests into the batch while it has room; sleep while there is nothing to do. False
        ends the thread: stopped, or idle for ``IDLE_EXIT_S`` (so an unused backend holds no thread)."""
        with self._wake:
            while not self._running and (self._held or not self._waiting):
                if self._stopping or not self._wake.wait(IDLE_EXIT_S):
                    if self._running or (self._waiting and not self._held):
                        continue
                    self._thread = None
                    return False
            if self._held:
                return True
            reserved = sum(s.reserved_tokens for s in self._running)
            while self._waiting and len(self._running) < self.limits.max_batch:
                sequence = self._waiting[0]
                if sequence.cancelled.is_set():
                    self._waiting.popleft()
                    continue
                if reserved + sequence.reserved_tokens > self.limits.max_kv_tokens:
                    break
                self._waiting.popleft()
                reserved += sequence.reserved_tokens
                self._running.append(sequence)
                sequence.start()
                self._advance(sequence, None)
        return True

    def _step(self) -> None:
        for sequence in [s for s in self._running if s.cancelled.is_set()]:
            self._retire(sequence, finished=False)
        prefilled = self._prefill()
        started = time.perf_counter()
        rows = [s for s in self.kv.members if s.pending is not None]
        if not rows:
            return
        curve = None  # the profiled curve this round's Algorithm 1 weighed, to price the round against
        for sequence in rows:
            if isinstance(sequence.pending, Budget):
                ask = sequence.pending
                curve = ask.schedule.sps if ask.schedule.batched else curve
                schedule = self.round_cost.priced(ask.schedule)
                answered = time.perf_counter()
                self._advance(sequence, schedule.budget(len(rows), ask.limit, ask.expected))
                started += time.perf_counter() - answered  # its drafting, which the budget weighs on its own
        scheduled = [s for s in rows if isinstance(s.pending, Schedule)]
        asks = [(self.round_cost.priced(s.pending.schedule), s.pending.confidence, s.pending.limit) for s in scheduled]
        curve = next((s.pending.schedule.sps for s in scheduled if s.pending.schedule.batched), curve)
        budgets = schedule_batch(asks, len(rows))
        for sequence, length in zip(scheduled, budgets):
            self._advance(sequence, length)
        rows = [s for s in self.kv.members if s.pending is not None]
        if not rows:
            return
        if any(not isinstance(s.pending, Forward) for s in rows):
            raise BackendError("a decode loop asked for something other than a forward pass at the forward")
        inputs, trees = [s.pending.tokens for s in rows], [s.pending.parents for s in rows]
        hidden_states = any(s.pending.hidden_states for s in rows)
        if any(parents is not None for parents in trees):  # only the packed engine's loops verify trees
            outputs = self.kv.step(inputs, hidden_states, trees)
        else:
            outputs = self.kv.step(inputs, hidden_states)
        for sequence, out in zip(rows, outputs):
            self._advance(sequence, out)
        if curve is not None:
            self.round_cost.add(time.perf_counter() - started, sum(map(len, inputs)), curve)
        record = StepRecord(rows=len(rows), tokens=sum(map(len, inputs)), budgets=budgets, prefilled=prefilled)
        for observer in self.observers:
            observer(record)

    def _prefill(self) -> int:
        """Prefill the newcomers :func:`prefill_group` picks, in one forward; how many. Prompts of a few dozen
        tokens leave a forward's fixed cost its larger part, so a group costs little more than its longest."""
        group = prefill_group([s for s in self._running if s not in self.kv], self.limits.prefill_tokens)
        if not group:
            return 0
        forwards = [s.pending for s in group]
        scopes = [s.request.cache_scope for s in group]
        outputs = self.kv.prefill(group, [f.tokens for f in forwards], any(f.hidden_states for f in forwards), scopes)
        for sequence, out in zip(group, outputs):
            sequence.stats.cached_prompt_tokens = out.cached
            self._advance(sequence, out)
        return len(group)

    def _advance(self, sequence: Sequence, answer: object) -> None:
        """Run the loop to its next question (a forward, a budget, a schedule), committing what it yields on
        the way; a finished or failed request leaves the batch."""
        try:
            item = sequence.loop.send(answer)
            while isinstance(item, (list, Rewind, KeepPath)):
                if isinstance(item, Rewind):
                    self.kv.rewind(sequence, item.tokens)
                elif isinstance(item, KeepPath):
                    self.kv.keep(sequence, item.forwarded, item.kept)
                elif sequence.push(item):
                    self._retire(sequence, finished=True)
                    return
                item = sequence.loop.send(None)
            sequence.pending = item
        except Exception as exc:
            sequence.pending = None
            self._retire(sequence, error=_typed(exc))

    def _retire(self, sequence: Sequence, *, finished: bool = False, error: BaseException | None = None) -> None:
        sequence.pending = None
        if sequence in self.kv:
            self.kv.remove(sequence)
        with self._wake:
            self._running.remove(sequence)
            self._wake.notify_all()
        if error is not None:
            sequence.fail(error)
        elif finished:
            sequence.finish()
        else:
            sequence.fail(BackendError("cancelled"))


def batch_kv(loaded: LoadedModel, prefixes: PrefixCache | None = None) -> BatchedKV | PackedKV:
    """The running batch's caches and forward: the packed engine's (starting prompts from ``prefixes``) where it
    serves, transformers' otherwise."""
    return PackedKV(loaded, prefixes) if loaded.packed is not None else BatchedKV(loaded)


def prefill_group(newcomers: list[Sequence], budget: int) -> list[Sequence]:
    """The oldest newcomer, then each later one that keeps the group's padded size (members times the longest
    prompt) within ``budget``; one that does not fit waits for a later step (the oldest always goes)."""
    group: list[Sequence] = []
    longest = 0
    for sequence in newcomers:
        length = len(sequence.pending.tokens)
        if group and (len(group) + 1) * max(longest, length) > budget:
            continue
        group.append(sequence)
        longest = max(longest, length)
    return group


_ENGINES: weakref.WeakSet[DecodeEngine] = weakref.WeakSet()
_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
"""Every engine, and every engine thread until it is gone (``threading`` keeps a thread referenced until its very
end, after its target is dropped: an engine thread that goes idle and ends can still be freeing the engine it held
last, its KV cache included)."""


@atexit.register
def _stop_engines() -> None:
    """At interpreter exit, stop every engine and wait for every engine thread: a daemon thread still inside torch
    (a step, or freeing tensors) while the interpreter tears down aborts the process."""
    for engine in list(_ENGINES):
        engine.stop()
    for thread in list(_THREADS):
        if thread is not threading.current_thread():
            thread.join()


def _typed(exc: Exception) -> DSparkRouterError:
    """A failure inside one loop fails that request with a typed error; the batch goes on."""
    if isinstance(exc, DSparkRouterError):
        return exc
    return BackendError(f"decoding failed: {type(exc).__name__}: {exc}")
