"""The published DSpark drafter on tiny random targets: lossless decoding, Algorithm 1, the published layout."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors import safe_open
from scipy.stats import chisquare

from backends import AutoregressiveBackend, GenerationRequest, InvalidRequestError
from backends.dspark import published_decode
from backends.dspark.backend import DEFAULT_DRAFTER, DEFAULT_LOOKUP, DSparkBackend
from backends.dspark.curves import machine_key
from backends.dspark.drafter import SHARED_WEIGHTS, DSparkDrafter
from backends.dspark.drafter_config import DRAFTER_DIR, WEIGHTS_FILE
from backends.dspark.heads import DSparkConfig, SpanHeads
from backends.dspark.model import DSparkModel
from backends.dspark.profile import PROFILE_FILE, load_or_profile
from backends.dspark.traffic import TrafficCaches
from backends.loading import load_model
from backends.modelfactory import build_model, save_pretrained
from backends.scheduling import DraftCost, SpsCurve, VerifySchedule, choose_lengths
from backends.traffic_settings import TrafficSettings
from router.config import PoolConfig
from router.pools import load_backend
from tests.conftest import ARCHITECTURES
from tests.test_dspark import PROMPTS, assert_equal_or_near_tie

# DeepSpec's Qwen3DSparkModel state dict for one layer, with the Markov and confidence heads.
PUBLISHED_WEIGHTS = {
    "embed_tokens.weight",
    "lm_head.weight",
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
    "markov_head.markov_w1.weight",
    "markov_head.markov_w2.weight",
    "confidence_head.proj.weight",
    "confidence_head.proj.bias",
    *(
        f"layers.0.{name}.weight"
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
    ),
}


def draft_subset(loaded) -> torch.Tensor:
    """Every other token id: a reduced draft vocabulary that leaves out tokens the target does emit."""
    return torch.arange(0, loaded.model.get_output_embeddings().weight.shape[0], 2)


def perturbed_drafter(loaded, seed: int = 0, layers: int = 1, draft_vocab: torch.Tensor | None = None) -> DSparkDrafter:
    """A drafter that is often right and often wrong: its Markov head holds the target's own next-token logits
    given the previous token alone (rank = vocab), replaced by noise for half of the previous tokens, on a random
    backbone with a random confidence head; over ``draft_vocab`` only, when given."""
    model = loaded.model
    vocab = model.get_output_embeddings().weight.shape[0]
    drafter = DSparkDrafter.for_target(
        model, loaded.tokenizer.pad_token_id, seed=seed, num_layers=layers, markov_rank=vocab, draft_vocab=draft_vocab
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bigram = model(input_ids=torch.arange(vocab)[:, None]).logits[:, -1].float()
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        wrong = torch.rand(vocab, generator=generator) < 0.5
        noise = torch.randn(bigram.shape, generator=generator) * bigram.std()
        transition = 3.0 * torch.where(wrong[:, None], noise, bigram).T
        drafter.markov_head.markov_w2.weight.copy_(transition if draft_vocab is None else transition[draft_vocab])
        drafter.confidence_head.proj.weight.copy_(
            torch.randn(drafter.confidence_head.proj.weight.shape, generator=generator)
        )
    return drafter.eval()


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory, tiny_tokenizer):
    return save_pretrained(
        build_model("qwen3", tiny_tokenizer, seed=7), tiny_tokenizer, tmp_path_factory.mktemp("q3") / "m"
    )


@pytest.fixture(scope="module", params=[*ARCHITECTURES, "qwen3", "qwen3-draft-vocab"])
def pair(request, tiny_model_paths, qwen3_path):
    path = qwen3_path if request.param.startswith("qwen3") else tiny_model_paths[request.param]
    ar = AutoregressiveBackend.from_pretrained(path)
    drafter = perturbed_drafter(ar.loaded, draft_vocab=draft_subset(ar.loaded) if "vocab" in request.param else None)
    # The drafter's and the copies' own rounds, without the traffic cache's: a random model's looping answers are
    # all cached after the first prompts, which would take the rounds these tests count (test_traffic has its own).
    off = TrafficCaches(TrafficSettings(enabled=False))
    return ar, DSparkBackend(None, drafter=drafter, default="dspark", loaded=ar.loaded, traffic=off)


SCHEDULES = {
    "block": VerifySchedule(),
    "threshold": VerifySchedule(threshold=0.5),
    "algorithm1": VerifySchedule(sps=SpsCurve({b: 100.0 / (1 + 0.2 * (b - 1)) for b in range(1, 9)})),
    # a drafter pass as dear as a forward: rounds whose mean survival cannot pay for it skip the drafter
    "costly_drafter": VerifySchedule(sps=SpsCurve({b: 100.0 for b in range(1, 9)}), draft_s=0.01),
    "lookup_beside": VerifySchedule(
        sps=SpsCurve({b: 100.0 / (1 + 0.2 * (b - 1)) for b in range(1, 9)}), lookup="beside"
    ),
    "lookup_only": VerifySchedule(lookup="only"),
}


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_greedy_published_drafter_equals_greedy_ar(pair, schedule):
    ar, dspark = pair
    dspark.schedule, dspark.draft_cost = schedule, DraftCost(schedule.draft_s)
    rejected = accepted = skipped = copied = 0
    for prompt in PROMPTS:
        request = GenerationRequest(prompt=prompt, max_tokens=40, temperature=0.0)
        reference, result = ar.complete(request), dspark.complete(request)
        ids = ar.loaded.tokenizer(prompt)["input_ids"]
        assert_equal_or_near_tie(DSparkModel(ar.loaded, None), ids, reference.token_ids, result.token_ids)
        spans = result.stats.spans
        verified = sum(n * count for n, count in spans.proposed_span_hist.items())
        rejected += sum(n * count for n, count in spans.accepted_span_hist.items()) < verified
        accepted += spans.mean_accepted > 1.0
        skipped += spans.fallback_steps
        copied += spans.copied_rounds
        assert result.stats.forward_passes == spans.steps + 1
    if schedule is SCHEDULES["costly_drafter"]:
        assert skipped, "no round skipped its drafter: the context's catching up went untested"
    if schedule.lookup != "off":
        assert copied, "no round verified a copied block"
    # A random model's greedy text loops, so copies of it are always right: lookup_only's rollback is tested by
    # the sampled test instead.
    assert rejected or schedule.lookup == "only", "no draft token was ever rejected: rollback went untested"
    assert accepted, "no draft token was ever accepted: multi-token commits went untested"


def test_the_budget_weighs_a_drafter_pass_at_its_cost_in_the_loop(qwen3_path):
    """A drafter pass is weighed at what passes have cost in this pool's loops, not at the load-time figure: two
    pools whose drafters both measured free at load, one of which really takes 30 ms a pass (a forward costs 10
    ms on this profile). The dear one learns its cost and skips its drafter where the survival cannot pay for
    it; the cheap one keeps drafting. The router's ``draft_s`` is the measured figure."""
    ar = AutoregressiveBackend.from_pretrained(qwen3_path)
    schedule = VerifySchedule(sps=SpsCurve({b: 100.0 for b in range(1, 9)}), draft_s=0.0, lookup="off")
    pools = {}
    for name, pause in (("cheap", 0.0), ("dear", 0.03)):
        drafter = perturbed_drafter(ar.loaded)
        hidden = drafter.draft_hidden

        def paused(*args, hidden=hidden, pause=pause, **kwargs):
            time.sleep(pause)
            return hidden(*args, **kwargs)

        drafter.draft_hidden = paused
        pools[name] = DSparkBackend(None, drafter=drafter, schedule=schedule, default="dspark", loaded=ar.loaded)
    drafted = {name: 0 for name in pools}
    for prompt in PROMPTS:
        request = GenerationRequest(prompt=prompt, max_tokens=40, temperature=0.0)
        reference = ar.complete(request).token_ids
        for name, pool in pools.items():
            result = pool.complete(request)
            assert result.token_ids == reference
            drafted[name] += result.stats.spans.steps - result.stats.spans.fallback_steps
    assert pools["dear"].draft_s == pools["dear"].draft_cost.seconds > 0.01 > pools["cheap"].draft_s
    assert drafted["cheap"] > 1.5 * drafted["dear"], drafted


