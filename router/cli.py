"""The ``dspark-router`` console command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from backends.errors import DSparkRouterError
from benchmarks import add_bench_parser
from classifiers.commands import COMMANDS as CLASSIFIER_COMMANDS
from router.commands import add_route
from router.gateway.serve import add_serve
from router.worker import add_worker

Handler = Callable[[argparse.Namespace], int]


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion with a local model")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", required=True, help="path to a Hugging Face model directory")
    p.add_argument("--backend", choices=["ar", "dspark"], default="ar", help="decoding backend (default: ar)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="default: OpenAI's 1.0; 0 decodes greedily")
    p.add_argument("--top-p", type=float, default=None, help="default: OpenAI's 1.0")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable, at most 4)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object with the whole result")
    p.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from backends.autoregressive import AutoregressiveBackend
    from backends.types import GenerationRequest

    fields = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    request = GenerationRequest(
        **fields,
        **{name: value for name, value in sampling.items() if value is not None},
        max_tokens=args.max_tokens,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    backend = AutoregressiveBackend.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    if args.json:
        print(backend.complete(request).model_dump_json())
        return 0
    for chunk in backend.stream(request):
        sys.stdout.write(chunk.delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train DSpark span heads (from scratch or heads only), or the published drafter on a target"
    )
    p.add_argument(
        "--drafter", choices=["heads", "dspark"], default="heads", help="dspark: the published drafter for --model"
    )
    p.add_argument("--mode", choices=["scratch", "heads"], help="span heads: train base and heads, or heads only")
    p.add_argument(
        "--output",
        required=True,
        help="folder for the trained model (checkpoints go inside); for --drafter dspark: MODEL/dspark_drafter",
    )
    p.add_argument("--model", help="base model for --mode heads; the frozen target for --drafter dspark")
    p.add_argument("--tokenizer", help="scratch mode: reuse this model folder's tokenizer (for a draft model)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--num-heads", type=int, default=3, help="extra heads: K-1 for spans of up to K tokens")
    p.add_argument("--loss-decay", type=float, default=0.8, help="next-k loss weight w_k = decay**k")
    p.add_argument("--self-distill", type=int, default=0, help="heads mode: train on N greedy continuations")
    p.add_argument("--distill-tokens", type=int, default=96)
    p.add_argument("--chat-examples", type=int, default=20_000, help="chat subtasks in the generated corpus")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--attention-heads", type=int, default=4)
    p.add_argument("--context", type=int, default=1024, help="scratch mode: the model's context (positions)")
    p.add_argument(
        "--mix", default="0.5,0.25,0.15,0.1", help="corpus shares by characters: chat,drills,code,prose (drills: copy)"
    )
    p.add_argument("--induction-rows", type=float, default=0.0, help="share of each batch that is synthetic copy rows")
    p.add_argument("--stop-at", type=int, help="leave after this step, checkpointed (a curriculum's first stage)")
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--block-size", type=int, default=7, help="dspark drafter: draft tokens per block (gamma)")
    p.add_argument("--draft-layers", type=int, default=2, help="dspark drafter: backbone layers")
    p.add_argument("--markov-rank", type=int, default=256, help="dspark drafter: rank of the Markov head")
    p.add_argument("--anchors", type=int, default=16, help="dspark drafter: blocks per training sequence")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from backends.dspark.corpus import Mix
    from backends.dspark.train import TrainConfig, run

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.drafter == "dspark":
        return _train_drafter(args)
    if args.mode is None:
        raise SystemExit("train: --mode is required for span heads (--drafter heads)")
    config = TrainConfig(
        mode=args.mode,
        output=Path(args.output),
        base_model=Path(args.model) if args.model else None,
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
        num_heads=args.num_heads,
        loss_decay=args.loss_decay,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup=args.warmup,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        self_distill=args.self_distill,
        distill_tokens=args.distill_tokens,
        vocab_size=args.vocab_size,
        hidden=args.hidden,
        layers=args.layers,
        attention_heads=args.attention_heads,
        context=args.context,
        mix=Mix(*(float(share) for share in args.mix.split(","))),
        induction_rows=args.induction_rows,
        stop_at=args.stop_at,
    )
    report = run(config, chat_examples=args.chat_examples)
    print(json.dumps(report.__dict__, indent=2))
    return 0


def _train_drafter(args: argparse.Namespace) -> int:
    """The published drafter on a frozen target: ``--self-distill`` prompts (default 2000) of the target's own
    continuations, then confidence calibration; the report lands beside the drafter."""
    from dataclasses import asdict
    from pathlib import Path

    from backends.dspark.drafter_train import DrafterTrainConfig, run

    if args.model is None:
        raise SystemExit("train --drafter dspark: --model (the target) is required")
    config = DrafterTrainConfig(
        target=Path(args.model),
        output=Path(args.output),
        steps=args.steps,
        batch_size=args.batch_size,
        anchors=args.anchors,
        lr=args.lr,
        warmup=args.warmup,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        prompts=args.self_distill or 2000,
        distill_tokens=args.distill_tokens,
        block_size=args.block_size,
        layers=args.draft_layers,
        markov_rank=args.markov_rank,
    )
    print(json.dumps(asdict(run(config)), indent=2))
    return 0


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="pick a DSpark model's span thresholds by measured speed (exact mode)")
    p.add_argument("--model", required=True, help="DSpark model folder")
    p.add_argument("--prompts", type=int, default=24, help="validation chat subtasks")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--write", action="store_true", help="save the winner in the model's dspark_config.json")
    p.set_defaults(handler=_tune)


def _tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from backends.dspark.backend import DSparkBackend
    from backends.dspark.tuning import tune_thresholds, validation_requests

    if args.threads:
        torch.set_num_threads(args.threads)
    backend = DSparkBackend.from_pretrained(args.model, device="cpu")
    best, timings = tune_thresholds(backend, validation_requests(args.prompts, args.max_tokens))
    print(json.dumps({"best": best, "timings": timings}, indent=2))
    if args.write:
        config = backend.model.dspark_config
        config.thresholds = best
        config.save(Path(args.model))
    return 0


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_generate,
    _add_train,
    _add_tune,
    *CLASSIFIER_COMMANDS,
    add_bench_parser,
    add_route,
    add_serve,
    add_worker,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-router", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except DSparkRouterError as exc:
        print(json.dumps(exc.to_openai()), file=sys.stderr)
        return 2
