"""The prompt mix the drafters learn the target's answers to: offline, reproducible, never the evaluation sets.

Two sources, both made here and both sent to the target exactly as serving sends them (a
:class:`~backends.types.GenerationRequest` through the target's own chat template):

- agent subtasks from :func:`backends.subtasks.generate_subtasks`, with their response formats and tools, which
  is what the DSpark pool serves;
- requests about Python standard-library code and docstrings (complete, explain, summarise, continue): real code
  and English the generator's templates never produce, so a drafter learns how the target answers text it has
  not seen. Every interpreter carries them, the PSF License allows their reuse, and nothing is downloaded.

``../shared/data/prompts`` (HumanEval, MBPP, GSM8K, MATH-500, MT-Bench) is evaluation only and never read here.
"""

from __future__ import annotations

import ast
import json
import os
import random
import tokenize
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from backends.subtasks import generate_subtasks
from backends.types import GenerationRequest

DISTILL_SEED = 0
"""The subtask seed the drafters train on; the classifier's corpus, the benchmarks and tuning use others."""
CHUNK_CHARS = 1500
OPENING_CHARS = 600
_SPECIAL_TEXT = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
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
_ASKS = {
    "code": (
        "Complete this code:\n```python\n{}\n```",
        "What does this code do?\n{}",
        "Write a solution in the style of this code:\n```python\n{}\n```",
        "Add type hints to this code and return it:\n```python\n{}\n```",
        "{}",
    ),
    "prose": ("Summarise:\n{}", "Explain in simple words: {}", "Write more about this:\n{}", "{}"),
}


@dataclass(frozen=True)
class TrainingPrompt:
    source: str
    """``subtask:<kind>``, ``code`` or ``prose``."""
    request: GenerationRequest


def training_prompts(subtasks: int, openings: int, max_tokens: int, seed: int = DISTILL_SEED) -> list[TrainingPrompt]:
    """``subtasks`` generator subtasks (every kind in equal shares) and ``openings`` requests about standard-
    library code (two in three) and docstrings, each decoded greedily for at most ``max_tokens``."""
    prompts = [
        TrainingPrompt(
            f"subtask:{subtask.kind}",
            GenerationRequest(
                messages=subtask.messages,
                response_format=subtask.response_format,
                tools=subtask.tools,
                max_tokens=min(subtask.max_tokens, max_tokens),
                temperature=0.0,
            ),
        )
        for subtask in generate_subtasks(subtasks, seed=seed)
    ]
    rng = random.Random(f"openings:{seed}")
    sources = {name: _stdlib_chunks(name, f"{seed}:openings:{name}") for name in _ASKS}
    for i in range(openings):
        source = "code" if i % 3 else "prose"
        chunk = next(chunk for chunk in sources[source] if rng.random() < 0.25)  # a few chunks of each file
        content = rng.choice(_ASKS[source]).format(chunk[:OPENING_CHARS])
        request = GenerationRequest(
            messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0
        )
        prompts.append(TrainingPrompt(source, request))
    return prompts


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
    return not any(token in text for token in _SPECIAL_TEXT) and "copyright" not in text.lower()


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
    """Chunks of one kind from the files in seeded order, read lazily so that small mixes stay fast."""
    root = stdlib_dir()
    files = stdlib_files(root)
    random.Random(seed).shuffle(files)
    for path in files:
        yield from _file_documents(path, root)[source]
