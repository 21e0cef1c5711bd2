"""Subcommands whose modules load only when chosen, so ``dspark-router --help`` and ``route`` start at once.

Every subcommand's name and one-line help live in a table (:class:`Subcommand`); its module, which may import torch,
transformers or a benchmark's whole stack, is imported only when argparse meets its name on the command line, and
then fills the subcommand's parser (its arguments and its ``handler``). Before, the console command imported every
subcommand's module (torch, transformers and 13 benchmarks) before argparse saw a word: 5 seconds and 435 MB for
``--help``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Subcommand:
    help: str
    module: str
    """Imported when the subcommand is chosen."""
    adder: str = "add_arguments"
    """The module's function that adds the subcommand's arguments to its parser."""
    handler: str | None = "run"
    """The module's function that runs it (``args -> exit code``); None where the adder sets ``handler`` itself."""

    def fill(self, parser: argparse.ArgumentParser) -> None:
        module = importlib.import_module(self.module)
        getattr(module, self.adder)(parser)
        if self.handler is not None:
            parser.set_defaults(handler=getattr(module, self.handler))


class _LazySubParsers(argparse._SubParsersAction):
    """argparse's subparsers, each filled by its :class:`Subcommand` when its name is parsed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unfilled: dict[str, Subcommand] = {}

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        name = values[0]
        command = self.unfilled.pop(name, None)
        if command is not None:
            command.fill(self._name_parser_map[name])
        super().__call__(parser, namespace, values, option_string)


def add_subcommands(parser: argparse.ArgumentParser, commands: dict[str, Subcommand], dest: str) -> None:
    """One subcommand per entry of ``commands``, its choice stored in ``dest``."""
    subparsers = parser.add_subparsers(dest=dest, required=True, action=_LazySubParsers)
    for name, command in commands.items():
        subparsers.add_parser(name, help=command.help, description=command.help)
        subparsers.unfilled[name] = command
