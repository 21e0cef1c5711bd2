"""``dspark-router train``: the drafters' training pipeline on a frozen target, in resumable stages.

    train data   --target T --run RUN                 the target's answers to the prompt mix, and their features
    train heads  --target T --run RUN --output DIR    span heads (dspark_config.json, dspark_heads.safetensors)
    train dspark --target T --run RUN --output DIR    the published drafter (DeepSpec's layout, own weights only)
    train export --target T --drafter DIR --output O  that drafter in the whole published layout, for vLLM/SGLang

Each stage keeps what it made in RUN (or in its output's ``checkpoint/``) and continues from there when run
again. Registered in ``router/cli.py`` through :data:`COMMANDS`; torch is imported inside the handlers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

DISTILL_FILE = "distill.jsonl"
VOCAB_FILE = "vocab.json"


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the drafters on a frozen target (data, heads, dspark, export)")
    stages = p.add_subparsers(dest="stage", required=True)

    data = stages.add_parser("data", help="the target's answers to the prompt mix, and their cached features")
    _common(data)
    data.add_argument("--subtasks", type=int, default=2400, help="generator subtasks (every kind, equal shares)")
    data.add_argument("--openings", type=int, default=1200, help="requests about standard-library code and prose")
    data.add_argument("--max-tokens", type=int, default=128, help="the longest answer")
    data.add_argument("--batch", type=int, default=32, help="requests the engine answers at once")
    data.add_argument("--layers", help="target layers the published drafter reads (default: DeepSpec's spread)")
    data.set_defaults(handler=_data)

    heads = stages.add_parser("heads", help="span heads on the cached last hidden states")
    _common(heads)
    _trained(heads)
    heads.add_argument("--num-heads", type=int, default=3, help="K-1 heads for spans of up to K tokens")
    heads.add_argument("--steps", type=int, default=1500)
    heads.add_argument("--positions", type=int, default=2048, help="answer positions per step")
    heads.add_argument("--lr", type=float, default=2e-3)
    heads.set_defaults(handler=_heads)

    dspark = stages.add_parser("dspark", help="the published drafter on the cached features")
    _common(dspark)
    _trained(dspark)
    dspark.add_argument("--steps", type=int, default=3000)
    dspark.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    dspark.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    dspark.add_argument("--lr", type=float, default=6e-4)
    dspark.add_argument("--draft-layers", type=int, default=2, help="backbone layers")
    dspark.add_argument("--block-size", type=int, default=7, help="draft tokens per block (gamma)")
    dspark.add_argument("--markov-rank", type=int, default=64)
    dspark.set_defaults(handler=_dspark)

    export = stages.add_parser("export", help="write a drafter in the whole published layout (vLLM, SGLang)")
    export.add_argument("--target", required=True, help="the target model folder")
    export.add_argument("--drafter", required=True, help="the drafter folder (config.json, model.safetensors)")
    export.add_argument("--output", required=True)
    export.set_defaults(handler=_export)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="the frozen target model folder")
    p.add_argument("--run", required=True, help="working folder: answers, features, vocabulary")
    p.add_argument("--dtype", default="auto", help="the target's precision for answers and features")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)


def _trained(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", required=True, help="the drafter folder to write (checkpoints go inside)")
    p.add_argument("--vocab-size", type=int, default=0, help="draft vocabulary (0: the target's whole vocabulary)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=200)


def _setup(args: argparse.Namespace):
    import torch

    from backends.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.target, device="cpu", dtype=args.dtype)


def _data(args: argparse.Namespace) -> int:
    from backends.dspark.drafter_config import default_target_layer_ids
    from backends.training.distill import distill, distillation_backend
    from backends.training.features import FeatureCache, build_feature_cache
    from backends.training.prompts import training_prompts
    from backends.training.vocab import coverage, frequency_ranked

    run = Path(args.run)
    backend = distillation_backend(Path(args.target), args.dtype, args.batch)
    loaded = backend.loaded
    prompts = training_prompts(args.subtasks, args.openings, args.max_tokens, seed=args.seed)
    records = distill(backend, prompts, run / DISTILL_FILE, batch=args.batch)
    layers = loaded.model.config.get_text_config().num_hidden_layers
    layer_ids = [int(i) for i in args.layers.split(",")] if args.layers else default_target_layer_ids(layers)
    if not FeatureCache.exists(run, layer_ids):
        build_feature_cache(loaded, records, layer_ids).save(run)
    vocab_size = loaded.model.get_output_embeddings().weight.shape[0]
    ranked = frequency_ranked(records, vocab_size, sorted(loaded.eos_ids))
    sizes = [s for s in (1024, 2048, 4096, 8192, 16384, 32768) if s < len(ranked)] + [len(ranked)]
    table = {size: round(coverage(records, ranked[:size]), 4) for size in sizes}
    (run / VOCAB_FILE).write_text(json.dumps({"ranked": ranked, "coverage": table}) + "\n")
    answer_tokens = sum(len(r.completion) for r in records)
    print(json.dumps({"sequences": len(records), "answer_tokens": answer_tokens, "coverage": table}, indent=2))
    return 0


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
    report = run(loaded, FeatureCache.load(Path(args.run)), config, _vocab(args))
    print(json.dumps({k: v for k, v in asdict(report).items() if k != "curve"}, indent=2))
    return 0


def _heads(args: argparse.Namespace) -> int:
    from backends.training.heads import HeadsTrainConfig, run

    config = HeadsTrainConfig(
        output=Path(args.output),
        num_heads=args.num_heads,
        steps=args.steps,
        positions=args.positions,
        lr=args.lr,
        warmup=args.warmup,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
    )
    return _train(args, run, config)


def _dspark(args: argparse.Namespace) -> int:
    from backends.training.drafter import DrafterTrainConfig, run

    config = DrafterTrainConfig(
        output=Path(args.output),
        steps=args.steps,
        batch_size=args.batch_size,
        anchors=args.anchors,
        lr=args.lr,
        warmup=args.warmup,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        block_size=args.block_size,
        layers=args.draft_layers,
        markov_rank=args.markov_rank,
    )
    return _train(args, run, config)


def _export(args: argparse.Namespace) -> int:
    from backends.dspark.backend import load_drafter
    from backends.loading import load_model

    loaded = load_model(args.target, device="cpu", dtype="float32")
    load_drafter(loaded, Path(args.drafter)).export(Path(args.output))
    print(args.output)
    return 0


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_train]
