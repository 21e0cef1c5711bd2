"""``python -m backends.training STAGE ...``: the training stages without the router's command line, for a GPU
machine that has torch and transformers but not the gateway's dependencies (FastAPI, redis)."""

from __future__ import annotations

import argparse
import sys

from backends.training.commands import add_train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.training", description=__doc__)
    add_train(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
