"""DSpark decoding on tiny random models: lossless greedy, distribution-preserving sampling, span policy."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from backends import AutoregressiveBackend, GenerationRequest, ModelLoadError
from backends.dspark.backend import DSparkBackend
from backends.dspark.model import DSparkModel
from backends.dspark.selection import SpanPolicy
from backends.dspark.verify import verify_greedy, verify_sampled
from backends.sampling import sample
from tests.conftest import ARCHITECTURES

NEAR_TIE = 1e-4
PROMPTS = ["def parse(value):\n    ", "import json\n\nclass Encoder:", "The result is", "x", "for i in range("]


def perturbed_heads_model(path, seed: int = 0) -> DSparkModel:
    """Fresh heads with random residual weights: their drafts are often wrong, so rollback is exercised."""
    model = DSparkModel.with_new_heads(AutoregressiveBackend.from_pretrained(path).loaded, num_heads=3)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.heads.weight.copy_(torch.randn(model.heads.weight.shape, generator=generator) * 0.5)
    return model


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request, tiny_model_paths):
    model = perturbed_heads_model(tiny_model_paths[request.param])
    return AutoregressiveBackend(model.loaded), model


def assert_equal_or_near_tie(model: DSparkModel, prompt: list[int], reference: list[int], got: list[int]) -> None:
    """Identical, or the first divergence sits where the reference's top two logits are within NEAR_TIE."""
    if got == reference:
        return
    i = next(i for i, (a, b) in enumerate(zip(reference, got)) if a != b)
    logits = model.loaded.model(torch.tensor([prompt + reference[:i]])).logits[0, -1]
    top2 = torch.topk(logits, 2)
    assert float(top2.values[0] - top2.values[1]) < NEAR_TIE, f"diverged at {i} without a near tie"
    assert got[i] in top2.indices.tolist()


@pytest.mark.parametrize("thresholds", [{2: 0.0, 4: 0.0}, {2: 0.3, 4: 0.6}])
def test_greedy_dspark_equals_greedy_ar(pair, thresholds):
    ar, model = pair
    dspark = DSparkBackend(model, SpanPolicy((1, 2, 4), thresholds))
    rejected = 0
    for prompt in PROMPTS:
        request = GenerationRequest(prompt=prompt, max_tokens=40, temperature=0.0)
        reference, result = ar.complete(request), dspark.complete(request)
        ids = ar.loaded.tokenizer(prompt)["input_ids"]
        assert_equal_or_near_tie(model, ids, reference.token_ids, result.token_ids)
        spans = result.stats.spans
        rejected += any(rate < 1.0 for rate in spans.acceptance_by_offset)
        assert result.stats.forward_passes == spans.steps + 1
    if thresholds[2] == 0.0:
        assert rejected, "no draft was ever rejected: rollback went untested"


def test_each_span_length_is_proposed_and_verified(pair):
    """The longest span every round, but for the last rounds: nothing is proposed past ``max_tokens``."""
    _, model = pair
    for lengths, expected in [((1,), 1), ((1, 2), 2), ((1, 2, 4), 4)]:
        dspark = DSparkBackend(model, SpanPolicy(lengths, {2: 0.0, 4: 0.0}))
        result = dspark.complete(GenerationRequest(prompt="def f(", max_tokens=24, temperature=0.0))
        spans = result.stats.spans
        shorter = sum(count for length, count in spans.proposed_span_hist.items() if length != expected)
        assert max(spans.proposed_span_hist) == expected and shorter < expected
        assert sum(spans.proposed_span_hist.values()) == spans.steps
        assert max(spans.accepted_span_hist) <= expected
        assert len(spans.acceptance_by_offset) == max(lengths) - 1


def test_unreachable_thresholds_fall_back_to_single_tokens(pair):
    _, model = pair
    dspark = DSparkBackend(model, SpanPolicy((1, 2, 4), {2: 1.01, 4: 1.01}))
    spans = dspark.complete(GenerationRequest(prompt="def f(", max_tokens=16, temperature=0.0)).stats.spans
    assert spans.proposed_span_hist == {1: spans.steps}
    assert spans.fallback_rate == 1.0


def test_request_options_override_the_pool(pair):
    _, model = pair
    dspark = DSparkBackend(model, SpanPolicy((1, 2, 4), {2: 0.0, 4: 0.0}))
    request = GenerationRequest(prompt="def f(", max_tokens=16, temperature=0.0, dspark={"max_span": 2})
    hist = dspark.complete(request).stats.spans.proposed_span_hist
    assert max(hist) == 2 and hist.get(1, 0) <= 1  # 1: only a last round that max_tokens cut short


