"""``bench decode`` end to end on a tiny random target carrying both drafters, with a prompts folder of the
shared format: the report's structure and invariants, and the plots (no timing is asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from backends.dspark.backend import DSparkBackend
from backends.dspark.drafter_config import DRAFTER_DIR
from backends.dspark.heads import DSparkConfig, SpanHeads
from backends.loading import load_model
from backends.modelfactory import save_pretrained
from backends.types import GenerationRequest
from benchmarks import decode, decode_sets
from tests.test_dspark_drafter import perturbed_drafter

PROMPT_SETS = {
    "code": ["Write a function that adds two numbers.", "Reverse a string in Python."],
    "math": ["What is 12 times 7? Reason step by step."],
}


@pytest.fixture(scope="module")
def both_drafters(tiny_model_paths, tmp_path_factory):
    """The tiny llama with span heads that always draft (thresholds 0) and a perturbed, "calibrated" published
    drafter beside it: both are often rejected, so rollback and every statistic see real numbers."""
    loaded = load_model(tiny_model_paths["llama"])
    folder = save_pretrained(loaded.model, loaded.tokenizer, tmp_path_factory.mktemp("bench") / "model")
    heads = DSparkConfig(num_heads=3, hidden_size=loaded.model.config.hidden_size, thresholds={2: 0.0, 4: 0.0})
    SpanHeads(heads).save(folder)
    drafter = perturbed_drafter(loaded, seed=2)
    drafter.config.confidence_temperatures = [1.5] * drafter.block_size
    drafter.save(folder / DRAFTER_DIR)
    return folder


def write_prompts(folder):
    folder.mkdir()
    for name, turns in PROMPT_SETS.items():
        rows = [{"id": f"{name}-{i}", "domain": name, "turns": [turn]} for i, turn in enumerate(turns)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_bench_decode_reports_both_drafters_side_by_side(both_drafters, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(both_drafters), "--prompts", str(write_prompts(tmp_path / "prompts")), "--per-set", "2",
         "--per-category", "1", "--max-tokens", "16", "--confidence-mode", "--json", str(tmp_path / "decode.json"),
         "--plots", str(tmp_path / "plots")]
    )  # fmt: skip
    assert decode.run(args) == 0
    report = json.loads((tmp_path / "decode.json").read_text())
    assert report["drafters"] == ["heads", "dspark", "hybrid", "lookup"]
    assert report["gguf"] is None and [n.split(":")[0] for n in report["notes"]] == ["no llama.cpp peer"]
    assert {"dspark_heads_confidence", "dspark_dspark_confidence"} <= set(report["contenders"])
    assert "dspark_hybrid_confidence" not in report["contenders"]
    expected = {*decode_sets.CATEGORIES, "code", "code_t1", "math", "math_t1"}
    assert set(report["sets"]) == expected
    assert report["lossless_mismatches"] == 0
    for name, entry in report["sets"].items():
        assert {"ar", "hf_greedy", "dspark_heads", "dspark_dspark", "dspark_lookup"} <= set(entry["tokens_per_s"])
        peers = entry["peer_tokens_per_forward"]
        assert peers["hf_greedy"] == 1.0, name  # plain decoding commits one token a forward: the count checked
        assert peers["hf_prompt_lookup"] >= 1.0, name
        for drafter, stats in entry["drafters"].items():
            assert stats["mean_accepted"] >= 1.0, (name, drafter)
            assert stats["mean_verified"] >= 0.0
            assert all(v is None or 0.0 <= v <= 1.0 for v in stats["conditional_acceptance"])
            assert stats["lossless_mismatches"] == (0 if entry["temperature"] == 0 else None)
    assert len(report["sets"]["code"]["drafters"]["dspark"]["conditional_acceptance"]) == 7
    for drafter in ("heads", "dspark"):
        probe = report["probe"][drafter]
        assert probe["anchors"] > 0
        assert all(v is None or 0.0 <= v <= 1.0 for v in probe["conditional_acceptance"])
        rates = [p["acceptance_rate"] for p in probe["threshold_sweep"]]
        assert all(r is None or 0.0 <= r <= 1.0 for r in rates)
    assert set(report["probe"]["dspark"]["reliability"]) == {"before", "after"}
    assert report["probe"]["heads"]["reliability"] is None
    for png in ("tokens_per_s", "acceptance_by_position", "threshold_sweep", "reliability"):
        assert (tmp_path / "plots" / f"{png}.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "lossless mismatches (greedy): 0" in out
    assert max(map(len, out.splitlines())) <= 80, out


def test_bench_decode_runs_heads_only_when_the_folder_has_no_published_drafter(tiny_model_paths, tmp_path):
    loaded = load_model(tiny_model_paths["gpt2"])
    folder = save_pretrained(loaded.model, loaded.tokenizer, tmp_path / "heads-only")
    SpanHeads(DSparkConfig(num_heads=2, hidden_size=loaded.model.config.hidden_size)).save(folder)
    drafters, notes = decode.choose_drafters(folder, None)
    assert drafters == ["heads"] and notes == ["heads-only has no dspark drafter: not benchmarked"]
    with pytest.raises(SystemExit, match="lookup"):
        decode.choose_drafters(folder, "lookup")
    with pytest.raises(SystemExit, match="dspark"):
        decode.choose_drafters(folder, "heads,dspark")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drafter", ["heads", "dspark"])
def test_round_counts_the_benchmark_pools_are_consistent(both_drafters, drafter, temperature):
    """Position k is reached only in rounds that verified it after accepting 0..k-1; every accepted draft token
    is counted once."""
    backend = DSparkBackend.from_pretrained(both_drafters, device="cpu")
    request = GenerationRequest(
        prompt="def f(", max_tokens=40, temperature=temperature, seed=0, dspark={"drafter": drafter}
    )
    spans = backend.complete(request).stats.spans
    reached, accepted = spans.reached_by_offset, spans.accepted_by_offset
    assert reached[0] == sum(count for n, count in spans.proposed_span_hist.items() if n > 1)
    assert all(a <= r for a, r in zip(accepted, reached))
    assert all(later <= a for later, a in zip(reached[1:], accepted))
    assert sum(accepted) == sum((n - 1) * count for n, count in spans.accepted_span_hist.items())


def test_each_variant_drafts_only_from_its_own_answers(both_drafters):
    """Every variant runs each prompt in turn on one backend: the hybrid must not draft the prompt's answer from the
    drafter's run just before it, nor from its warm-up, only (run again) from its own."""
    contenders = decode.Contenders(both_drafters, both_drafters, ["dspark", "hybrid"])
    runners = contenders.runners()
    request = GenerationRequest(prompt="Reverse a string in Python.", max_tokens=24, temperature=0.0)
    (warm_up,) = decode.warm_ups([decode_sets.PromptSet("code", 0.0, [request])])
    runners["dspark_hybrid"](warm_up)
    runners["dspark_dspark"](request)
    assert runners["dspark_hybrid"](request).spans.traffic_rounds == 0
    assert runners["dspark_hybrid"](request).spans.traffic_rounds > 0
