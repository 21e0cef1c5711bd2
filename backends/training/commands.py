"""``dspark-router train``: the drafters' training pipeline on a frozen target, in resumable stages.

    train data   --target T --run RUN                 the target's answers to the corpus recipe, and their features
    train heads  --target T --run RUN --output DIR    span heads (dspark_config.json, dspark_heads.safetensors)
    train dspark --target T --run RUN --output DIR    the published drafter (DeepSpec's layout, own weights only)
    train all    --target T --run RUN --output DIR    the three above in one process, features in memory (GPU)
    train export --target T --drafter DIR --output O  that drafter in the whole published layout, for vLLM/SGLang
    train ship   --target T --run RUN --into DIR      RUN's answers so far, for another machine's --corpus DIR

Each stage keeps what it made in RUN (or in its output's ``checkpoint/``) and continues from there when run
again. Registered in ``router/cli.py`` (imported only when ``train`` runs); torch is imported inside the handlers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from backends.corpus.recipe import CorpusRecipe

VOCAB_FILE = "vocab.json"


def add_train(p: argparse.ArgumentParser) -> None:
    stages = p.add_subparsers(dest="stage", required=True)

    data = stages.add_parser("data", help="the target's answers to the corpus recipe, and their cached features")
    _common(data)
    _recipe(data)
    data.add_argument(
        "--no-features", dest="features", action="store_false", help="the corpus alone (train all computes them)"
    )
    data.add_argument(
        "--feature-dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="the cached hidden states' precision (bfloat16: about 7 kB a token on the default model)",
    )
    data.add_argument(
        "--feature-tokens",
        type=int,
        help="cache features for a seeded sample of the corpus of at most this many tokens (default: all of it)",
    )
    data.add_argument(
        "--feature-lineage",
        metavar="DRAFTER",
        help="with --feature-tokens, a sample to continue this trained drafter on: per source, text its lineage "
        "never saw (its trained_on.json.gz) first, replaying what it saw where a source has no more",
    )
    data.set_defaults(handler=_data)

    every = stages.add_parser("all", help="data, heads and dspark in one process, features in memory (a GPU)")
    _common(every)
    _recipe(every)
    _trained(every)
    _heads_options(every, "heads-")
    every.add_argument("--heads-seconds", type=float, help="the span heads' share of --max-seconds")
    _dspark_options(every, "dspark-")
    every.set_defaults(handler=_all)

    heads = stages.add_parser("heads", help="span heads on the cached last hidden states")
    _common(heads)
    _trained(heads)
    _heads_options(heads)
    heads.set_defaults(handler=_heads)

    dspark = stages.add_parser("dspark", help="the published drafter on the cached features")
    _common(dspark)
    _trained(dspark)
    _dspark_options(dspark)
    dspark.set_defaults(handler=_dspark)

    ship = stages.add_parser("ship", help="a run's answers so far, gzipped, for another machine's train data")
    _common(ship)
    _recipe(ship)
    ship.add_argument("--into", required=True, help="the folder to write (what --corpus reads)")
    ship.set_defaults(handler=_ship)

    measure = stages.add_parser(
        "measure", help="a trained drafter's acceptance on the run's cached features it never trained on"
    )
    _common(measure)
    measure.add_argument("--drafter", required=True, help="the drafter folder (what train dspark wrote)")
    measure.add_argument("--batch-size", type=int, default=8, help="sequences per pass")
    measure.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    measure.set_defaults(handler=_measure)

    export = stages.add_parser("export", help="write a drafter in the whole published layout (vLLM, SGLang)")
    export.add_argument("--target", required=True, help="the target model folder")
    export.add_argument("--drafter", required=True, help="the drafter folder (config.json, model.safetensors)")
    export.add_argument("--output", required=True)
    export.set_defaults(handler=_export)


def _heads_options(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The span heads' settings; ``prefix`` names the ones another stage shares (``train all``)."""
    p.add_argument("--num-heads", type=int, default=3, help="K-1 heads for spans of up to K tokens")
    p.add_argument(f"--{prefix}steps", type=int, default=1500)
    p.add_argument("--positions", type=int, default=2048, help="answer positions per step")
    p.add_argument(f"--{prefix}lr", type=float, default=2e-3)
    p.add_argument(
        f"--{prefix}init-from",
        help="a folder of trained span heads to continue from (their count, vocabulary and thresholds) instead of "
        "fresh heads",
    )