def test_confidence_mode_commits_whole_spans(pair):
    _, model = pair
    dspark = DSparkBackend(model, SpanPolicy((1, 2, 4), {2: 0.0, 4: 0.0}, verification="confidence"))
    result = dspark.complete(GenerationRequest(prompt="def f(", max_tokens=40, temperature=0.0))
    assert result.stats.spans.acceptance_by_offset == [1.0, 1.0, 1.0]
    assert result.stats.spans.mean_accepted == 4.0


def test_verify_sampled_keeps_the_target_distribution():
    """Whatever the draft distribution q, the first committed token is distributed as the target p, and a bonus
    token after a fully accepted draft as the target's next row."""
    generator = torch.Generator().manual_seed(0)
    vocab, trials = 6, 20_000
    p = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, dim=0)
    q = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, dim=0)
    after = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, dim=0)
    first, bonus = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(trials):
        draft = int(sample(q, generator))
        accepted, next_token = verify_sampled([draft], q[None], torch.stack([p, after]), generator)
        first[draft if accepted else next_token] += 1
        if accepted:
            bonus[next_token] += 1
    assert 0.5 * (first / trials - p).abs().sum().item() < 0.015
    assert 0.5 * (bonus / bonus.sum() - after).abs().sum().item() < 0.02


def test_a_certain_draft_verifies_as_its_one_hot_distribution_draw_for_draw():
    """A looked-up block passes no draft distribution, each token certain under it (q = 1): seeded alike, it keeps
    the same tokens and draws the same correction or bonus as one-hot rows of the vocabulary would."""
    generator = torch.Generator().manual_seed(3)
    vocab, outcomes = 8, set()
    for trial in range(300):
        target = torch.softmax(torch.randn(4, vocab, generator=generator) * 3, dim=-1)
        draft = [int(sample(row, generator)) if trial % 2 else int(row.argmax()) for row in target[:3]]
        one_hot = torch.nn.functional.one_hot(torch.tensor(draft), vocab).float()
        certain = verify_sampled(draft, None, target, torch.Generator().manual_seed(trial))
        assert certain == verify_sampled(draft, one_hot, target, torch.Generator().manual_seed(trial))
        outcomes.add(certain[0])
    assert outcomes == {0, 1, 2, 3}


def test_drafted_rows_then_certain_tokens_verify_as_one_hot_rows_draw_for_draw():
    """A drafter's block with forced text after it passes rows for its own tokens only: the tokens past them are
    certain (q = 1), and seeded alike the round keeps and draws what full rows, one-hot past the block, would."""
    generator = torch.Generator().manual_seed(4)
    vocab, outcomes = 8, set()
    for trial in range(300):
        target = torch.softmax(torch.randn(5, vocab, generator=generator) * 3, dim=-1)
        drafted = torch.softmax(torch.randn(2, vocab, generator=generator), dim=-1)
        draft = [int(sample(row, generator)) for row in drafted] + [int(row.argmax()) for row in target[2:4]]
        rows = torch.cat([drafted, torch.nn.functional.one_hot(torch.tensor(draft[2:]), vocab).float()])
        partial = verify_sampled(draft, drafted, target, torch.Generator().manual_seed(trial))
        assert partial == verify_sampled(draft, rows, target, torch.Generator().manual_seed(trial))
        outcomes.add(partial[0])
    assert outcomes == {0, 1, 2, 3, 4}


def test_forced_tokens_are_kept_whatever_the_model_says():
    """Plain decoding commits the grammar's forced text without asking the model, so verification keeps a forced
    token even where the target's argmax differs or its probability is zero, and goes on checking after it."""
    logits = torch.tensor([[0.0, 5.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0], [0.0, 5.0, 0.0]])
    draft = [1, 2, 2]  # the argmax at 0 and 2, not at 1
    assert verify_greedy(draft, logits) == (1, 0)
    assert verify_greedy(draft, logits, None, [False, True, False]) == (3, 1)
    assert verify_greedy(draft, logits, None, [False, True, True]) == (3, 1)
    probs = torch.softmax(logits * 10, dim=-1)
    probs[1, 2] = 0.0
    generator = torch.Generator().manual_seed(0)
    assert verify_sampled(draft, None, probs, generator)[0] == 1
    assert verify_sampled(draft, None, probs, generator, forced=[False, True, False])[0] == 3