def _block_counts(backend: DSparkBackend, trials: int, prompt: str = "def") -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    verified = 0
    for seed in range(trials):
        request = GenerationRequest(
            prompt=prompt, max_tokens=3, temperature=1.0, top_k=2, seed=seed, dspark={"max_span": 3}
        )
        result = backend.complete(request)
        verified += max(result.stats.spans.proposed_span_hist) >= 2
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    assert verified >= trials // 4, "too few drafts were verified for the test to mean anything"
    return counts


def _exact_block_distribution(model, ids: list[int], length: int, top_k: int) -> dict[tuple[int, ...], float]:
    """Plain top-k sampling of ``length`` tokens, enumerated from the target's logits."""
    exact = {(): 1.0}
    with torch.no_grad():
        for _ in range(length):
            grown = {}
            for prefix, p in exact.items():
                top = torch.topk(torch.softmax(model(torch.tensor([[*ids, *prefix]])).logits[0, -1], -1), top_k)
                for q, token in zip(top.values / top.values.sum(), top.indices.tolist()):
                    grown[(*prefix, token)] = p * float(q)
            exact = grown
    return exact


def _p_value(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float]) -> float:
    if set(counts) - set(exact):
        return 0.0
    trials, total = sum(counts.values()), sum(exact.values())  # float32 probabilities sum to 1 only roughly
    return float(chisquare([counts.get(k, 0) for k in exact], [v * trials / total for v in exact.values()]).pvalue)


