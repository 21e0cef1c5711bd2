"""Features of a whole chat-completions request: what its text says and how its answer is constrained.

Whether DSpark's multi-token spans pay off depends on how predictable the answer is, and a request tells that in
more places than its wording: a JSON schema or a tool list pins the answer's shape, greedy decoding keeps the
target distribution sharp, a low ``max_tokens`` leaves little time to win back the prefill, an edit of given text
copies its answer from the prompt. So a request becomes two blocks of one sparse row:

* a few dozen structure features (:data:`STRUCTURE_FEATURES`), each scaled to about [0, 1]: what any wording of
  the request says about its answer;
* hashed word 1-2-grams of the system and last user message, at a tenth of the weight (:data:`TEXT_WEIGHT`).

The wording is weighed down because it is what carries least to requests never seen. Over five folds of the
calibration corpus held out by template (``bench route``, its first 432 labels), n-grams at full weight ranked
"DSpark faster" at AUROC 0.73 with the expected-gain model's log correlation 0.57; the structure block alone 0.77
and 0.63; words at a tenth 0.77 and 0.66, the best of both. Character 3-5-grams, once a third block, added
nothing at any weight and cost ~90 µs of a ~300 µs call on a 2-core EPYC, so they are gone.

The word block is :class:`~sklearn.feature_extraction.text.HashingVectorizer`'s (its word analyser: lowercased,
tokens of two or more word characters, their 1-2-grams; signed MurmurHash3, ``abs(h) % n_features``, counts, l2
norm), computed without scikit-learn, whose import is most of the time ``dspark-router route`` takes (0.7-1.1 s of
1.8 on 2 cores), and without its ``transform``, whose per-call checks cost ~300 µs a call: the router scores every
subtask. A test holds every column to ``HashingVectorizer``'s own; the hash is the ``mmh3`` package's, the same
MurmurHash3 scikit-learn ships.

Every shape the gateway accepts is handled: messages with ``tool_calls`` and ``content`` None or a list of parts,
a bare ``prompt``, missing or malformed optional fields. Nothing here raises on a request dict.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat
from typing import Any

import mmh3
import numpy as np

from backends.constraints.formats import RESPONSE_FORMAT_TYPES
from backends.types import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P

# Long prompts keep their head (the instruction) and tail (the end of the input): bounded time per request.
TEXT_HEAD_CHARS = 3000
TEXT_TAIL_CHARS = 1000
_CODE_WORDS = re.compile(r"\b(?:def|class|return|import|self|lambda|const|function|var)\b")
# What the request says about its answer, in words any template may use. A value, label or yes/no is a handful of
# tokens: too few for DSpark's rounds to win back its prefill. An edit of given text (rewrite, fix, rename,
# convert) copies most of its answer from the prompt, which is where drafted spans are accepted whole. Matched on
# lowercased text: twice as fast as re.IGNORECASE.
_SHORT_ANSWER = re.compile(
    r"\b(?:value|label|word|number|name|answer|letter|category|date|amount) only\b|\bone (?:word|number|label)\b"
    r"|\byes or no\b|\b(?:options|labels|choices|categories)\s*:",
)
_BRIEF_ANSWER = re.compile(r"\bone[- ](?:line|sentence)\b|\bbrief(?:ly)?\b|\bshort\b|\btl;dr\b")
_RESHAPE = re.compile(
    r"\b(?:rewrite|rephrase|fix|correct|rename|convert|reformat|format|translate|capitali[sz]e|replace|remove|"
    r"turn (?:this|it|the)|complete this|add (?:a|the)|extract|copy)\b",
)
_INT_MIN = -(2**31)
TEXT_WEIGHT = 0.1


def _scaled_count(value: float) -> float:
    """log1p scaled so that counts up to ~1000 land in [0, 1]: comparable to the shares for the linear model."""
    return math.log1p(max(value, 0.0)) / 7.0


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list; anything else is no text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages, or one user message holding a bare ``prompt``; malformed entries are dropped."""
    messages = request.get("messages")
    if isinstance(messages, list):
        return [m for m in messages if isinstance(m, dict)]
    prompt = request.get("prompt")
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else []


