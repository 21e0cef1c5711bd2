"""``python -m benchmarks.gpu.train RESULTS``: the published drafter trained at scale on a GPU, in one command.

``train all`` over the whole shipped corpus (the target's own answers; features held in GPU memory), continued from
the shipped drafter, within the command's time, checkpointing as it goes; then the drafter packed to come back:
``dspark_drafter.config.json``, its report and its weights in pieces of at most :data:`PIECE` bytes (the machine
returns files of up to 16 MiB; ``python -m benchmarks.gpu.train join RETURNED INTO`` puts them together here). Returned
with ``summary.json`` and ``log.txt``. Measure it here with ``bench decode`` and ``train measure``; ship it only if
held-out position-1 acceptance and the evaluation prompts' tokens a forward improve.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from benchmarks.gpu.serve import model_arguments, rebuild_model
from benchmarks.gpu.stages import Stages

PIECE = 15 * 2**20
WEIGHTS = "model.safetensors"
PACKED = "dspark_drafter.safetensors.part"


def pack(drafter: Path, results: Path) -> list[Path]:
    """The trained drafter's config, report and weights (in pieces) into ``results``."""
    written = []
    for name in ("config.json", "train_report_dspark.json"):
        if (drafter / name).is_file():
            written.append(Path(shutil.copy2(drafter / name, results / f"dspark_drafter.{name}")))
    data = (drafter / WEIGHTS).read_bytes()
    for index, start in enumerate(range(0, len(data), PIECE)):
        piece = results / f"{PACKED}{index:02d}"
        piece.write_bytes(data[start : start + PIECE])
        written.append(piece)
    return written


def join(folder: Path, into: Path) -> Path:
    """A returned drafter as a drafter folder: its config and the pieces of its weights put together."""
    into.mkdir(parents=True, exist_ok=True)
    shutil.copy2(folder / "dspark_drafter.config.json", into / "config.json")
    report = folder / "dspark_drafter.train_report_dspark.json"
    if report.is_file():
        shutil.copy2(report, into / "train_report_dspark.json")
    with (into / WEIGHTS).open("wb") as weights:
        for piece in sorted(folder.glob(f"{PACKED}*")):
            weights.write(piece.read_bytes())
    return into


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["join"]:
        joining = argparse.ArgumentParser(prog="python -m benchmarks.gpu.train join", description=join.__doc__)
        joining.add_argument("returned", type=Path, help="the folder the machine's files came back to")
        joining.add_argument("into", type=Path, help="the drafter folder to write")
        args = joining.parse_args(argv[1:])
        print(join(args.returned, args.into))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.train", description=__doc__)
    model_arguments(parser)
    parser.add_argument("--corpus", type=Path, help="answers to start from (default: the shipped corpus)")
    parser.add_argument("--init-from", type=Path, help="the drafter to continue (default: the shipped one)")
    parser.add_argument("--fresh", action="store_true", help="a fresh drafter instead (the CPU dry run's tiny model)")
    parser.add_argument("--work", type=Path, default=Path(".gpu/train"), help="the run's and output's folder")
    parser.add_argument("--reserve", type=float, default=30.0, help="seconds kept for packing the drafter")
    args, extra = parser.parse_known_args(argv)
    from backends.default_model import DEFAULT_DRAFTERS
    from backends.dspark.drafter_config import DRAFTER_DIR

    stages = Stages(args.results, args.budget)
    model = rebuild_model(stages, args)
    if model is None:
        return 1
    output = args.work / "drafters"
    train = ["-m", "router", "train", "all", "--device", args.device, "--target", str(model)]
    train += ["--run", str(args.work / "run"), "--output", str(output)]
    train += ["--corpus", str(args.corpus or DEFAULT_DRAFTERS / "corpus")]
    if not args.fresh:
        train += ["--dspark-init-from", str(args.init_from or DEFAULT_DRAFTERS / DRAFTER_DIR)]
    train += ["--max-seconds", str(max(60.0, stages.left_s() - args.reserve - 60.0)), *extra]
    stages.run("train", train, reserve_s=args.reserve)
    drafter = output / DRAFTER_DIR
    if (drafter / WEIGHTS).is_file():
        stages.record("train", returned=[p.name for p in pack(drafter, args.results)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
