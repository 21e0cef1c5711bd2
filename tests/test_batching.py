"""Batched decoding: many requests in one forward pass, each one's output as if it had run alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from backends import AutoregressiveBackend, GenerationRequest, engine
from backends.batch_kv import SlotLayer
from backends.dspark import published_decode
from backends.dspark.backend import DSparkBackend
from backends.engine import BatchLimits, StepRecord
from backends.errors import QueueFullError
from backends.scheduling import FASTEST_SHARE, RoundCost, SpsCurve, VerifySchedule, choose_lengths, draft_budget
from router.pools import InProcessPool
from tests.test_dspark import assert_equal_or_near_tie, perturbed_heads_model
from tests.test_dspark_drafter import perturbed_drafter

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
MIX = [
    GenerationRequest(prompt="x", max_tokens=12, temperature=0.0),
    GenerationRequest(prompt="def parse(value):\n    return value" * 3, max_tokens=30, temperature=0.0),
    GenerationRequest(prompt="import json\n\nclass Encoder:", max_tokens=24, temperature=0.0, stop=["\n", "e"]),
    GenerationRequest(
        prompt="The result is",
        max_tokens=40,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    ),
    GenerationRequest(prompt="for i in range(", max_tokens=20, temperature=0.0),
]


@pytest.fixture(scope="module")
def heads_model(tiny_model_paths):
    return perturbed_heads_model(tiny_model_paths["llama"], seed=2)


def _backends(heads_model, limits: BatchLimits | None = None) -> dict[str, object]:
    loaded = heads_model.loaded
    return {
        "autoregressive": AutoregressiveBackend(loaded, limits),
        "heads": DSparkBackend(heads_model, limits=limits),
        "published": DSparkBackend(
            None,
            drafter=perturbed_drafter(loaded, seed=4),
            schedule=VerifySchedule(sps=SpsCurve({n: 100.0 for n in range(1, 9)})),
            default="dspark",
            loaded=loaded,
            limits=limits,
        ),
    }


def complete_together(backend, requests: list[GenerationRequest]) -> tuple[list, list[StepRecord]]:
    """Every request admitted in the same step, so they decode as one batch from the start (with any request
    already decoding)."""
    records: list[StepRecord] = []
    expected = backend.engine.depth + len(requests)
    backend.engine.observers.append(records.append)
    results: list = [None] * len(requests)

    def run(i: int) -> None:
        results[i] = backend.complete(requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    with backend.engine.hold():
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while backend.engine.depth < expected and time.monotonic() < deadline:
            time.sleep(0.005)
    for thread in threads:
        thread.join(60)
    backend.engine.observers.remove(records.append)
    return results, records


@pytest.mark.parametrize("kind", ["autoregressive", "heads", "published"])
def test_greedy_output_under_batching_equals_solo(heads_model, kind):
    """Prompts of different lengths, stop strings and a JSON schema, batched: each equals its solo run."""
    backend = _backends(heads_model)[kind]
    solo = [backend.complete(request) for request in MIX]
    batched, records = complete_together(backend, MIX)
    assert max(r.rows for r in records) == len(MIX)
    tokenizer = heads_model.loaded.tokenizer
    for request, alone, together in zip(MIX, solo, batched):
        prompt = tokenizer(request.prompt)["input_ids"]
        assert_equal_or_near_tie(heads_model, prompt, alone.token_ids, together.token_ids)
        assert together.finish_reason == alone.finish_reason or together.token_ids != alone.token_ids
    assert "\n" not in batched[2].text and "e" not in batched[2].text
    if kind != "autoregressive":
        assert any(r.tokens > r.rows for r in records), "no draft was verified in the batch"


@pytest.mark.parametrize("kind", ["autoregressive", "published"])
def test_newcomers_prefilled_together_decode_as_if_alone(heads_model, kind):
    """Prompts of different lengths right-padded into one prefill forward while another request decodes (the
    published drafter's prefill asks for every layer's hidden states too): each equals its solo run."""
    backend = _backends(heads_model)[kind]
    prompts = ["x", "def parse(value):\n    return value" * 3, "import json\n\nclass Encoder:"]
    newcomers = [GenerationRequest(prompt=p, max_tokens=16, temperature=0.0) for p in prompts]
    solo = [backend.complete(request) for request in newcomers]
    running = backend.stream(GenerationRequest(prompt="for i in", max_tokens=400, temperature=0.0, stop=["\x00"]))
    next(running)
    try:
        batched, records = complete_together(backend, newcomers)
    finally:
        running.close()
    tokenizer = heads_model.loaded.tokenizer
    lengths = {len(tokenizer(p)["input_ids"]) for p in prompts}
    assert len(lengths) == len(prompts)
    assert any(r.prefilled == len(newcomers) and r.rows == len(newcomers) + 1 for r in records)
    for prompt, alone, together in zip(prompts, solo, batched):
        assert_equal_or_near_tie(heads_model, tokenizer(prompt)["input_ids"], alone.token_ids, together.token_ids)


def test_batched_dspark_exact_equals_solo_greedy_autoregressive(heads_model):
    """The lossless claim under batching: both drafters, batched, give plain greedy decoding's output."""
    backends = _backends(heads_model)
    reference = [backends["autoregressive"].complete(request) for request in MIX]
    tokenizer = heads_model.loaded.tokenizer
    for kind in ("heads", "published"):
        batched, _ = complete_together(backends[kind], MIX)
        for request, alone, together in zip(MIX, reference, batched):
            prompt = tokenizer(request.prompt)["input_ids"]
            assert_equal_or_near_tie(heads_model, prompt, alone.token_ids, together.token_ids)
    assert backends["published"].engine.round_cost.rounds > 0, "Algorithm 1 priced at the rounds it ran"
    assert backends["autoregressive"].engine.round_cost.rounds == 0