def _dspark_options(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The published drafter's settings; ``prefix`` as in :func:`_heads_options`."""
    p.add_argument(f"--{prefix}steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    p.add_argument(f"--{prefix}lr", type=float, default=6e-4)
    p.add_argument(
        "--draft-layers",
        type=int,
        help="backbone layers (default: a fresh drafter's, or the --init-from drafter's; more than it has appends "
        "layers that start out adding nothing)",
    )
    p.add_argument("--block-size", type=int, default=7, help="draft tokens per block (gamma)")
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument(
        f"--{prefix}init-from",
        help="a trained drafter folder to continue from (its shape and vocabulary) instead of a fresh drafter",
    )


def _recipe(p: argparse.ArgumentParser) -> None:
    recipe = CorpusRecipe()
    p.add_argument("--subtasks", type=int, default=recipe.subtasks, help="generator subtasks (kinds in equal shares)")
    p.add_argument("--stdlib", type=int, default=recipe.stdlib, help="requests about standard-library code and prose")
    p.add_argument("--synthesised", type=int, default=recipe.synthesised, help="first turns the target writes")
    p.add_argument("--follow-ups", type=int, default=recipe.follow_ups, help="second turns the target writes")
    p.add_argument("--sampled-share", type=float, default=recipe.sampled_share, help="of synthesised turns, sampled")
    p.add_argument("--max-tokens", type=int, default=recipe.max_tokens, help="the longest answer")
    p.add_argument("--batch", type=int, default=32, help="requests the engine answers at once")
    p.add_argument("--bulk-rows", type=int, default=512, help="on a GPU: prompts per generate call")
    p.add_argument(
        "--no-bulk-grammar",
        dest="bulk_grammar",
        action="store_false",
        help="on a GPU: constrained prompts unconstrained",
    )
    p.add_argument("--layers", help="target layers the published drafter reads (default: DeepSpec's spread)")
    p.add_argument("--corpus", help="answers another machine shipped (train ship) to start from, if they match")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="the frozen target model folder")
    p.add_argument("--run", required=True, help="working folder: answers, features, vocabulary")
    p.add_argument("--dtype", default="auto", help="the target's precision for answers and features")
    p.add_argument("--device", default="cpu", help="where the target answers and the drafters train (cpu, cuda)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)


def _trained(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", required=True, help="the drafter folder to write (checkpoints go inside)")
    p.add_argument("--vocab-size", type=int, default=0, help="draft vocabulary (0: the target's whole vocabulary)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--max-seconds", type=float, help="stop training after this long, keeping what was learnt")


def _setup(args: argparse.Namespace):
    import torch

    from backends.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.target, device=args.device, dtype=args.dtype)


def _corpus(args: argparse.Namespace):
    """The recipe's answered sequences, with the model that answered them; a finished corpus in ``--run`` is read
    as it is (another machine trains on what this one answered)."""
    from backends.training.bulk import bulk_answers
    from backends.training.dataset import build_corpus, read_corpus, start_from
    from backends.training.distill import distillation_backend, engine_answers

    backend = distillation_backend(Path(args.target), args.dtype, args.batch, args.device)
    recipe = _recipe_of(args)
    if args.corpus and start_from(Path(args.corpus), recipe, _answered_by(args), Path(args.run)):
        print(f"starting from the answers shipped in {args.corpus}")
    records = read_corpus(Path(args.run))
    if records is None:
        bulk = backend.loaded.device.type == "cuda"
        answers = (
            bulk_answers(backend, args.bulk_rows, grammar=args.bulk_grammar)
            if bulk
            else engine_answers(backend, args.batch)
        )
        records, _ = build_corpus(answers, backend.loaded.tokenizer, recipe, Path(args.run))
    return backend.loaded, records


def _recipe_of(args: argparse.Namespace) -> CorpusRecipe:
    return CorpusRecipe(
        subtasks=args.subtasks,
        stdlib=args.stdlib,
        synthesised=args.synthesised,
        follow_ups=args.follow_ups,
        max_tokens=args.max_tokens,
        sampled_share=args.sampled_share,
        seed=args.seed,
    )


def _answered_by(args: argparse.Namespace) -> str:
    """What a corpus's answers depend on besides the recipe: the target's weights (the sha256 of the GGUF it was
    converted from, else its folder), the precision that answered, and the kind of device (a GPU answers in bulk
    through transformers, a CPU through the packed engine)."""
    from backends.convert import MARKER

    marker = Path(args.target) / MARKER
    weights = json.loads(marker.read_text())["sha256"] if marker.is_file() else str(Path(args.target).resolve())
    return f"{weights}|{args.dtype}|{args.device.split(':')[0]}"


def _ship(args: argparse.Namespace) -> int:
    from backends.training.dataset import ship_corpus

    shipped = ship_corpus(Path(args.run), _recipe_of(args), _answered_by(args), Path(args.into))
    print(json.dumps(shipped, indent=2))
    return 0


def _layer_ids(args: argparse.Namespace, loaded) -> list[int]:
    from backends.dspark.drafter_config import default_target_layer_ids

    layers = loaded.model.config.get_text_config().num_hidden_layers
    return [int(i) for i in args.layers.split(",")] if args.layers else default_target_layer_ids(layers)


def _write_vocab(args: argparse.Namespace, loaded, records) -> None:
    """The corpus's tokens ranked by frequency (the draft vocabulary is a prefix) and what each size covers."""
    from backends.training.vocab import coverage, frequency_ranked

    vocab_size = loaded.model.get_output_embeddings().weight.shape[0]
    ranked = frequency_ranked(records, vocab_size, sorted(loaded.eos_ids))
    sizes = [s for s in (1024, 2048, 4096, 8192, 16384, 32768) if s < len(ranked)] + [len(ranked)]
    table = {size: round(coverage(records, ranked[:size]), 4) for size in sizes}
    (Path(args.run) / VOCAB_FILE).write_text(json.dumps({"ranked": ranked, "coverage": table}) + "\n")
    answer_tokens = sum(len(r.completion) for r in records)
    print(json.dumps({"sequences": len(records), "answer_tokens": answer_tokens, "coverage": table}, indent=2))


def _data(args: argparse.Namespace) -> int:
    from backends.training.checkpoints import read_trained_on
    from backends.training.features import FeatureCache, build_feature_cache, sample_within

    if args.feature_lineage and args.feature_tokens is None:
        raise SystemExit("train data: --feature-lineage chooses a sample within --feature-tokens; give both")
    loaded, records = _corpus(args)
    _write_vocab(args, loaded, records)
    if args.features:
        import torch

        if args.feature_tokens is not None:
            seen = read_trained_on(Path(args.feature_lineage)) if args.feature_lineage else frozenset()
            records = sample_within(records, args.feature_tokens, args.seed, seen)
        run, layer_ids = Path(args.run), _layer_ids(args, loaded)
        if not FeatureCache.exists(run, layer_ids):
            dtype = getattr(torch, args.feature_dtype)
            build_feature_cache(loaded, records, layer_ids, dtype=dtype, folder=run).save(run)
    return 0


def _all(args: argparse.Namespace) -> int:
    """data, heads and dspark in one process, the features held in memory in bfloat16 (where a GPU holds them);
    the corpus files resume as in ``train data``, the features are computed again."""
    import torch

    from backends.dspark.drafter_config import DRAFTER_DIR
    from backends.training import drafter, heads
    from backends.training.features import build_feature_cache

    loaded, records = _corpus(args)
    _write_vocab(args, loaded, records)
    cache = build_feature_cache(loaded, records, _layer_ids(args, loaded), dtype=torch.bfloat16)
    vocab = _vocab(args)
    heads.run(loaded, cache, _heads_config(args, Path(args.output), "heads-", args.heads_seconds), vocab)
    drafter_config = _dspark_config(args, Path(args.output) / DRAFTER_DIR, "dspark-")
    _print_report(drafter.run(loaded, cache, drafter_config, vocab))
    return 0


def _print_report(report: object) -> None:
    """A stage's report as JSON less its curve, and its held-out acceptance by kind (where it has one) as a table
    that fits 80 columns: the first block position's acceptance sampled and greedy, and tokens a round sampled,
    each before and after."""
    from backends.training.drafter import tokens_a_round

    values = asdict(report)
    kinds = values.pop("acceptance_by_kind", {})
    print(json.dumps({k: v for k, v in values.items() if k != "curve"}, indent=2))
    if kinds:
        print(f"{'held-out kind':<22} {'seqs':>5} {'pos 1':>13} {'greedy pos 1':>13} {'tokens/round':>12}")
    for kind, measured in kinds.items():
        first = f"{measured['acceptance_by_position'][0]:.3f}"
        greedy = f"{measured['greedy_acceptance_by_position'][0]:.3f}"
        expected = f"{measured['expected_tokens']:.2f}"
        if measured["initial_acceptance_by_position"] is not None:
            first = f"{measured['initial_acceptance_by_position'][0]:.3f}->{first}"
            greedy = f"{measured['initial_greedy_acceptance_by_position'][0]:.3f}->{greedy}"
            expected = f"{tokens_a_round(measured['initial_acceptance_by_position']):.2f}->{expected}"
        print(f"{kind[:22]:<22} {measured['sequences']:>5} {first:>13} {greedy:>13} {expected:>12}")


def _vocab(args: argparse.Namespace):
    from backends.training.vocab import draft_vocab

    if not args.vocab_size:
        return None
    return draft_vocab(json.loads((Path(args.run) / VOCAB_FILE).read_text())["ranked"], args.vocab_size)


def _train(args: argparse.Namespace, run: Callable, config: object) -> int:
    """One drafter's stage: the target, the cached features and the vocabulary in, its report (less the curve)
    out."""
    from backends.training.features import FeatureCache

    loaded = _setup(args)
    _print_report(run(loaded, FeatureCache.load(Path(args.run)).to(loaded.device), config, _vocab(args)))
    return 0


def _heads_config(args: argparse.Namespace, output: Path, prefix: str = "", max_seconds: float | None = None):
    """The span heads' training settings from the command line (``prefix``: as :func:`_heads_options` was given)."""
    from backends.training.heads import HeadsTrainConfig

    prefix = prefix.replace("-", "_")
    return HeadsTrainConfig(
        output=output,
        num_heads=args.num_heads,
        steps=getattr(args, f"{prefix}steps"),
        positions=args.positions,
        lr=getattr(args, f"{prefix}lr"),
        warmup=args.warmup,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        max_seconds=max_seconds,
        init_from=Path(init_from) if (init_from := getattr(args, f"{prefix}init_from")) else None,
    )


def _dspark_config(args: argparse.Namespace, output: Path, prefix: str = ""):
    """The published drafter's training settings from the command line (``prefix``: as :func:`_dspark_options` was
    given)."""
    from backends.training.drafter import DrafterTrainConfig

    prefix = prefix.replace("-", "_")
    return DrafterTrainConfig(
        output=output,
        steps=getattr(args, f"{prefix}steps"),
        batch_size=args.batch_size,
        anchors=args.anchors,
        lr=getattr(args, f"{prefix}lr"),
        warmup=args.warmup,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        block_size=args.block_size,
        layers=args.draft_layers,
        markov_rank=args.markov_rank,
        max_seconds=args.max_seconds,
        init_from=Path(init_from) if (init_from := getattr(args, f"{prefix}init_from")) else None,
    )


def _heads(args: argparse.Namespace) -> int:
    from backends.training.heads import run

    return _train(args, run, _heads_config(args, Path(args.output), max_seconds=args.max_seconds))


def _dspark(args: argparse.Namespace) -> int:
    from backends.training.drafter import run

    return _train(args, run, _dspark_config(args, Path(args.output)))


def _measure(args: argparse.Namespace) -> int:
    from backends.training.drafter import DrafterTrainConfig, measure
    from backends.training.features import FeatureCache

    loaded = _setup(args)
    config = DrafterTrainConfig(
        output=Path(args.drafter), batch_size=args.batch_size, anchors=args.anchors, seed=args.seed
    )
    _print_report(measure(loaded, FeatureCache.load(Path(args.run)).to(loaded.device), Path(args.drafter), config))
    return 0


def _export(args: argparse.Namespace) -> int:
    from backends.dspark.backend import load_drafter
    from backends.loading import load_model

    loaded = load_model(args.target, device="cpu", dtype="float32")
    load_drafter(loaded, Path(args.drafter)).export(Path(args.output))
    print(args.output)
    return 0
