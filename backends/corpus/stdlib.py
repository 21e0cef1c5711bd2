"""Requests about the Python standard library's own code and docstrings: real code and English that no
template here produces, so a drafter learns how the target answers text it has not seen.

Every interpreter carries these files, the PSF License allows their reuse, and nothing is downloaded. A chunk of
a module (about CHUNK_CHARS, broken at blank lines so most hold whole definitions) is asked about the way agents
ask about code: complete, continue, explain, summarise, edit, add type hints or docstrings, extract its names as
JSON. Files are visited in a seeded order, a few chunks of each, so a small mix still spans many modules.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import random
import tokenize
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from backends.types import GenerationRequest

CHUNK_CHARS = 1500
OPENING_CHARS = 600
SPECIAL_TEXT = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Chat-template markers: text holding one would end or fork a conversation early."""
# Tests, GUIs, vendored packages and generated tables: code nobody asks an agent about.
_SKIPPED_DIRS = frozenset(
    {
        "__phello__",
        "__pycache__",
        "encodings",
        "ensurepip",
        "idlelib",
        "lib2to3",
        "pydoc_data",
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "tkinter",
        "turtledemo",
    }
)
_SKIPPED_FILES = frozenset({"__hello__.py", "antigravity.py", "this.py"})
_MIN_DOCSTRING_CHARS = 40
_NAMES_SCHEMA = {
    "type": "object",
    "properties": {
        "functions": {"type": "array", "items": {"type": "string"}},
        "classes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["functions", "classes"],
    "additionalProperties": False,
}
_ASKS = {
    "code": (
        "Complete this code:\n```python\n{}\n```",
        "What does this code do?\n{}",
        "Write a solution in the style of this code:\n```python\n{}\n```",
        "Add type hints to this code and return it:\n```python\n{}\n```",
        "Add a docstring to every function in this code:\n```python\n{}\n```",
        "Rewrite this code with clearer variable names:\n```python\n{}\n```",
        "Find a bug in this code, if there is one, and show the fix:\n```python\n{}\n```",
        "{}",
    ),
    "prose": (
        "Summarise:\n{}",
        "Explain in simple words: {}",
        "Write more about this:\n{}",
        "Give a one-line description of:\n{}",
        "{}",
    ),
}
_EXTRACT = "List the functions and classes this code defines, as JSON:\n```python\n{}\n```"


def stdlib_requests(count: int, max_tokens: int, seed: int) -> list[tuple[str, GenerationRequest]]:
    """``count`` (source, request) pairs, greedy: two in three about code (one in eight of those an extraction
    under a JSON schema, as a tool-using agent sends it), the rest about docstrings."""
    rng = random.Random(f"stdlib:{seed}")
    sources = {name: _stdlib_chunks(name, f"{seed}:stdlib:{name}") for name in _ASKS}
    requests = []
    for i in range(count):
        source = "code" if i % 3 else "prose"
        chunk = next(chunk for chunk in sources[source] if rng.random() < 0.25)[:OPENING_CHARS]
        response_format = None
        if source == "code" and rng.random() < 0.125:
            content = _EXTRACT.format(chunk)
            response_format = {"type": "json_schema", "json_schema": {"name": "names", "schema": _NAMES_SCHEMA}}
        else:
            content = rng.choice(_ASKS[source]).format(chunk)
        request = GenerationRequest(
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
            response_format=response_format,
        )
        requests.append((f"stdlib:{source}", request))
    return requests


def stdlib_dir() -> Path:
    """The running interpreter's standard library: json is a pure-Python stdlib package on every platform."""
    return Path(json.__file__).resolve().parent.parent


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Sorted, so the mix depends only on the interpreter version, not on directory listing order."""
    root = root or stdlib_dir()
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS and not d.startswith("config-")]
        found += [
            Path(directory, name)
            for name in files
            if name.endswith(".py") and name not in _SKIPPED_FILES and not name.startswith(("test_", "_sysconfigdata"))
        ]
    return sorted(found)


def _usable(text: str) -> bool:
    """No special tokens (they would end a conversation early) and no licence boilerplate."""
    return not any(token in text for token in SPECIAL_TEXT) and "copyright" not in text.lower()


def _chunks(text: str) -> list[str]:
    """Pieces of about CHUNK_CHARS that break at blank lines where they can, so most hold whole definitions."""
    pieces, lines, size = [], [], 0
    for line in text.splitlines():
        if lines and (size + len(line) >= CHUNK_CHARS or (size >= CHUNK_CHARS // 2 and not line.strip())):
            pieces.append("\n".join(lines).strip("\n"))
            lines, size = [], 0
        lines.append(line)
        size += len(line) + 1
    pieces.append("\n".join(lines).strip("\n"))
    return [piece for piece in pieces if piece.strip() and _usable(piece)]


def _strip_header(source: str) -> str:
    """Drop the shebang, coding line and licence comment block that open many modules."""
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")), len(lines))
    return "\n".join(lines[start:])


def _docstrings(tree: ast.Module, module: str) -> list[str]:
    """Docstrings of the module, its classes and their methods and its functions, each under its dotted name."""
    entries = []

    def visit(node: ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> None:
        doc = ast.get_docstring(node)
        if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
            entries.append(f"{name}\n{doc}")
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for child in node.body:
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, f"{name}.{child.name}")

    visit(tree, module)
    return entries


@cache
def _file_documents(path: Path, root: Path) -> dict[str, tuple[str, ...]]:
    """The code and docstring chunks of one file."""
    relative = path.relative_to(root)
    with tokenize.open(path) as f:  # honours coding cookies
        source = f.read()
    code = tuple(f"# {relative.as_posix()}\n{chunk}" for chunk in _chunks(_strip_header(source)))
    module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old modules
        tree = ast.parse(source)
    return {"code": code, "prose": tuple(_chunks("\n\n".join(_docstrings(tree, module))))}


def _stdlib_chunks(source: str, seed: str) -> Iterator[str]:
    """Chunks of one kind from the files in seeded order, read lazily so that small mixes stay fast; a mix larger
    than one pass takes another, in another order (the caller keeps a share of each pass's chunks)."""
    root = stdlib_dir()
    for rounds in itertools.count():
        files = stdlib_files(root)
        random.Random(f"{seed}:{rounds}").shuffle(files)
        for path in files:
            yield from _file_documents(path, root)[source]
