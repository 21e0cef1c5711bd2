"""Where a benchmark's report goes: the JSON that BENCHMARKS.md is rendered from, and the plots drawn from it."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def write_json(path: Path | str | None, report: dict[str, Any]) -> None:
    """Nothing without a path; its folder is made, so a fresh results folder needs no step of its own."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def write_plots(
    folder: Path | None, report: dict[str, Any], draw_all: Callable[[dict[str, Any], Path], Iterable[Path]]
) -> None:
    """Every plot ``draw_all`` makes of the report into ``folder``, each named as it is written."""
    if folder is None:
        return
    for path in draw_all(report, folder):
        print(f"wrote {path.name}")


def wrapped(line: str, width: int = 80) -> str:
    """A long prose line broken at spaces to fit the terminal (table rows fit already)."""
    return "\n".join(textwrap.wrap(line, width, subsequent_indent="  ")) if len(line) > width else line