@pytest.mark.parametrize("kind", ["autoregressive", "heads", "published-fixed-block"])
def test_seeded_sampling_is_the_same_whatever_shares_the_batch(heads_model, kind):
    """Draw for draw, where a request's draft lengths do not depend on the batch. Under Algorithm 1 they do, by
    design, so a scheduled request consumes its random stream differently: equal in distribution only."""
    backends = _backends(heads_model)
    if kind == "published-fixed-block":
        backend = DSparkBackend(
            None, drafter=backends["published"].drafter, default="dspark", loaded=heads_model.loaded
        )
    else:
        backend = backends[kind]
    seeded = GenerationRequest(prompt="def parse(", max_tokens=24, temperature=1.0, seed=7)
    alone = backend.complete(seeded).token_ids
    others = [GenerationRequest(prompt=p, max_tokens=30, temperature=0.9, seed=s) for s, p in enumerate("abc")]
    with_others, _ = complete_together(backend, [*others, seeded])
    with_different_others, _ = complete_together(backend, [seeded, *others[:1]])
    assert with_others[-1].token_ids == alone == with_different_others[0].token_ids


def test_a_cancelled_request_frees_its_place_at_once(heads_model):
    """One place in the batch: a stream closed after its first chunk leaves, and the next request gets in."""
    backend = AutoregressiveBackend(heads_model.loaded, BatchLimits(max_batch=1))
    passes = []
    hook = heads_model.loaded.model.base_model.register_forward_hook(lambda *_: passes.append(1))
    try:
        stream = backend.stream(GenerationRequest(prompt="def f(", max_tokens=400, temperature=0.0, stop=["\x00"]))
        next(stream)
        stream.close()
        result = backend.complete(GenerationRequest(prompt="x", max_tokens=5, temperature=0.0))
    finally:
        hook.remove()
    assert result.usage.completion_tokens == 5
    assert len(passes) < 60, "the cancelled request kept decoding"
    assert backend.engine.wait_idle(5) and backend.engine.kv.rows == 0


def test_a_full_batch_queues_then_refuses_with_a_typed_error(heads_model):
    backend = AutoregressiveBackend(heads_model.loaded, BatchLimits(max_batch=1, max_queue=1))
    long = backend.stream(GenerationRequest(prompt="def f(", max_tokens=300, temperature=0.0, stop=["\x00"]))
    next(long)
    queued: list = []
    waiter = threading.Thread(
        target=lambda: queued.append(backend.complete(GenerationRequest(prompt="x", max_tokens=3, temperature=0.0)))
    )
    waiter.start()
    deadline = time.monotonic() + 10
    while backend.engine.depth < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(QueueFullError) as refused:
        backend.complete(GenerationRequest(prompt="y", max_tokens=3))
    assert refused.value.status_code == 429 and refused.value.code == "queue_full"
    long.close()
    waiter.join(30)
    assert queued and queued[0].usage.completion_tokens == 3
    assert queued[0].stats.queue_s > 0


