"""The drafters' training pipeline on a tiny frozen target, as a user runs it: ``train data``, ``train dspark``,
``train heads``, ``train export``. The losses fall, checkpoints resume, STS calibrates, and what it writes loads
in the DSpark pool beside the target (``drafter_path``) and decodes losslessly."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from backends import AutoregressiveBackend, GenerationRequest, loading
from backends.corpus.recipe import MANIFEST_FILE
from backends.dspark.backend import DSparkBackend, load_drafter
from backends.dspark.drafter_config import DRAFTER_DIR, WEIGHTS_FILE
from backends.dspark.heads import WEIGHTS_FILE as HEADS_WEIGHTS
from backends.dspark.heads import DSparkConfig
from backends.loading import load_model
from backends.modelfactory import build_model, save_pretrained
from backends.training import drafter as drafter_training
from backends.training.checkpoints import (
    CHECKPOINT_DIR,
    HELD_OUT_PER_FAMILY,
    Lineage,
    read_trained_on,
    split_sequences,
    write_trained_on,
)
from backends.training.commands import VOCAB_FILE
from backends.training.dataset import DISTILL_FILE, FOLLOW_UPS_FILE, STAGE_FILES
from backends.training.distill import Distilled, read_distilled
from backends.training.features import FeatureCache, sample_within
from backends.training.heads import REPORT_FILE as HEADS_REPORT
from backends.training.heads import HeadsTrainConfig
from router.cli import main

DRAFT_VOCAB = 256


@pytest.fixture(scope="module")
def sharp_target(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny Qwen3 whose final norm is scaled up: peaked next-token distributions, as a trained model has, so
    acceptance varies from token to token and there is something for the confidence head to predict."""
    model = build_model("qwen3", tiny_tokenizer, seed=11)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    return save_pretrained(model, tiny_tokenizer, tmp_path_factory.mktemp("sharp") / "target")


RECIPE = ["--subtasks", "12", "--stdlib", "6", "--synthesised", "7", "--follow-ups", "3", "--max-tokens", "24"]


