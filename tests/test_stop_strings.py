"""Stop strings are matched on decoded text, cut exactly, and never leak into a stream, whatever the spans."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import AutoregressiveBackend, GenerationRequest
from backends.output import OutputTracker

TEXTS = [
    "def parse(value):\n    return json.loads(value)  # done\n",
    '{"name": "Ada", "city": "Paris", "tags": ["x", "y"]}',
    "Résumé: naïve café — 東京 and emoji 🎉 then END of story.\n\nNext",
]


def _spans(ids: list[int], sizes: list[int]) -> list[list[int]]:
    spans, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        spans.append(ids[i : i + size])
        i += size
    if i < len(ids):
        spans.append(ids[i:])
    return spans


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text_index=st.integers(0, len(TEXTS) - 1),
    start=st.integers(0, 200),
    length=st.integers(1, 6),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=60),
)
def test_tracker_cuts_at_the_first_stop_whatever_the_span_sizes(tiny_tokenizer, text_index, start, length, sizes):
    text = TEXTS[text_index]
    start %= len(text)
    stop = text[start : start + length]
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    tracker = OutputTracker(tiny_tokenizer, GenerationRequest(prompt="p", stop=[stop], max_tokens=500), frozenset())
    streamed = ""
    for span in _spans(ids, sizes):
        tracker.push(span)
        streamed += tracker.take_delta()
        assert stop not in streamed
        if tracker.finished:
            break
    streamed += tracker.take_delta()
    expected = text[: text.find(stop)]
    assert tracker.finish_reason == "stop"
    assert tracker.text == expected
    assert streamed == expected
    assert tiny_tokenizer.decode(tracker.token_ids) == expected


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=40), budget=st.integers(1, 30))
def test_token_budget_is_exact_whatever_the_span_sizes(tiny_tokenizer, sizes, budget):
    ids = tiny_tokenizer.encode(TEXTS[0], add_special_tokens=False)
    tracker = OutputTracker(tiny_tokenizer, GenerationRequest(prompt="p", max_tokens=budget), frozenset())
    for span in _spans(ids, sizes):
        tracker.push(span)
        if tracker.finished:
            break
    assert tracker.token_ids == ids[:budget]
    assert tracker.finish_reason == ("length" if budget <= len(ids) else None)


def test_eos_inside_a_span_drops_it_and_what_follows(tiny_tokenizer):
    ids = tiny_tokenizer.encode("abc def", add_special_tokens=False)
    tracker = OutputTracker(tiny_tokenizer, GenerationRequest(prompt="p"), frozenset({999}))
    assert tracker.push([*ids, 999, ids[0]]) == len(ids)
    assert tracker.finish_reason == "eos"
    assert tracker.text == "abc def"


@pytest.fixture(scope="module")
def llama(tiny_model_paths):
    return AutoregressiveBackend.from_pretrained(tiny_model_paths["llama"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, 10_000), length=st.integers(1, 8), temperature=st.sampled_from([0.0, 1.0]))
def test_backend_stops_exactly_at_stops_that_span_tokens(llama, start, length, temperature):
    base = GenerationRequest(prompt="Résumé 東京:", max_tokens=40, temperature=temperature, seed=11)
    full = llama.complete(base).text
    start %= max(1, len(full))
    stop = full[start : start + length]
    if not stop:
        return
    request = base.model_copy(update={"stop": [stop]})
    chunks = list(llama.stream(request))
    result = chunks[-1].result
    expected = full[: full.find(stop)]
    assert result.text == expected
    assert "".join(c.delta for c in chunks) == expected
    assert result.finish_reason == "stop"
    assert llama.loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True) == expected
    assert result.usage.completion_tokens == len(result.token_ids)