def test_a_hold_that_outlasts_the_idle_engine_still_runs_what_it_held(heads_model, monkeypatch):
    """The batching thread ends when it may admit nothing; the end of the hold starts it again."""
    monkeypatch.setattr(engine, "IDLE_EXIT_S", 0.01)
    backend = AutoregressiveBackend(heads_model.loaded)
    results: list = []
    request = GenerationRequest(prompt="x", max_tokens=3, temperature=0.0)
    waiter = threading.Thread(target=lambda: results.append(backend.complete(request)))
    with backend.engine.hold():
        waiter.start()
        deadline = time.monotonic() + 10
        while (backend.engine.depth < 1 or backend.engine._thread is not None) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert backend.engine._thread is None, "the held engine's thread did not end"
    waiter.join(30)
    assert results and results[0].usage.completion_tokens == 3


EXIT_SCRIPT = """
import sys, time
from backends import AutoregressiveBackend, GenerationRequest, engine

class SlowToFree:
    def __call__(self, record):
        pass

    def __del__(self):
        time.sleep(0.5)
        print("freed", flush=True)

engine.IDLE_EXIT_S = 0.01
backend = AutoregressiveBackend.from_pretrained(sys.argv[1])
backend.engine.observers.append(SlowToFree())
backend.complete(GenerationRequest(prompt="x", max_tokens=2, temperature=0.0))
del backend
time.sleep(0.2)
"""


def test_the_interpreter_waits_for_an_engine_thread_still_freeing_its_engine(tiny_model_paths):
    """An idle engine thread ends by itself and drops the engine it ran, the last reference once its backend is
    gone: it frees the KV cache in that thread. A daemon thread still inside torch when the interpreter finalises
    aborts the process ("terminate called without an active exception"), so exit waits for it; an observer that
    is slow to free stands in for the tensors, and its message only prints if the thread was waited for."""
    script = textwrap.dedent(EXIT_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_model_paths["llama"])], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "freed"


def test_a_pool_loads_its_backend_on_a_thread_that_ends(tiny_model_paths):
    """Torch work on a thread that lives on would leave it an OpenMP team and slow every batch in the process
    (backends/threads.py): neither the warming thread nor a worker may load."""
    loaders: list[threading.Thread] = []

    def load() -> AutoregressiveBackend:
        loaders.append(threading.current_thread())
        return AutoregressiveBackend.from_pretrained(tiny_model_paths["llama"])

    pool = InProcessPool("standard", "autoregressive", load, max_batch=2)
    try:
        pool.warmup()
        assert pool.complete(GenerationRequest(prompt="x", max_tokens=2, temperature=0.0)).usage.completion_tokens
    finally:
        pool.close()
    assert len(loaders) == 1
    assert loaders[0] is not threading.current_thread() and not loaders[0].is_alive()


def test_a_request_larger_than_the_kv_cache_is_refused_before_it_queues(heads_model):
    backend = AutoregressiveBackend(heads_model.loaded, BatchLimits(max_kv_tokens=64))
    with pytest.raises(Exception, match="KV cache") as refused:
        backend.complete(GenerationRequest(prompt="x", max_tokens=100))
    assert refused.value.param == "max_tokens"


def test_the_verification_budget_shrinks_as_the_batch_grows():
    """A cost curve flat to 16 tokens (memory-bound) and compute-bound past it: a lone request may verify its
    whole block, a batch of 64 nothing, and in between every request gets fewer tokens as the batch grows."""
    sps = SpsCurve({n: 100.0 * min(1.0, 16 / n) for n in range(1, 513)})
    budgets = [draft_budget(sps, rows, 7) for rows in (1, 4, 8, 16, 64)]
    assert budgets[0] == 7 and budgets[-1] == 0
    assert budgets == sorted(budgets, reverse=True)
    confident = [0.9**k for k in range(1, 8)]
    per_request = [choose_lengths([confident] * rows, sps)[0] for rows in (1, 2, 4, 8, 16)]
    assert per_request[0] == 7 and per_request[-1] == 0
    assert per_request == sorted(per_request, reverse=True)
    assert choose_lengths([confident], sps, rows=16) == [0]


