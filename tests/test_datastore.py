"""The datastore of the target's shipped answers: its drafts, its index on disk, and exact output drafting from it."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from backends.autoregressive import AutoregressiveBackend
from backends.default_model import DEFAULT_MODEL
from backends.dspark.backend import DSparkBackend
from backends.dspark.datastore import ANSWERS_FILE, INDEX_DIR, SAMPLE, Datastore
from backends.dspark.traffic import TrafficCache
from backends.traffic_settings import TrafficSettings
from backends.types import GenerationRequest

OPTIONS = TrafficSettings()


def test_a_draft_follows_the_answers_that_share_the_longest_newest_tokens():
    """The longest key that matches picks the occurrences; among them the most voted path drafts, as the traffic
    cache's rules have it, for at most as many tokens as matched."""
    store = Datastore.build([[9, 1, 2, 3, 4, 5, 6, 7]] * 3 + [[8, 1, 2, 3, 40, 50, 60]] * 5)
    assert store.speculate([9, 1, 2, 3], 8, OPTIONS).tokens == [4, 5, 6, 7]
    assert store.speculate([8, 1, 2, 3], 8, OPTIONS).tokens == [40, 50, 60]
    shorter = store.speculate([7, 1, 2, 3], 8, OPTIONS)  # only the three newest match: all eight occurrences vote
    assert shorter.tokens == [40, 50, 60] and shorter.match == 3 and shorter.probs[0] == pytest.approx(5 / 8)
    assert store.speculate([9, 1, 2, 3], 2, OPTIONS).tokens == [4, 5]
    assert store.speculate([1, 2], 8, OPTIONS) is None and store.speculate([5, 5, 5], 8, OPTIONS) is None


def test_a_match_never_runs_from_one_answer_into_the_next():
    store = Datastore.build([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    assert store.speculate([4, 5, 6, 7], 8, OPTIONS) is None
    within = store.speculate([5, 6, 7, 8], 8, OPTIONS)  # 5 ended the first answer: the match is 6, 7, 8 alone
    assert within.tokens == [9, 10] and within.match == 3
    assert store.speculate([3, 4, 5], 8, OPTIONS) is None  # nothing follows an answer's end


def test_drafts_agree_with_the_traffic_cache_where_both_see_every_occurrence():
    """Few occurrences of each n-gram (within both indexes' limits) and a match no longer than the key: the same
    answers draft the same tokens from either index."""
    rng = np.random.default_rng(0)
    phrases = [rng.integers(100, 400, 12).tolist() for _ in range(6)]
    answers = [[*phrases[i % 6][: 4 + i % 8], *rng.integers(500, 900, 6).tolist()] for i in range(20)]
    store, cache = Datastore.build(answers), TrafficCache(TrafficSettings())
    for answer in answers:
        cache.insert(answer)
    options = TrafficSettings(depth=4)
    compared = 0
    for answer in answers:
        for end in range(4, len(answer)):
            context = answer[end - 4 : end]
            found = cache.speculate(context, 8, options)
            if found is not None and found.match == 4 and min(found.votes) <= SAMPLE:
                assert store.speculate(context, 8, options).tokens == found.tokens
                compared += 1
    assert compared > 50


def test_the_index_is_built_once_per_corpus_and_mapped_from_disk(tmp_path):
    assert Datastore.open(tmp_path) is None
    answers = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11]] * 3
    lines = "".join(json.dumps({"index": i, "completion": a}) + "\n" for i, a in enumerate(answers))
    (tmp_path / ANSWERS_FILE).write_bytes(gzip.compress(lines.encode()))
    built = Datastore.open(tmp_path)
    assert (tmp_path / INDEX_DIR / "stamp").is_file()
    stamp = (tmp_path / INDEX_DIR / "stamp").read_text()
    mapped = Datastore.open(tmp_path)
    assert isinstance(mapped._tokens.base, np.memmap) and (tmp_path / INDEX_DIR / "stamp").read_text() == stamp
    assert mapped.speculate([5, 6, 7], 8, OPTIONS) == built.speculate([5, 6, 7], 8, OPTIONS)
    assert mapped.memory_bytes == 4 * mapped.tokens + (4 + 8) * len(mapped._starts)
    (tmp_path / ANSWERS_FILE).write_bytes(gzip.compress(lines.replace("11]", "12]").encode()))
    assert Datastore.open(tmp_path).speculate([6, 7, 10], 8, OPTIONS).tokens == [12]  # a new corpus: rebuilt


@pytest.fixture(scope="module")
def published() -> DSparkBackend:
    return DSparkBackend.from_pretrained(DEFAULT_MODEL, drafter="dspark")


def test_the_default_pool_reads_the_shipped_answers(published):
    assert published.datastore is not None and published.datastore.tokens > 1_000_000
    assert published.cache_bytes()["datastore"] == published.datastore.memory_bytes


def test_greedy_output_drafting_from_the_datastore_is_plain_decodings(published):
    """A datastore holding the target's own answers to a prompt drafts most of it the next time, in a scope whose
    traffic cache is empty; the output is the autoregressive one, token for token."""
    plain = AutoregressiveBackend(published.loaded)
    request = GenerationRequest(
        messages=[{"role": "user", "content": "List five uses of a paperclip, one a line."}],
        max_tokens=64,
        temperature=0.0,
    )
    answer = plain.complete(request).token_ids
    backend = DSparkBackend(
        None,
        drafter=published.drafter,
        schedule=published.schedule,
        default="dspark",
        loaded=published.loaded,
        datastore=Datastore.build([answer]),
    )
    result = backend.complete(request.model_copy(update={"cache_scope": "fresh"}))
    assert result.token_ids == answer
    assert result.stats.spans.datastore_rounds > 0 and result.stats.spans.traffic_rounds == 0
    assert result.stats.forward_passes < len(answer) / 2
