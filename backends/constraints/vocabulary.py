"""The llguidance view of a Hugging Face tokenizer, built once per tokenizer and reused by every request.

Wrapping a tokenizer walks its whole vocabulary and builds the token trie the mask computation runs on
(about a second for a 150k-token vocabulary), while compiling a grammar against the wrapper takes
milliseconds. So the wrapper is cached per tokenizer object, and a request pays only for its own grammar.
The cache holds the tokenizer weakly: unloading a model frees its wrapper too.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Collection

import llguidance.hf
from llguidance import LLTokenizer
from transformers import PreTrainedTokenizerBase

from backends.errors import UnsupportedFormatError

_WrapperKey = tuple[int, tuple[int, ...]]
_cache: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[_WrapperKey, LLTokenizer]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def llg_tokenizer(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Collection[int] | None = None
) -> LLTokenizer:
    """The cached llguidance tokenizer for ``tokenizer``, masks ``vocab_size`` wide, ending on ``eos_ids``.

    ``vocab_size`` is the model's logits width, which is often padded past ``len(tokenizer)``; llguidance
    needs the larger of the two, and the padding ids, naming no token, are never allowed. ``eos_ids`` are
    the model's stop tokens (the generation config may list several, as ``<|im_end|>`` and
    ``<|endoftext|>``; without them the tokenizer's own EOS is used): llguidance allows exactly these once
    the grammar accepts, and none before.
    """
    eos = tuple(sorted(eos_ids or ()))
    key = (max(vocab_size, len(tokenizer)), eos)
    with _lock:
        wrappers = _cache.setdefault(tokenizer, {})
        if key not in wrappers:
            try:
                wrappers[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=key[0], eos_token=list(eos) or None)
            except ValueError as exc:
                raise UnsupportedFormatError(
                    f"this model's tokenizer cannot drive constrained decoding: {exc}", param="response_format"
                ) from exc
        return wrappers[key]