def test_a_round_dearer_than_its_forward_makes_a_verified_token_worth_less_certainty():
    """At 16 rows on a curve compute-bound past 16 tokens, one more token lengthens the forward by 6%, so Algorithm 1
    admits no draft of survival 0.6. Rounds measured 20 ms beyond their forward make it 2% of the round, and the first
    two tokens pay. Nothing is priced before a round is measured, nor a schedule that weighs no curve."""
    sps = SpsCurve({n: 100.0 * min(1.0, 16 / n) for n in range(1, 513)})
    survival = [0.6**k for k in range(1, 5)]
    cost = RoundCost()
    schedule = VerifySchedule(sps=sps)
    assert cost.priced(schedule) is schedule
    assert choose_lengths([survival], sps, rows=16) == [0]
    cost.add(0.030, 16, sps)  # the forward of 16 tokens costs 10 ms on the curve
    priced = cost.priced(schedule)
    assert priced.sps.overhead_s == pytest.approx(0.020) and priced.sps.steps_per_s is sps.steps_per_s
    assert choose_lengths([survival], priced.sps, rows=16) == [2]
    assert draft_budget(sps, 16, 4) == 0 and draft_budget(priced.sps, 16, 4) == 4
    cost.add(0.010, 16, sps)  # a round no dearer than its forward moves the running mean a tenth of the way
    assert cost.priced(schedule).sps.overhead_s == pytest.approx(0.018)
    static = VerifySchedule(sps=sps, threshold=0.5)
    assert cost.priced(static) is static
    faster = RoundCost()  # rounds quicker than the profile: a longer forward is dearer beside a step than it says
    faster.add(0.004, 1, sps)
    quick = faster.priced(schedule).sps
    assert quick.at(1) == pytest.approx(250.0) and quick.at(32) / quick.at(1) < sps.at(32) / sps.at(1)
    faster.add(-1.0, 1, sps)  # however far below it a round measured, a forward keeps a share of its profiled time
    assert faster.priced(schedule).sps.at(1) == pytest.approx(100.0 / FASTEST_SHARE)


def test_a_token_dearer_than_the_curve_says_is_priced_at_what_rounds_measured():
    """On a curve flat to 16 tokens a verified token is free, so Algorithm 1 verifies a draft of survival 0.03.
    Rounds whose time grows 0.5 ms a token fed (each token's attention over a long context, its bookkeeping) make
    the line's slope that, and that draft is not worth its token. Rounds all of one length say nothing of a
    token's cost."""
    sps = SpsCurve({n: 100.0 for n in range(1, 17)})
    cost = RoundCost()
    for tokens in [1, 4, 2, 6] * 10:
        cost.add(0.010 + 0.002 + 0.0005 * tokens, tokens, sps)
    assert cost.per_token_s == pytest.approx(0.0005)
    priced = cost.priced(VerifySchedule(sps=sps)).sps
    assert 1 / priced.at(5) - 1 / priced.at(1) == pytest.approx(0.002)
    assert choose_lengths([[0.03]], sps) == [1] and choose_lengths([[0.03]], priced) == [0]
    assert choose_lengths([[0.5]], priced) == [1]
    same = RoundCost()
    for _ in range(20):
        same.add(0.015, 4, sps)
    assert same.per_token_s == 0.0 and same.seconds == pytest.approx(0.005)


def test_drafting_must_pay_for_the_drafter_pass():
    """A drafter pass that costs what a forward does: a lone request drafts only as far as its expected
    survivals pay for the pass, a batch that earns little from one request's draft not at all, and a free
    drafter leaves Algorithm 1's own ceiling."""
    flat = SpsCurve({n: 100.0 for n in range(1, 65)})
    sure, unsure = [0.95**k for k in range(1, 8)], [0.3**k for k in range(1, 8)]
    assert draft_budget(flat, 1, 7, sure, draft_s=0.0) == 7
    assert draft_budget(flat, 1, 7, sure, draft_s=0.01) == 7
    assert draft_budget(flat, 1, 7, unsure, draft_s=0.01) == 0
    assert draft_budget(flat, 16, 7, sure, draft_s=0.01) == 0
    assert draft_budget(flat, 1, 7, (), draft_s=0.01) == 7  # no history yet: optimistic


def test_a_request_that_stopped_drafting_probes_again_and_recovers():
    """Only a draft updates a request's expected survival, so a request whose early drafts failed would skip the
    drafter for good; after ``PROBE_AFTER`` rounds without one it is budgeted as at its start, and a good probe
    reopens drafting at once, since recent rounds weigh most."""
    flat = SpsCurve({n: 100.0 for n in range(1, 65)})
    survival = published_decode.RecentSurvival()
    for _ in range(6):
        survival.add([0.3] * 7)
    budgets = []
    for _ in range(survival.PROBE_AFTER + 1):
        budgets.append(draft_budget(flat, 1, 7, survival.expected(), draft_s=0.01))
        survival.drafted(budgets[-1])
    assert budgets == [0] * survival.PROBE_AFTER + [7]
    survival.add([0.97] * 7)
    assert draft_budget(flat, 1, 7, survival.expected(), draft_s=0.01) > 0