def test_a_draft_token_the_grammar_refuses_counts_as_a_rejection():
    """Under a grammar the draft is cut before a token the grammar refuses (p = 0 there). That token was drafted
    from q, so the token in its place must come from max(0, p - q): drawing it from p would over-weight what q
    already favoured. The committed token is then distributed as p."""
    generator = torch.Generator().manual_seed(1)
    vocab, trials, refused = 6, 20_000, {0, 1}
    p = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, dim=0)
    p[list(refused)] = 0.0
    p /= p.sum()
    q = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, dim=0)
    counts = torch.zeros(vocab)
    for _ in range(trials):
        draft = int(sample(q, generator))
        if draft in refused:  # cut from the draft, as propose() does
            _, token = verify_sampled([], q[:0], p[None], generator, refused_probs=q)
        else:
            accepted, token = verify_sampled([draft], q[None], torch.stack([p, p]), generator)
            token = draft if accepted else token
        counts[token] += 1
    assert 0.5 * (counts / trials - p).abs().sum().item() < 0.015


def _two_token_counts(dspark: DSparkBackend, prompt: str, trials: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(trials):
        result = dspark.complete(GenerationRequest(prompt=prompt, max_tokens=2, temperature=1.0, top_k=3, seed=seed))
        assert result.stats.spans.proposed_span_hist.get(2, 0) >= 1
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    return counts


def _exact_two_token_distribution(model: DSparkModel, ids: list[int]) -> dict[tuple[int, ...], float]:
    """What plain top-k-3 sampling of two tokens gives, computed from the base model's logits."""
    lm, exact = model.loaded.model, {}
    with torch.no_grad():
        top1 = torch.topk(torch.softmax(lm(torch.tensor([ids])).logits[0, -1], -1), 3)
        for p1, t1 in zip(top1.values / top1.values.sum(), top1.indices.tolist()):
            top2 = torch.topk(torch.softmax(lm(torch.tensor([[*ids, t1]])).logits[0, -1], -1), 3)
            for p2, t2 in zip(top2.values / top2.values.sum(), top2.indices.tolist()):
                exact[(t1, t2)] = float(p1 * p2)
    return exact


def _chi_square_p_value(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float]) -> float:
    if set(counts) - set(exact):
        return 0.0
    trials = sum(counts.values())
    observed = [counts.get(k, 0) for k in exact]
    total = sum(exact.values())
    expected = [v / total * trials for v in exact.values()]
    return float(chisquare(observed, expected).pvalue)


def test_sampled_dspark_matches_the_model_distribution(tiny_model_paths):
    """Exact verification reproduces plain sampling; confidence mode, as a control, is caught by the same test."""
    model = perturbed_heads_model(tiny_model_paths["llama"], seed=1)
    exact = _exact_two_token_distribution(model, model.loaded.tokenizer("def")["input_ids"])
    lossless = DSparkBackend(model, SpanPolicy((1, 2), {2: 0.0}))
    lossy = DSparkBackend(model, SpanPolicy((1, 2), {2: 0.0}, verification="confidence"))
    assert _chi_square_p_value(_two_token_counts(lossless, "def", 800), exact) > 1e-3
    assert _chi_square_p_value(_two_token_counts(lossy, "def", 800), exact) < 1e-3


def test_heads_save_and_load(tmp_path, tiny_model_paths):
    model = perturbed_heads_model(tiny_model_paths["gpt2"], seed=3)
    model.save(tmp_path / "m")
    loaded = DSparkModel.from_pretrained(tmp_path / "m")
    for a, b in zip(model.heads.state_dict().values(), loaded.heads.state_dict().values()):
        assert torch.equal(a, b)
    request = GenerationRequest(prompt="abc", max_tokens=12, temperature=0.0)
    assert DSparkBackend(loaded).complete(request).token_ids == DSparkBackend(model).complete(request).token_ids


def test_model_without_drafters_is_refused(tiny_model_paths):
    with pytest.raises(ModelLoadError, match=r"neither span heads .* nor a published drafter"):
        DSparkBackend.from_pretrained(tiny_model_paths["llama"])
    with pytest.raises(ModelLoadError, match="no DSpark heads"):
        DSparkBackend.from_pretrained(tiny_model_paths["llama"], drafter="heads")


def test_stop_strings_cut_spans(pair):
    ar, model = pair
    dspark = DSparkBackend(model, SpanPolicy((1, 2, 4), {2: 0.0, 4: 0.0}, verification="confidence"))
    full = dspark.complete(GenerationRequest(prompt="def f(", max_tokens=40, temperature=0.0)).text
    rng = random.Random(0)
    for _ in range(5):
        start = rng.randrange(len(full) - 3)
        stop = full[start : start + 3]
        result = dspark.complete(GenerationRequest(prompt="def f(", max_tokens=40, temperature=0.0, stop=[stop]))
        assert result.text == full[: full.find(stop)]
        assert ar.loaded.tokenizer.decode(result.token_ids) == result.text