def request_text(request: dict[str, Any]) -> str:
    """System (and developer) messages plus the last user message: the instruction and the input it applies to."""
    messages = _messages(request)
    system = [_content_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    users = [_content_text(m.get("content")) for m in messages if m.get("role") == "user"]
    text = "\n".join([*system, *users[-1:]])
    if len(text) > TEXT_HEAD_CHARS + TEXT_TAIL_CHARS:
        text = f"{text[:TEXT_HEAD_CHARS]}\n{text[-TEXT_TAIL_CHARS:]}"
    return text


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _schema_counts(schema: Any) -> tuple[int, int]:
    """(properties, enums) anywhere in a JSON schema: how much of the answer's shape is fixed."""
    properties = enums = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
            enums += isinstance(node.get("enum"), list)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return properties, enums


def _tool_parameters(tools: list[Any]) -> int:
    count = 0
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        count += len(properties) if isinstance(properties, dict) else 0
    return count


_CHAR_CLASSES = {"brace": "{}[]()", "colon": ":;", "quote": "\"'`", "operator": "=_.<>+-*/", "newline": "\n"}
_CLASS_OF = {c: name for name, chars in _CHAR_CLASSES.items() for c in chars}


def _char_shares(text: str) -> dict[str, float]:
    """Shares of code and data punctuation, digits and capitals: one pass over the distinct characters."""
    counts = dict.fromkeys([*_CHAR_CLASSES, "digit", "upper"], 0)
    for char, n in Counter(text).items():
        name = _CLASS_OF.get(char) or ("digit" if char.isdigit() else "upper" if char.isupper() else None)
        if name:
            counts[name] += n
    return {f"{name}_share": n / len(text) if text else 0.0 for name, n in counts.items()}


def _source_share(text: str) -> float:
    """The share of the message that is material to work on rather than instruction: its longest line, paragraph
    or code block, where an answer that reshapes given text copies from."""
    blocks = re.split(r"\n+|```", text)
    return max(map(len, blocks), default=0) / len(text) if len(blocks) > 1 and text else 0.0


def _repeated_trigrams(text: str) -> float:
    """The share of word trigrams that occur more than once: repetition a drafter's copies pick up."""
    words = re.findall(r"\w+", text)
    trigrams = list(zip(words, words[1:], words[2:], strict=False))
    return 1.0 - len(set(trigrams)) / len(trigrams) if trigrams else 0.0


def structure(request: dict[str, Any], text: str | None = None) -> dict[str, float]:
    """The structure block by name; ``text`` is :func:`request_text` of the request, when the caller has it."""
    text = request_text(request) if text is None else text
    messages = _messages(request)
    roles = Counter(m.get("role") for m in messages)
    response_format = request.get("response_format")
    response_format = response_format if isinstance(response_format, dict) else {}
    format_type = response_format.get("type") or "none"
    json_schema = response_format.get("json_schema")
    schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
    schema_properties, schema_enums = _schema_counts(schema)
    tools = request.get("tools")
    tools = tools if isinstance(tools, list) else []
    tool_choice = request.get("tool_choice")
    stop = request.get("stop")
    stops = (
        [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)] if isinstance(stop, list) else []
    )
    temperature = min(max(_number(request.get("temperature"), DEFAULT_TEMPERATURE), 0.0), 2.0)
    user_text = next((_content_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    lower, user_lower = text.lower(), user_text.lower()
    return {
        "messages": _scaled_count(len(messages)),
        "assistant_messages": _scaled_count(roles["assistant"]),
        "tool_history": float(roles["tool"] > 0 or any(m.get("tool_calls") for m in messages)),
        "has_system": float(roles["system"] + roles["developer"] > 0),
        "text_chars": _scaled_count(len(text)),
        "user_chars": _scaled_count(len(user_text)),
        "all_chars": _scaled_count(sum(len(_content_text(m.get("content"))) for m in messages)),
        **{f"format_{name}": float(format_type == name) for name in ("none", *RESPONSE_FORMAT_TYPES)},
        "schema_properties": _scaled_count(schema_properties),
        "schema_enums": _scaled_count(schema_enums),
        "schema_chars": _scaled_count(len(json.dumps(schema, default=str))) if schema is not None else 0.0,
        "schema_strict": float(isinstance(json_schema, dict) and json_schema.get("strict") is True),
        "tools": _scaled_count(len(tools)),
        "tool_parameters": _scaled_count(_tool_parameters(tools)),
        "tool_choice_forced": float(tool_choice == "required" or isinstance(tool_choice, dict)),
        # Unset sampling arguments score as the values decoding will use (backends.types' OpenAI defaults); the
        # router fills in policy defaults before scoring, so a configured default is seen as set.
        "temperature": temperature / 2.0,
        "greedy": float(temperature == 0.0),
        "top_p": min(max(_number(request.get("top_p"), DEFAULT_TOP_P), 0.0), 1.0),
        "max_tokens": _scaled_count(
            _number(request.get("max_tokens") or request.get("max_completion_tokens"), DEFAULT_MAX_TOKENS)
        ),
        "stops": len(stops) / 4.0,
        "newline_stop": float(any("\n" in s for s in stops)),
        "code_fences": _scaled_count(text.count("```")),
        "code_words": _scaled_count(len(_CODE_WORDS.findall(text))),
        "json_mentioned": float("json" in lower),
        "short_answer": float(bool(_SHORT_ANSWER.search(user_lower))),
        "brief_answer": float(bool(_BRIEF_ANSWER.search(lower))),
        "reshape": float(bool(_RESHAPE.search(user_lower))),
        "source_share": _source_share(user_text),
        "repeated_trigrams": _repeated_trigrams(user_lower),
        **_char_shares(text),
    }


STRUCTURE_FEATURES: tuple[str, ...] = tuple(structure({}))


_WORD = re.compile(r"(?u)\b\w\w+\b")
"""scikit-learn's default ``token_pattern``."""


def word_grams(text: str, ngrams: tuple[int, int]) -> list[str]:
    """``HashingVectorizer(analyzer="word", ngram_range=ngrams).build_analyzer()(text)``: the lowercased text's
    tokens, then each n-gram of them joined by a space, n from the smallest to the largest."""
    tokens = _WORD.findall(text.lower())
    low, high = ngrams
    grams = list(tokens) if low == 1 else []
    for n in range(max(low, 2), min(high, len(tokens)) + 1):
        grams += [" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return grams


@lru_cache(maxsize=1 << 17)
def _column(token: str, n_features: int) -> int:
    """HashingVectorizer's column for a token (see sklearn's _hashing_fast), memoised: most tokens recur."""
    h = mmh3.hash(token, 0)
    return (2**31 - 1 - (n_features - 1)) % n_features if h == _INT_MIN else abs(h) % n_features


def _normalised(counts: Counter[int], weight: float) -> tuple[list[int], list[float]]:
    """Columns and their l2-normalised counts, times ``weight`` (none at all at weight 0)."""
    if not counts or weight <= 0:
        return [], []
    norm = math.hypot(*counts.values()) / weight
    return list(counts), [c / norm for c in counts.values()]


@dataclass(frozen=True)
class RequestRows:
    """Chat-completions request dicts to rows of [word n-grams | structure features]: what the estimator
    (:class:`~classifiers.features.RequestVectorizer`) computes, without scikit-learn."""

    word_features: int = 2**15
    word_ngrams: tuple[int, int] = (1, 2)
    text_weight: float = TEXT_WEIGHT

    @property
    def n_features(self) -> int:
        return self.word_features + len(STRUCTURE_FEATURES)

    def row(self, request: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """(column indices, values) of one request's row: the one-request path, without building a matrix."""
        request = request if isinstance(request, dict) else {}
        text = request_text(request)
        grams = word_grams(text, tuple(self.word_ngrams))
        columns, weights = _normalised(Counter(map(_column, grams, repeat(self.word_features))), self.text_weight)
        shape = list(structure(request, text).values())
        indices = [*columns, *range(self.word_features, self.word_features + len(shape))]
        return np.asarray(indices, dtype=np.int64), np.asarray([*weights, *shape])

    def matrix(self, requests: Sequence[dict[str, Any]]) -> Any:
        """The requests' rows as one sparse matrix (scipy's CSR)."""
        import scipy.sparse as sp

        rows = [self.row(request) for request in requests]
        indptr = np.cumsum([0, *(len(indices) for indices, _ in rows)])
        indices = np.concatenate([indices for indices, _ in rows]) if rows else np.zeros(0, np.int64)
        data = np.concatenate([values for _, values in rows]) if rows else np.zeros(0)
        return sp.csr_matrix((data, indices, indptr), shape=(len(rows), self.n_features))