def test_a_probe_that_does_not_reopen_drafting_doubles_the_wait_for_the_next():
    """A request the drafter cannot help pays for fewer and fewer probes; one that reopens drafting brings the
    wait back to ``PROBE_AFTER``."""
    flat = SpsCurve({n: 100.0 for n in range(1, 65)})
    survival = published_decode.RecentSurvival()
    for _ in range(6):
        survival.add([0.3] * 7)

    def rounds_until_a_probe() -> int:
        skipped = 0
        while not (budget := draft_budget(flat, 1, 7, survival.expected(), draft_s=0.01)):
            survival.drafted(budget)
            skipped += 1
        survival.drafted(budget)
        return skipped

    gaps = []
    for _ in range(4):
        gaps.append(rounds_until_a_probe())
        survival.add([0.3] * 7)  # the probe's draft failed too
    assert gaps == [8, 16, 32, 64]
    assert rounds_until_a_probe() == survival.LONGEST_WAIT
    survival.add([0.97] * 7)
    assert rounds_until_a_probe() == 0, "a good probe reopens drafting at once"
    assert survival.wait == survival.PROBE_AFTER


def test_the_batch_keeps_its_cache_compact(heads_model):
    """Rejected drafts leave holes among other rows' slots; compaction keeps the cache near the longest row."""
    backend = _backends(heads_model)["heads"]
    requests = [GenerationRequest(prompt=p, max_tokens=80, temperature=0.0, stop=["\x00"]) for p in ("x", "def g(")]
    records: list[StepRecord] = []
    kv = backend.engine.kv
    backend.engine.observers.append(lambda r: records.append((kv.slots, max(kv.lengths, default=0))))
    complete_together(backend, requests)
    assert records and all(slots <= longest + 32 + 4 for slots, longest in records)
    assert torch.equal(kv.valid, torch.zeros((0, 0), dtype=torch.bool))


def test_a_dspark_backend_loads_on_a_thread_that_ends_whoever_calls(monkeypatch, tiny_model_paths, tmp_path):
    """A CLI or benchmark that calls from_pretrained on its main thread, which lives on, must not be left the
    OpenMP team of the load's torch work (the SPS profile, the drafter's round costs): the decode engine's steps
    would pay for it (backends/threads.py)."""
    from backends.dspark import backend as dspark_backend
    from backends.dspark.drafter_config import DRAFTER_DIR
    from backends.loading import load_model
    from tests.test_dspark_drafter import perturbed_drafter

    perturbed_drafter(load_model(tiny_model_paths["llama"])).save(tmp_path / DRAFTER_DIR)

    workers: list[threading.Thread] = []
    real = dspark_backend.measure_round

    def measure_round(*args, **kwargs):
        workers.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(dspark_backend, "measure_round", measure_round)
    backend = DSparkBackend.from_pretrained(tiny_model_paths["llama"], device="cpu", drafter_path=tmp_path)
    assert backend.drafter is not None and len(workers) == 1
    assert workers[0] is not threading.current_thread() and not workers[0].is_alive()


def test_the_batch_cache_grows_only_the_dimension_that_is_short():
    """A newcomer needs a row, a long prompt needs slots: growing both at each (as before) made the room 4x per
    growth, and 64 concurrent requests on the default model were killed for memory past 23 GB."""
    layer = SlotLayer()
    for length in [10] * 17:
        layer.add_row(torch.ones(1, 3, length, 8), torch.ones(1, 3, length, 8))
    keys, _ = layer._room
    assert (keys.shape[0], keys.shape[2]) == (32, 64)  # rows doubled past 16; slots as first reserved
    layer.add_row(torch.ones(1, 3, 300, 8), torch.ones(1, 3, 300, 8))
    keys, _ = layer._room
    assert (keys.shape[0], keys.shape[2]) == (32, 300)  # slots grew to fit, rows untouched
    assert layer.keys.shape == (18, 3, 300, 8) and float(layer.keys[:17, :, 10:].abs().sum()) == 0.0