@pytest.fixture(scope="module")
def run_dir(sharp_target, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    argv = ["train", "data", "--target", str(sharp_target), "--run", str(run)]
    assert main([*argv, *RECIPE, "--batch", "6"]) == 0
    return run


@pytest.fixture(scope="module")
def drafters(sharp_target, run_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("drafters")
    common = ["--target", str(sharp_target), "--run", str(run_dir), "--vocab-size", str(DRAFT_VOCAB)]
    dspark = ["train", "dspark", *common, "--output", str(folder / DRAFTER_DIR), "--steps", "30"]
    dspark += ["--batch-size", "3", "--anchors", "4", "--draft-layers", "1", "--markov-rank", "16"]
    assert main([*dspark, "--warmup", "2", "--lr", "3e-3", "--checkpoint-every", "10"]) == 0
    heads = ["train", "heads", *common, "--output", str(folder), "--steps", "30", "--positions", "64"]
    assert main([*heads, "--warmup", "2", "--lr", "1e-2", "--checkpoint-every", "10"]) == 0
    return folder


def features_of_answers(target: Path, answered: Path, run: Path, *flags: str) -> FeatureCache:
    """``train data`` with ``flags`` in a new ``run`` holding ``answered``'s answers (so none are made again)."""
    run.mkdir(exist_ok=True)
    for name in (*STAGE_FILES, MANIFEST_FILE):
        if (answered / name).is_file():
            shutil.copy(answered / name, run / name)
    argv = ["train", "data", "--target", str(target), "--run", str(run), *RECIPE, "--batch", "6"]
    assert main([*argv, *flags]) == 0
    return FeatureCache.load(run)


def test_data_holds_the_targets_own_greedy_answers_and_their_features(sharp_target, run_dir):
    records = read_distilled(run_dir / DISTILL_FILE) + read_distilled(run_dir / FOLLOW_UPS_FILE)
    assert {"subtask", "stdlib"} <= {r.source.split(":")[0] for r in records} and len(records) >= 18
    ar = AutoregressiveBackend.from_pretrained(sharp_target)
    record = records[0]
    reference = ar.complete(GenerationRequest(prompt="x", max_tokens=1))  # warm the engine
    assert reference.token_ids
    cache = FeatureCache.load(run_dir)
    assert cache.sequences == len(records) and cache.tokens.tolist()[: len(record.tokens)] == record.tokens
    loaded = load_model(sharp_target)
    with torch.no_grad():
        out = loaded.model(input_ids=torch.tensor([record.tokens]), output_hidden_states=True)
    rows = cache.span(0)
    assert cache.final.dtype == cache.features.dtype == torch.bfloat16  # train data's default, a few kB a token
    torch.testing.assert_close(cache.final[rows].float(), out.hidden_states[-1][0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(cache.lse[rows], torch.logsumexp(out.logits[0], -1), rtol=1e-4, atol=1e-4)
    assert torch.equal(out.logits[0, len(record.prompt) - 1 : -1].argmax(-1), torch.tensor(record.completion))
    coverage = json.loads((run_dir / VOCAB_FILE).read_text())["coverage"]
    assert list(coverage.values()) == sorted(coverage.values()) and max(coverage.values()) == 1.0


def test_features_of_a_sample_within_a_token_budget(sharp_target, run_dir, tmp_path):
    """``--feature-tokens``: the cache covers a seeded sample of the answered corpus, in corpus order, within the
    budget; the answers are the run's own, not made again."""
    records = read_distilled(run_dir / DISTILL_FILE) + read_distilled(run_dir / FOLLOW_UPS_FILE)
    budget = sum(len(r.tokens) for r in records) // 2
    cache = features_of_answers(sharp_target, run_dir, tmp_path, "--feature-tokens", str(budget))
    assert 0 < cache.sequences < len(records) and len(cache.tokens) <= budget
    corpus = [r.tokens for r in records]
    positions = [corpus.index(cache.tokens[cache.span(i)].tolist()) for i in range(cache.sequences)]
    assert positions == sorted(positions)
    assert sample_within(records, budget, 0) == sample_within(records, budget, 0) != sample_within(records, budget, 1)
    assert cache.keys == [records[p].key for p in positions]


def test_a_sample_keeps_each_sources_share_and_replays_seen_text_only_where_a_source_runs_out():
    """``sample_within`` with a lineage: a source with enough unseen text gives only unseen text; a source with
    too little gives all of it and fills its share with text the lineage saw; every source keeps its share."""
    records = [Distilled(i, "synth:code", [1] * 4, [2] * 6) for i in range(20)]
    records += [Distilled(i, "subtask:rewriting", [1] * 4, [2] * 6) for i in range(20)]
    seen = frozenset(r.key for r in records if r.source == "subtask:rewriting" and r.index >= 4)
    seen |= {r.key for r in records if r.source == "synth:code" and r.index >= 15}
    sample = sample_within(records, 200, 0, seen)
    by_source = Counter(r.source for r in sample)
    assert by_source == {"synth:code": 10, "subtask:rewriting": 10}
    assert not any(r.key in seen for r in sample if r.source == "synth:code")
    rewriting = [r for r in sample if r.source == "subtask:rewriting"]
    assert sum(r.key in seen for r in rewriting) == 6 and {r.index for r in rewriting} >= {0, 1, 2, 3}
    assert sample == sample_within(records, 200, 0, seen) != sample_within(records, 200, 1, seen)
    assert sample_within(records, 400, 0, seen) == records


def test_a_continued_run_holds_out_unseen_text_of_every_family(tmp_path):
    """A continued run's held-out sequences are ones its lineage never saw, drawn from every source family (at
    least the floor, or all of a family's unseen ones where it has fewer) even where one family fills the cache;
    a fresh run's split is the plain seeded one."""
    keys = [f"synth:code#{i}" for i in range(400)] + [f"stdlib:code#{i}" for i in range(40)]
    keys += [f"subtask:qa_context#{i}" for i in range(40)]
    rng = random.Random(0)
    rng.shuffle(keys)
    earlier = frozenset(k for k in keys if not k.startswith("synth") and int(k.split("#")[1]) >= 10)
    earlier |= {f"synth:code#{i}" for i in range(200)}
    write_trained_on(tmp_path, earlier)
    lineage = Lineage.split(keys, len(keys), 0, 0.05, tmp_path)
    held = [keys[i] for i in lineage.held_out]
    assert not set(held) & earlier and sorted(lineage.held_out + lineage.training) == list(range(len(keys)))
    assert Counter(k.split(":")[0] for k in held) == {"synth": HELD_OUT_PER_FAMILY, "stdlib": 10, "subtask": 10}
    assert len({k.split(":")[0] for k in held[: len(held) // 2]}) == 3  # STS's half and the measured half both mix
    fresh = Lineage.split(keys, len(keys), 0, 0.05, None)
    assert (fresh.held_out, fresh.training) == split_sequences(len(keys), 0, 0.05)


def test_features_of_text_a_drafter_never_saw_continue_it(sharp_target, run_dir, drafters, tmp_path):
    """A drafter records what it trained on (its cache's training split); ``--feature-lineage`` samples per source
    what it never saw first, and a run continued on that measures on text the lineage never saw and records
    what it replayed beside its lineage's."""
    full = FeatureCache.load(run_dir)
    training = split_sequences(full.sequences, 0, drafter_training.DrafterTrainConfig.holdout)[1]
    assert read_trained_on(drafters / DRAFTER_DIR) == {full.keys[i] for i in training}
    source = tmp_path / "half-trained"  # the tiny corpus's training split leaves too little to continue on
    shutil.copytree(drafters / DRAFTER_DIR, source)
    seen = frozenset(full.keys[: full.sequences // 2])
    write_trained_on(source, seen)
    records = read_distilled(run_dir / DISTILL_FILE) + read_distilled(run_dir / FOLLOW_UPS_FILE)
    budget = str(sum(len(r.tokens) for r in records) * 3 // 4)
    run = tmp_path / "run"
    flags = ["--feature-tokens", budget, "--feature-lineage", str(source)]
    cache = features_of_answers(sharp_target, run_dir, run, *flags)
    assert cache.keys == [r.key for r in sample_within(records, int(budget), 0, seen)]
    assert set(cache.keys) & seen and set(cache.keys) - seen
    output = tmp_path / "continued"
    argv = ["train", "dspark", "--target", str(sharp_target), "--run", str(run), "--steps", "2", "--batch-size", "3"]
    assert main([*argv, "--anchors", "4", "--init-from", str(source), "--output", str(output)]) == 0
    continued = read_trained_on(output)
    held_out = [key for key in cache.keys if key not in continued]
    assert continued == seen | set(cache.keys) - set(held_out)
    assert set(held_out) == set(cache.keys) - seen  # every family has fewer unseen than the floor: all held out
    kinds = json.loads((output / drafter_training.REPORT_FILE).read_text())["acceptance_by_kind"]
    assert {kind: m["sequences"] for kind, m in kinds.items()} == Counter(k.rsplit("#", 1)[0] for k in held_out)
    for measured in kinds.values():
        assert len(measured["acceptance_by_position"]) == len(measured["initial_acceptance_by_position"]) == 7
        assert measured["expected_tokens"] == drafter_training.tokens_a_round(measured["acceptance_by_position"])
        greedy = measured["greedy_acceptance_by_position"]
        assert len(greedy) == len(measured["initial_greedy_acceptance_by_position"]) == 7
        assert measured["greedy_expected_tokens"] == drafter_training.tokens_a_round(greedy)


def test_a_lineage_without_a_token_budget_is_refused_before_any_work(tmp_path):
    """Without ``--feature-tokens`` every sequence is cached, so ``--feature-lineage`` alone would choose nothing:
    the command says so instead of running as if it were not given."""
    argv = ["train", "data", "--target", str(tmp_path / "absent"), "--run", str(tmp_path / "run")]
    with pytest.raises(SystemExit, match="--feature-tokens"):
        main([*argv, "--feature-lineage", str(tmp_path / "drafter")])
    assert not (tmp_path / "run").exists()


def test_both_drafters_learn_and_decode_losslessly_from_their_own_folder(sharp_target, drafters):
    report = json.loads((drafters / DRAFTER_DIR / drafter_training.REPORT_FILE).read_text())
    assert report["final_loss"] < report["first_loss"]
    assert len(report["acceptance_by_position"]) == 7 and len(report["temperatures"]) == 7
    heads = json.loads((drafters / HEADS_REPORT).read_text())
    assert heads["curve"][-1]["loss"] < heads["curve"][0]["loss"]
    with safe_open(drafters / DRAFTER_DIR / WEIGHTS_FILE, "pt") as weights:
        assert "lm_head.weight" not in set(weights.keys()), "the target's LM head is not stored again"
        assert weights.get_tensor("draft_vocab").shape == (DRAFT_VOCAB,)
    ar = AutoregressiveBackend.from_pretrained(sharp_target)
    for drafter in ("heads", "dspark"):
        backend = DSparkBackend.from_pretrained(sharp_target, drafter=drafter, drafter_path=drafters)
        for prompt in ("def parse(", "The city is"):
            request = GenerationRequest(prompt=prompt, max_tokens=24, temperature=0.0)
            assert backend.complete(request).token_ids == ar.complete(request).token_ids, drafter


def test_all_stages_run_in_one_process_on_the_device_there_is(sharp_target, run_dir, tmp_path):
    """``train all`` (the GPU recipe): the corpus resumes from ``train data``'s files, the features stay in memory,
    and both drafters it writes decode losslessly; on a CUDA machine it trains there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    output = tmp_path / "drafters"
    argv = ["train", "all", "--target", str(sharp_target), "--run", str(run_dir), "--output", str(output)]
    argv += [*RECIPE, "--batch", "6", "--device", device, "--vocab-size", str(DRAFT_VOCAB), "--warmup", "2"]
    argv += ["--heads-steps", "20", "--positions", "64", "--dspark-steps", "20", "--batch-size", "3", "--anchors", "4"]
    assert main([*argv, "--draft-layers", "1", "--markov-rank", "16", "--checkpoint-every", "10"]) == 0
    report = json.loads((output / DRAFTER_DIR / drafter_training.REPORT_FILE).read_text())
    assert report["final_loss"] < report["first_loss"]
    ar = AutoregressiveBackend.from_pretrained(sharp_target)
    request = GenerationRequest(prompt="def parse(", max_tokens=24, temperature=0.0)
    for drafter in ("heads", "dspark"):
        backend = DSparkBackend.from_pretrained(sharp_target, drafter=drafter, drafter_path=output)
        assert backend.complete(request).token_ids == ar.complete(request).token_ids, drafter


def test_training_resumes_from_its_checkpoint(sharp_target, run_dir, drafters):
    output = drafters / DRAFTER_DIR
    argv = ["train", "dspark", "--target", str(sharp_target), "--run", str(run_dir), "--output", str(output)]
    argv += ["--steps", "34", "--batch-size", "3", "--anchors", "4", "--draft-layers", "1", "--markov-rank", "16"]
    assert main([*argv, "--vocab-size", str(DRAFT_VOCAB)]) == 0
    state = torch.load(output / CHECKPOINT_DIR / "trainer_state.pt", weights_only=True)
    assert state["step"] == 34
    assert math.isnan(json.loads((output / drafter_training.REPORT_FILE).read_text())["first_loss"])


def test_training_continues_from_a_trained_drafter(sharp_target, run_dir, drafters, tmp_path):
    """``--init-from``: a run starts from a shipped drafter (its shape and draft vocabulary, whatever the command
    line's defaults say) where that one's training ended, below a fresh drafter's loss, and reports the shipped
    one's acceptance on the same held-out blocks."""
    source = drafters / DRAFTER_DIR
    trained = json.loads((source / drafter_training.REPORT_FILE).read_text())
    argv = ["train", "dspark", "--target", str(sharp_target), "--run", str(run_dir), "--steps", "3"]
    argv += ["--batch-size", "3", "--anchors", "4", "--draft-layers", "1", "--markov-rank", "16"]
    fresh, continued = tmp_path / "fresh", tmp_path / "continued"
    assert main([*argv, "--vocab-size", str(DRAFT_VOCAB), "--output", str(fresh)]) == 0
    assert main([*argv, "--init-from", str(source), "--output", str(continued)]) == 0
    report = json.loads((continued / drafter_training.REPORT_FILE).read_text())
    assert report["first_loss"] < json.loads((fresh / drafter_training.REPORT_FILE).read_text())["first_loss"]
    initial = report["initial_acceptance_by_position"]
    assert initial == pytest.approx(trained["acceptance_by_position"], abs=0.02)  # saved in bfloat16
    with safe_open(continued / WEIGHTS_FILE, "pt") as weights, safe_open(source / WEIGHTS_FILE, "pt") as shipped:
        assert torch.equal(weights.get_tensor("draft_vocab"), shipped.get_tensor("draft_vocab"))


def test_a_deeper_drafter_starts_as_the_trained_one(sharp_target, run_dir, drafters, tmp_path):
    """``--init-from`` with more ``--draft-layers`` than the trained drafter has appends layers that add nothing
    yet: the deeper drafter's block pass equals the trained one's exactly, its run starts from the trained one's
    held-out acceptance, and its folder loads with the new depth; a run asking for fewer layers is refused."""
    source = drafters / DRAFTER_DIR
    loaded = load_model(sharp_target)
    shallow = drafter_training.trained_drafter(loaded, source)
    deep = drafter_training.deepened(drafter_training.trained_drafter(loaded, source), 3)
    assert (len(shallow.layers), len(deep.layers), deep.config.num_hidden_layers) == (1, 3, 3)
    features = torch.randn(5, shallow.config.context_width, generator=torch.Generator().manual_seed(0))
    contexts = shallow.new_context(), deep.new_context()
    shallow.extend_context(contexts[0], features)
    deep.extend_context(contexts[1], features)
    assert torch.equal(deep.draft_hidden(contexts[1], 3), shallow.draft_hidden(contexts[0], 3))
    assert not torch.equal(deep.layers[2].mlp.up_proj.weight, torch.zeros_like(deep.layers[2].mlp.up_proj.weight))

    argv = ["train", "dspark", "--target", str(sharp_target), "--run", str(run_dir), "--steps", "2"]
    argv += ["--batch-size", "3", "--anchors", "4", "--init-from", str(source)]
    assert main([*argv, "--draft-layers", "2", "--output", str(tmp_path / "deep")]) == 0
    report = json.loads((tmp_path / "deep" / drafter_training.REPORT_FILE).read_text())
    trained = json.loads((source / drafter_training.REPORT_FILE).read_text())
    assert report["initial_acceptance_by_position"] == pytest.approx(trained["acceptance_by_position"], abs=0.02)
    assert load_drafter(loaded, tmp_path / "deep").config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="only added"):
        main([*argv, "--draft-layers", "0", "--output", str(tmp_path / "shallower")])


def test_span_heads_continue_from_trained_heads(sharp_target, run_dir, drafters, tmp_path):
    """``train heads --init-from``: heads go on from trained ones with their own vocabulary and tuned thresholds
    (the command line names neither), report those heads' accuracy on the same held-out positions before the run,
    and record the sequences the run trained on."""
    tuned = tmp_path / "tuned"
    shutil.copytree(drafters, tuned, ignore=shutil.ignore_patterns(DRAFTER_DIR, CHECKPOINT_DIR))
    config = DSparkConfig.load(tuned)
    config.thresholds = {2: 0.3, 4: 0.7}
    config.save(tuned)
    output = tmp_path / "continued"
    argv = ["train", "heads", "--target", str(sharp_target), "--run", str(run_dir), "--output", str(output)]
    assert main([*argv, "--steps", "3", "--positions", "64", "--init-from", str(tuned)]) == 0
    report = json.loads((output / HEADS_REPORT).read_text())
    trained = json.loads((drafters / HEADS_REPORT).read_text())
    assert report["initial_accuracy_by_head"] == pytest.approx(trained["accuracy_by_head"], abs=0.02)
    assert DSparkConfig.load(output).thresholds == {2: 0.3, 4: 0.7}
    with safe_open(output / HEADS_WEIGHTS, "pt") as weights, safe_open(tuned / HEADS_WEIGHTS, "pt") as source:
        assert torch.equal(weights.get_tensor("draft_vocab"), source.get_tensor("draft_vocab"))
    cache = FeatureCache.load(run_dir)
    training = split_sequences(cache.sequences, 0, HeadsTrainConfig.holdout)[1]
    assert read_trained_on(output) == {cache.keys[i] for i in training}


def test_calibration_lowers_ece_on_held_out_data(sharp_target, run_dir, drafters):
    """An over-confident head (logits four times too large) is what STS exists for: the temperatures it fits on
    one half of the held-out blocks recover the factor, and the ECE of prefix survival on the other half falls."""
    loaded = load_model(sharp_target)
    drafter = load_drafter(loaded, drafters / DRAFTER_DIR)
    drafter.config.confidence_temperatures = None
    with torch.no_grad():
        drafter.confidence_head.proj.weight.mul_(4.0)
        drafter.confidence_head.proj.bias.mul_(4.0)
    cache = FeatureCache.load(run_dir)
    to_draft = drafter_training.to_draft_index(drafter.config.vocab_size, drafter.vocab.ids, cache.tokens.device)
    config = replace(drafter_training.DrafterTrainConfig(output=drafters), anchors=8, autocast=False)
    before, after, temperatures, _ = drafter_training.calibrate(drafter, cache, to_draft, list(range(18)), config)
    assert after < before
    assert all(2.5 < t < 6.0 for t in temperatures)
    assert drafter.config.confidence_temperatures == temperatures


def test_greedy_acceptance_compares_with_the_targets_argmax(sharp_target, run_dir, drafters, tmp_path):
    """Greedy acceptance needs the target's argmax over its whole vocabulary, found from the cached last hidden
    states through its LM head: on the target's own greedy, unconstrained answers (the standard-library requests:
    subtasks with a schema are answered under their grammar, and some synthesised turns are sampled) that argmax is
    each answer's next token (states cached in float32 here, since bfloat16 rounding flips near-ties)."""
    loaded = load_model(sharp_target)
    drafter = load_drafter(loaded, drafters / DRAFTER_DIR)
    cache = features_of_answers(sharp_target, run_dir, tmp_path / "float32", "--feature-dtype", "float32")
    greedy_answers = [i for i, key in enumerate(cache.keys) if key.startswith("stdlib:")]
    to_draft = drafter_training.to_draft_index(drafter.config.vocab_size, drafter.vocab.ids, cache.tokens.device)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        blocks = drafter_training.block_forward(drafter, cache, to_draft, greedy_answers, 4, generator, greedy=True)
    inside = blocks.valid & (blocks.labels >= 0)
    assert inside.sum() > 100
    assert (blocks.greedy == blocks.labels)[inside].float().mean() > 0.99


def test_greedy_acceptance_at_a_position_counts_the_blocks_kept_that_far():
    """A position's greedy rate is over the blocks whose earlier positions all matched and that reach it: what
    greedy verification commits, so tokens a round from these rates is one plus the mean run of leading matches."""
    kept = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    blocks = drafter_training.HeldOutBlocks(torch.zeros(4, 3), torch.full((4, 3), 0.25), kept, valid)
    acceptance = drafter_training.Acceptance.of(blocks)
    assert acceptance.sampled == [0.25, 0.25, 0.25]
    assert acceptance.greedy == pytest.approx([3 / 4, 2 / 3, 0.0])
    assert drafter_training.tokens_a_round(acceptance.greedy) == pytest.approx(1 + (2 + 1 + 0 + 2) / 4)
    second_sequence = blocks.of_rows(torch.tensor([False, True]))  # two sequences, two blocks each
    assert torch.equal(second_sequence.greedy, kept[2:]) and torch.equal(second_sequence.valid, valid[2:])


def test_measure_reads_a_drafter_on_sequences_it_never_trained_on(sharp_target, run_dir, drafters, tmp_path, capsys):
    """``train measure``: a shipped drafter on a run's cached sequences less the ones it recorded as trained on, by
    kind, sampled and greedy, without training it; a drafter that saw all of them has nothing to be measured on."""
    source = tmp_path / "half-trained"
    shutil.copytree(drafters / DRAFTER_DIR, source, ignore=shutil.ignore_patterns(CHECKPOINT_DIR))
    cache = FeatureCache.load(run_dir)
    seen = frozenset(cache.keys[::2])
    write_trained_on(source, seen)
    argv = ["train", "measure", "--target", str(sharp_target), "--run", str(run_dir), "--drafter", str(source)]
    assert main([*argv, "--batch-size", "3", "--anchors", "4"]) == 0
    assert "greedy pos 1" in capsys.readouterr().out
    loaded = load_model(sharp_target)
    config = replace(drafter_training.DrafterTrainConfig(output=source), batch_size=3, anchors=4)
    measured = drafter_training.measure(loaded, cache, source, config)
    unseen = [key for key in cache.keys if key not in seen]
    assert measured.overall.sequences == len(unseen)
    assert {k: m.sequences for k, m in measured.acceptance_by_kind.items()} == Counter(
        key.rsplit("#", 1)[0] for key in unseen
    )
    for rates in (measured.overall.acceptance_by_position, measured.overall.greedy_acceptance_by_position):
        assert len(rates) == 7 and all(0.0 <= r <= 1.0 for r in rates) and rates[0] > 0.0
    with pytest.raises(ValueError, match="the feature cache holds layers"):
        drafter_training.measure(loaded, replace(cache, layer_ids=cache.layer_ids[:-1]), source, config)
    write_trained_on(source, frozenset(cache.keys))
    with pytest.raises(ValueError, match="trained on every sequence"):
        drafter_training.measure(loaded, cache, source, config)


def test_export_writes_the_whole_published_layout(sharp_target, drafters, tmp_path):
    assert (
        main(
            [
                "train",
                "export",
                "--target",
                str(sharp_target),
                "--drafter",
                str(drafters / DRAFTER_DIR),
                "--output",
                str(tmp_path / "exported"),
            ]
        )
        == 0
    )
    with safe_open(tmp_path / "exported" / WEIGHTS_FILE, "pt") as weights:
        assert {"embed_tokens.weight", "lm_head.weight"} <= set(weights.keys())
    backend = DSparkBackend.from_pretrained(sharp_target, drafter="dspark", drafter_path=tmp_path / "exported")
    assert backend.drafter.vocab.ids is None


def test_training_multiplies_in_bfloat16_only_where_the_cpu_does(monkeypatch):
    """Emulated bfloat16 made a drafter step some 20x slower than float32 on an AVX2-only CPU."""
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    cpu = torch.device("cpu")
    for native, wanted, dtype in [
        (False, True, torch.float32),
        (True, True, torch.bfloat16),
        (True, False, torch.float32),
    ]:
        monkeypatch.setattr(loading, "cpu_has_bf16", lambda native=native: native)
        with loading.bfloat16_autocast(cpu, wanted):
            assert (a @ b).dtype == dtype