@pytest.mark.parametrize("variant", ["full-vocab", "draft-vocab", "lookup"])
def test_sampled_blocks_follow_the_target_distribution(tiny_model_paths, variant):
    """A verified block of three tokens is distributed as plain sampling, also from a drafter that cannot propose
    half the tokens, and from copied blocks (one-hot drafts); committing drafts unverified (the lossy control) is
    caught by the same test."""
    loaded = load_model(tiny_model_paths["llama"])
    drafter = perturbed_drafter(loaded, seed=1, draft_vocab=draft_subset(loaded) if variant == "draft-vocab" else None)
    prompt = "def f(x): return x\ndef f(x): return x\ndef" if variant == "lookup" else "def"
    exact = _exact_block_distribution(loaded.model, loaded.tokenizer(prompt)["input_ids"], 3, 2)
    lookup = "only" if variant == "lookup" else "off"
    lossless = DSparkBackend(
        None, drafter=drafter, schedule=VerifySchedule(lookup=lookup), default="dspark", loaded=loaded
    )
    lossy = DSparkBackend(
        None,
        drafter=drafter,
        schedule=VerifySchedule(verification="confidence", lookup=lookup),
        default="dspark",
        loaded=loaded,
    )
    assert _p_value(_block_counts(lossless, 300, prompt), exact) > 1e-3
    assert _p_value(_block_counts(lossy, 150, prompt), exact) < 1e-3
    if variant == "lookup":  # what the pool's copies earned is measured only where they were verified
        assert lossless.copies.kinds and not lossy.copies.kinds


def test_algorithm1_stops_early_where_a_retrospective_search_would_not():
    """SPS falls steeply at first and then flattens: the best prefix overall verifies three tokens, but the
    second candidate already fails to improve tau * SPS, so the non-anticipating rule stops at one."""
    sps = SpsCurve({1: 100.0, 2: 60.0, 3: 40.0, 4: 35.0})
    survival = [0.9, 0.81, 0.729]
    values = [sum([1.0, *survival[:n]]) * sps.at(1 + n) for n in range(4)]
    assert max(range(4), key=values.__getitem__) == 3
    assert choose_lengths([survival], sps) == [1]


def test_algorithm1_shrinks_each_requests_budget_under_load():
    """Light load: long verification is nearly free; with more requests in the batch the same confidences buy
    fewer verified tokens each, and the most confident requests keep the most."""
    sps = SpsCurve({b: 100.0 * min(1.0, 16 / b) for b in range(1, 65)})
    confident, unsure = [0.95**k for k in range(1, 8)], [0.6**k for k in range(1, 8)]
    light = choose_lengths([confident], sps)
    heavy = choose_lengths([confident] * 4 + [unsure] * 4, sps)
    assert light == [7]
    assert heavy == [2, 2, 2, 2, 0, 0, 0, 0]


def test_a_curve_interpolates_forward_time_between_profiled_lengths_and_scales_beyond():
    """Profiled lengths as measured, a length between two weighed by forward time (not rate), one past the longest
    compute-bound."""
    sps = SpsCurve({1: 200.0, 4: 100.0, 8: 50.0})
    assert sps.at(4) == 100.0 and sps.at(8) == 50.0
    assert sps.at(2) == pytest.approx(1 / (2 / 3 / 200 + 1 / 3 / 100))
    assert sps.at(6) == pytest.approx(1 / (0.5 / 100 + 0.5 / 50))
    assert sps.at(16) == pytest.approx(25.0)


