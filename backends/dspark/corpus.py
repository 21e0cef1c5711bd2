"""The dspark-mini training corpus: offline, reproducible, and mostly chat.

The demo model has to answer agent subtasks in ChatML, so most of the corpus is synthetic subtasks
(:mod:`classifiers.subtasks`) rendered exactly as ``CHAT_TEMPLATE`` renders them at serving time. Python
standard-library source and docstrings add general code and English, so the model is more than a template
parrot: every interpreter carries them, the PSF License allows their reuse, and nothing has to be downloaded.

Subtasks that carry a ``response_format`` or ``tools`` get them spelled out in the system message
(:func:`prompt_messages`), because the chat template has no other place for them; a backend serving the model
should build its prompts with the same function so that it sees what it was trained on.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import random
import tokenize
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from backends.dspark.drills import iter_copy_drills
from backends.modelfactory import END_OF_TEXT, IM_END, IM_START, SPECIAL_TOKENS
from backends.prompting import prompt_messages
from classifiers.subtasks import KINDS, Subtask, generate_subtasks, templates_of

CHUNK_CHARS = 1500
# Tests, GUIs, vendored packages and generated tables: code the model should not spend its few steps on.
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


@dataclass(frozen=True)
class Mix:
    """Target shares of the corpus by characters. Chat leads: the demo has to answer in chat format; copy
    drills (:mod:`backends.dspark.drills`) teach it to take the values of its answers from the prompt."""

    chat: float = 0.50
    drills: float = 0.25
    code: float = 0.15
    prose: float = 0.10

    def __post_init__(self) -> None:
        if self.chat <= 0 or self.drills < 0 or self.code < 0 or self.prose < 0:
            raise ValueError(f"mix shares must be >= 0 with chat > 0, got {self}")


DEFAULT_MIX = Mix()


# --- chat rendering -------------------------------------------------------------------------------------------


def render_prompt(messages: Sequence[dict[str, str]]) -> str:
    """``CHAT_TEMPLATE`` with ``add_generation_prompt=True``, without needing a tokenizer."""
    turns = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return f"{turns}{IM_START}assistant\n"


def render_chat(messages: Sequence[dict[str, str]], reference: str) -> str:
    """A whole conversation: the prompt, then the answer closed by ``IM_END`` (the EOS the model must learn)."""
    return f"{render_prompt(messages)}{reference}{IM_END}\n"


def split_chat_document(document: str) -> tuple[str, str]:
    """(prompt, answer) of a chat corpus document, split after its last assistant header; ("", document) for
    code and prose, which have no prompt."""
    header = f"{IM_START}assistant\n"
    if not document.startswith(IM_START) or header not in document:
        return "", document
    prompt, _, answer = document.rpartition(header)
    return prompt + header, answer


@dataclass(frozen=True)
class ChatExample:
    """A subtask as training or evaluation text: ``prompt`` is what generation starts from, ``text`` the whole
    conversation the corpus holds."""

    messages: list[dict[str, str]]
    reference: str
    subtask: Subtask

    @property
    def prompt(self) -> str:
        return render_prompt(self.messages)

    @property
    def text(self) -> str:
        return render_chat(self.messages, self.reference)


def iter_chat_prompts(
    n: int,
    seed: int = 0,
    kinds: Sequence[str] | None = None,
    templates: Sequence[str] | None = None,
) -> Iterator[ChatExample]:
    """(messages, reference) pairs from :func:`generate_subtasks`, for evaluation and self-distillation."""
    for subtask in generate_subtasks(n, seed=seed, kinds=kinds, templates=templates):
        messages = prompt_messages(subtask.messages, subtask.response_format, subtask.tools)
        yield ChatExample(messages, subtask.reference, subtask)


# --- Python standard library ----------------------------------------------------------------------------------


def stdlib_dir() -> Path:
    """The running interpreter's standard library: json is a pure-Python stdlib package on every platform."""
    return Path(json.__file__).resolve().parent.parent


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Sorted, so the corpus depends only on the interpreter version, not on directory listing order."""
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
    """No special tokens (they would end a document early) and no licence boilerplate."""
    return not any(token in text for token in SPECIAL_TOKENS) and "copyright" not in text.lower()


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
            entries.append(f"{name}\n{doc}")  # no blank line: a chunk never ends on a bare name
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for child in node.body:
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, f"{name}.{child.name}")

    visit(tree, module)
    return entries


@cache
def _file_documents(path: Path, root: Path) -> dict[str, tuple[str, ...]]:
    """The code and docstring chunks of one file, cached because building a corpus twice is common."""
    relative = path.relative_to(root)
    with tokenize.open(path) as f:  # honours coding cookies
        source = f.read()
    code = tuple(f"# {relative.as_posix()}\n{chunk}" for chunk in _chunks(_strip_header(source)))
    module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old modules
        tree = ast.parse(source)
    return {"code": code, "prose": tuple(_chunks("\n\n".join(_docstrings(tree, module))))}


def _stdlib_chunks(source: str, seed: str) -> Iterator[tuple[str, str]]:
    """(file, chunk) pairs from the files in seeded order, read lazily so that small corpora stay fast."""
    root = stdlib_dir()
    files = stdlib_files(root)
    random.Random(seed).shuffle(files)
    for path in files:
        for chunk in _file_documents(path, root)[source]:
            yield path.relative_to(root).as_posix(), chunk


def _take(chunks: Iterable[tuple[str, str]], count: int | None, budget: float) -> tuple[list[str], list[str]]:
    """Documents until there are ``count`` of them or, when count is None, ``budget`` characters; and their files."""
    docs: list[str] = []
    used: set[str] = set()
    chars = 0
    for name, chunk in chunks:
        if (len(docs) >= count) if count is not None else (chars >= budget):
            break
        docs.append(chunk + END_OF_TEXT)
        chars += len(docs[-1])
        used.add(name)
    return docs, sorted(used)


# --- chat requests about code and prose, for self-distillation -------------------------------------------------

_OPEN_ASKS = {
    "code": (
        "Complete this code:\n```python\n{}\n```",
        "What does this code do?\n{}",
        "Write a solution in the style of this code:\n```python\n{}\n```",
        "{}",
    ),
    "prose": ("Summarise:\n{}", "Explain in simple words: {}", "Write more about this:\n{}", "{}"),
}
OPENING_CHARS = 600


def chat_openings(count: int, seed: int) -> list[str]:
    """Rendered chat prompts whose user message is the opening of a standard-library code or docstring chunk.

    The subtasks teach a drafter the templates; real requests ask about code and text it has never seen, in a
    user turn with no system message. These prompts are such requests, so self-distilled drafters learn how the
    model continues them (never the evaluation prompts of ``../shared/data/prompts``)."""
    rng = random.Random(f"openings:{seed}")
    sources = {name: _stdlib_chunks(name, f"{seed}:openings:{name}") for name in _OPEN_ASKS}
    prompts = []
    for i in range(count):
        source = "code" if i % 3 else "prose"
        chunk = next(chunk for _, chunk in sources[source] if rng.random() < 0.25)  # a few chunks of each file
        ask = rng.choice(_OPEN_ASKS[source])
        prompts.append(render_prompt([{"role": "user", "content": ask.format(chunk[:OPENING_CHARS])}]))
    return prompts


# --- the corpus -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusParts:
    """The three sources kept apart, so the training script can both train on them and describe them."""

    chat: tuple[str, ...]
    drills: tuple[str, ...]
    code: tuple[str, ...]
    prose: tuple[str, ...]
    code_files: tuple[str, ...]
    prose_files: tuple[str, ...]
    seed: int
    mix: Mix
    kinds: tuple[str, ...]

    def documents(self) -> list[str]:
        """All documents, shuffled with the seed so that every training window mixes the sources."""
        docs = [*self.chat, *self.drills, *self.code, *self.prose]
        random.Random(self.seed).shuffle(docs)
        return docs

    def manifest(self) -> dict[str, Any]:
        """Sources, licences and sizes, for the model card."""
        parts = {"chat": self.chat, "drills": self.drills, "code": self.code, "prose": self.prose}
        sizes = {name: sum(map(len, docs)) for name, docs in parts.items()}
        total = sum(sizes.values())
        python = {"python_version": platform.python_version(), "implementation": platform.python_implementation()}
        return {
            "seed": self.seed,
            "documents": len(self.chat) + len(self.drills) + len(self.code) + len(self.prose),
            "chars": total,
            "document_separator": END_OF_TEXT,
            "target_mix": asdict(self.mix),
            "actual_mix": {name: round(size / total, 4) if total else 0.0 for name, size in sizes.items()},
            "sources": [
                {
                    "name": "synthetic-agent-subtasks",
                    "description": "agent subtasks from classifiers.subtasks.generate_subtasks, rendered in ChatML",
                    "licence": "generated by this project (dspark-router, Apache-2.0)",
                    "kinds": list(self.kinds),
                    "templates": sum(len(templates_of(kind)) for kind in self.kinds),
                    "documents": len(self.chat),
                    "chars": sizes["chat"],
                },
                {
                    "name": "copy-drills",
                    "description": "chat drills whose answers copy invented values from the prompt "
                    "(backends.dspark.drills): JSON fields, lookups, tool calls, exact repeats",
                    "licence": "generated by this project (dspark-router, Apache-2.0)",
                    "documents": len(self.drills),
                    "chars": sizes["drills"],
                },
                {
                    "name": "python-stdlib-source",
                    "description": "source code of the Python standard library, in chunks of about "
                    f"{CHUNK_CHARS} characters, leading comment blocks removed",
                    "licence": "PSF-2.0 (Python Software Foundation License)",
                    **python,
                    "files": list(self.code_files),
                    "documents": len(self.code),
                    "chars": sizes["code"],
                },
                {
                    "name": "python-stdlib-docstrings",
                    "description": "docstrings of standard-library modules, classes and functions, read with ast",
                    "licence": "PSF-2.0 (Python Software Foundation License)",
                    **python,
                    "files": list(self.prose_files),
                    "documents": len(self.prose),
                    "chars": sizes["prose"],
                },
            ],
        }


def build_corpus_parts(
    n_chat: int,
    seed: int = 0,
    code_chunks: int | None = None,
    prose_chunks: int | None = None,
    mix: Mix = DEFAULT_MIX,
    kinds: Sequence[str] | None = None,
) -> CorpusParts:
    """See :func:`build_corpus`."""
    chat = tuple(chat_documents(iter_chat_prompts(n_chat, seed=seed, kinds=kinds)))
    chat_chars = sum(map(len, chat))
    drills = tuple(_drill_documents(chat_chars * mix.drills / mix.chat, seed))
    code, code_files = _take(_stdlib_chunks("code", f"{seed}:code"), code_chunks, chat_chars * mix.code / mix.chat)
    prose, prose_files = _take(
        _stdlib_chunks("prose", f"{seed}:prose"), prose_chunks, chat_chars * mix.prose / mix.chat
    )
    return CorpusParts(
        chat=chat,
        drills=drills,
        code=tuple(code),
        prose=tuple(prose),
        code_files=tuple(code_files),
        prose_files=tuple(prose_files),
        seed=seed,
        mix=mix,
        kinds=tuple(KINDS if kinds is None else kinds),
    )


def build_corpus(
    n_chat: int,
    seed: int = 0,
    code_chunks: int | None = None,
    prose_chunks: int | None = None,
    mix: Mix = DEFAULT_MIX,
    kinds: Sequence[str] | None = None,
) -> list[str]:
    """Shuffled documents, each ending with END_OF_TEXT: ``n_chat`` chat subtasks plus copy drills and
    standard-library code and docstrings. ``code_chunks``/``prose_chunks`` fix the number of those documents;
    left None, they are sized so the characters follow ``mix`` relative to the chat part (prose stops short
    when the docstrings run out); drills always follow ``mix``."""
    return build_corpus_parts(n_chat, seed, code_chunks, prose_chunks, mix, kinds).documents()


def corpus_manifest(
    n_chat: int,
    seed: int = 0,
    code_chunks: int | None = None,
    prose_chunks: int | None = None,
    mix: Mix = DEFAULT_MIX,
    kinds: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The manifest of ``build_corpus`` with the same arguments (rebuilt: use CorpusParts to build once)."""
    return build_corpus_parts(n_chat, seed, code_chunks, prose_chunks, mix, kinds).manifest()


def chat_documents(examples: Iterable[ChatExample]) -> list[str]:
    """Corpus documents for examples made elsewhere, e.g. self-distilled answers in place of the references."""
    return [example.text + END_OF_TEXT for example in examples]


def _drill_documents(budget: float, seed: int) -> list[str]:
    """Copy drills, rendered as chat, until they hold ``budget`` characters."""
    docs: list[str] = []
    chars = 0
    for messages, answer in iter_copy_drills(seed):
        if chars >= budget:
            return docs
        docs.append(render_chat(messages, answer) + END_OF_TEXT)
        chars += len(docs[-1])
    return docs