def test_published_layout_round_trips_beside_a_qwen3_target(qwen3_path, tmp_path):
    """Saved, a drafter carries its own weights only (the target's embedding and LM head come from the target);
    exported, the whole published layout, which loads back to the same drafter."""
    loaded = load_model(qwen3_path)
    target = save_pretrained(loaded.model, loaded.tokenizer, tmp_path / "target")
    drafter = perturbed_drafter(loaded, seed=3)
    drafter.save(target / DRAFTER_DIR)
    with safe_open(target / DRAFTER_DIR / WEIGHTS_FILE, "pt") as weights:
        assert set(weights.keys()) == PUBLISHED_WEIGHTS - set(SHARED_WEIGHTS)
    drafter.export(target / DRAFTER_DIR)
    config = json.loads((target / DRAFTER_DIR / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 7 and config["num_hidden_layers"] == 1
    assert config["num_target_layers"] == 2 and config["target_layer_ids"] == [0]
    assert config["markov_head_type"] == "vanilla" and config["confidence_head_with_markov"] is True
    assert {"mask_token_id", "markov_rank", "enable_confidence_head", "tie_word_embeddings"} <= set(config)
    with safe_open(target / DRAFTER_DIR / WEIGHTS_FILE, "pt") as weights:
        assert set(weights.keys()) == PUBLISHED_WEIGHTS

    backend = DSparkBackend.from_pretrained(target, drafter="dspark")
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, backend.drafter.state_dict()[name]), name
    assert (target / PROFILE_FILE).is_file()
    in_memory = DSparkBackend(None, drafter=drafter, schedule=backend.schedule, default="dspark", loaded=loaded)
    for prompt in PROMPTS[:3]:
        request = GenerationRequest(prompt=prompt, max_tokens=24, temperature=0.0)
        assert backend.complete(request).token_ids == in_memory.complete(request).token_ids


def test_profile_is_measured_once_per_machine_and_reused(qwen3_path, tmp_path):
    loaded = load_model(qwen3_path)
    curve = load_or_profile(tmp_path, loaded, 4)
    stored = json.loads((tmp_path / PROFILE_FILE).read_text())
    assert set(stored) == {machine_key(loaded.device, loaded.precision)} and sorted(curve.steps_per_s) == [1, 2, 3, 4]
    assert load_or_profile(tmp_path, loaded, 4) == curve


def test_drafter_runs_in_bfloat16_like_float32(qwen3_path):
    loaded = load_model(qwen3_path)
    drafter = perturbed_drafter(loaded, seed=4)
    features = torch.randn(6, drafter.config.context_width, generator=torch.Generator().manual_seed(0))
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        loaded.model.to(dtype)
        drafter.to(dtype)
        context = drafter.new_context()
        drafter.extend_context(context, features.to(dtype))
        hidden = drafter.draft_hidden(context, anchor=5)
        assert hidden.dtype == dtype and torch.isfinite(hidden).all()
        outputs[dtype] = hidden.float()
        backend = DSparkBackend(None, drafter=drafter, default="dspark", loaded=loaded)
        result = backend.complete(GenerationRequest(prompt="x = ", max_tokens=12, temperature=1.0, seed=0))
        assert len(result.token_ids) == 12
    loaded.model.to(torch.float32)
    assert torch.nn.functional.cosine_similarity(outputs[torch.float32], outputs[torch.bfloat16], dim=-1).min() > 0.98


@pytest.fixture(scope="module")
def stop_backends(tiny_model_paths):
    ar = AutoregressiveBackend.from_pretrained(tiny_model_paths["llama"])
    return ar, DSparkBackend(None, drafter=perturbed_drafter(ar.loaded, seed=5), default="dspark", loaded=ar.loaded)


def test_stop_strings_cut_published_drafter_spans(stop_backends):
    """Grammars under this drafter run in tests/test_structured_decoding.py with the other backends."""
    ar, dspark = stop_backends
    full = dspark.complete(GenerationRequest(prompt="def f(", max_tokens=40, temperature=0.0)).text
    for start in (3, 11, 20):
        stop = full[start : start + 3]
        result = dspark.complete(GenerationRequest(prompt="def f(", max_tokens=40, temperature=0.0, stop=[stop]))
        assert result.text == full[: full.find(stop)]
        assert ar.loaded.tokenizer.decode(result.token_ids) == result.text


def test_pool_and_request_choose_the_drafter(tiny_model_paths, tmp_path):
    loaded = load_model(tiny_model_paths["gpt2"])
    folder = save_pretrained(loaded.model, loaded.tokenizer, tmp_path / "both")
    SpanHeads(DSparkConfig(num_heads=3, hidden_size=loaded.model.config.hidden_size)).save(folder)
    perturbed_drafter(loaded, seed=6).save(folder / DRAFTER_DIR)
    backend = load_backend(PoolConfig(backend="dspark", model=str(folder), drafter="dspark"))
    assert backend.default == "dspark"
    by_drafter = {}
    for drafter in ("heads", "dspark"):
        request = GenerationRequest(prompt="x", max_tokens=8, temperature=0.0, dspark={"drafter": drafter})
        by_drafter[drafter] = backend.complete(request)
        assert len(by_drafter[drafter].stats.spans.acceptance_by_offset) == (3 if drafter == "heads" else 7)
    assert by_drafter["heads"].token_ids == by_drafter["dspark"].token_ids
    capped = backend.complete(GenerationRequest(prompt="x", max_tokens=8, temperature=0.0, dspark={"max_span": 2}))
    assert max(capped.stats.spans.proposed_span_hist) <= 2
    heads_only = DSparkBackend(backend.model)
    with pytest.raises(InvalidRequestError, match="no published drafter"):
        heads_only.complete(GenerationRequest(prompt="x", max_tokens=4, temperature=0.0, dspark={"drafter": "dspark"}))
    unnamed = load_backend(PoolConfig(backend="dspark", model=str(folder)))
    assert (unnamed.default, unnamed.schedule.lookup) == (DEFAULT_DRAFTER, DEFAULT_LOOKUP) == ("dspark", "beside")
    assert unnamed.draft_s > 0  # the hybrid drafts: the router weighs its pass
    copies = load_backend(PoolConfig(backend="dspark", model=str(folder), decoding={"lookup": "only"}))
    assert (copies.default, copies.schedule.lookup) == ("dspark", "only")
    assert copies.draft_s == 0.0  # copies are looked up: no drafter pass for the router to weigh


def test_draft_probabilities_are_the_ones_sampled_from(qwen3_path):
    """Each draft row is a distribution and its token has mass there: what min(1, p/q) divides by."""
    loaded = load_model(qwen3_path)
    drafter = perturbed_drafter(loaded, seed=8)
    context = drafter.new_context()
    drafter.extend_context(context, torch.randn(5, drafter.config.context_width))
    request = GenerationRequest(prompt="x", temperature=0.8, top_k=5)
    block = published_decode.draft(drafter, context, 3, request, torch.Generator().manual_seed(0), 7)
    assert block.probs.shape == (7, drafter.config.vocab_size)
    assert torch.allclose(block.probs.sum(-1), torch.ones(7))
    assert all(block.probs[k, t] > 0 for k, t in enumerate(block.tokens))
    assert len(block.confidence) == 7 and all(0.0 < c < 1.0 for c in block.confidence)


def test_export_widens_a_draft_vocabulary_to_the_whole_one(qwen3_path, tmp_path):
    """DeepSpec's readers know no draft vocabulary: the export's Markov projection covers every token, zero on
    the rows this drafter never proposes, and its config says nothing of a subset."""
    loaded = load_model(qwen3_path)
    subset = draft_subset(loaded)
    drafter = perturbed_drafter(loaded, seed=5, draft_vocab=subset)
    drafter.export(tmp_path / "exported")
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert "draft_vocab_size" not in config
    with safe_open(tmp_path / "exported" / WEIGHTS_FILE, "pt") as weights:
        assert "draft_vocab" not in set(weights.keys())
        w2 = weights.get_tensor("markov_head.markov_w2.weight")
    assert w2.shape[0] == config["vocab_size"]
    assert torch.equal(w2[subset], drafter.markov_head.markov_w2.weight.detach())
    assert not w2[1::2].any()


def test_a_machine_without_its_own_curve_takes_the_closest():
    """Another model of the same chip family runs the same precision alike: its curve beats one of another
    precision; a machine like none stored takes the last stored, and an empty file gives none."""
    from backends.dspark.curves import closest_curve

    xeon, epyc = "cpu:Intel(R) Xeon(R) Processor|torch.bfloat16|threads=2", "cpu:AMD EPYC|torch.float32|threads=2"
    curves = {xeon: {"1": 23.0}, epyc: {"1": 15.0}, "cpu:AMD EPYC|torch.float32|threads=1": {"1": 14.0}}
    assert closest_curve(curves, xeon) == {"1": 23.0}
    assert closest_curve(curves, "cpu:Intel(R) Xeon(R) Platinum 8480+|torch.bfloat16|threads=2") == {"1": 23.0}
    assert closest_curve(curves, "cpu:Intel(R) Xeon(R) Platinum 8480+|torch.float32|threads=2") == {"1": 15.0}
    assert closest_curve(curves, "cpu:Intel(R) Core(TM)|torch.bfloat16|threads=8") == {"1": 23.0}
    assert closest_curve(curves, "cuda:NVIDIA H200|torch.float16|threads=8") == {"1": 14.0}
    assert closest_curve(curves, None) == {"1": 14.0} and closest_curve({}, xeon) is None
