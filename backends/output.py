"""Assemble a completion from the token spans a decoder commits: EOS, max_tokens and stop strings.

Decoders only say which tokens they committed after each forward pass (one for plain decoding, a span for
DSpark). Everything that decides where the completion ends lives here, once, so every backend cuts stop
strings and token budgets the same way:

- a span is cut at the first EOS token and at the token budget;
- stop strings are matched on the decoded text, so a stop that spans token boundaries is found; the text is
  cut where the stop begins, and the token ids are rebuilt so that decoding them gives the returned text;
- for streaming, the text that could still turn into a stop string (or is an incomplete UTF-8 sequence) is
  held back until it is settled, so no delta ever carries part of a stop.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from backends.types import FinishReason, GenerationRequest

REPLACEMENT_CHAR = "\ufffd"


class OutputTracker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, request: GenerationRequest, eos_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._stops = request.stop
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._max_tokens = request.max_tokens
        self._eos_ids = eos_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self._streamed = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, tokens: list[int]) -> int:
        """Commit a span; returns how many of its tokens were kept (the rest lie past the end)."""
        kept = []
        for token in tokens:
            if token in self._eos_ids:
                self.finish_reason = "eos"
                break
            kept.append(token)
            if len(self.token_ids) + len(kept) == self._max_tokens:
                self.finish_reason = "length"
                break
        if not kept:
            return 0
        searched_to = len(self.text.rstrip(REPLACEMENT_CHAR))
        self.token_ids.extend(kept)
        self.text = self._decode(self.token_ids)
        cut = self._find_stop(searched_to)
        if cut is not None:
            self._cut_at(cut)
            self.finish_reason = "stop"
        return len(kept)

    def finish(self, reason: FinishReason) -> None:
        """End for a reason the decoder knows (a grammar that completed, say)."""
        self.finish_reason = reason

    def take_delta(self) -> str:
        """Text that is safe to stream now: never a prefix of a stop string that may still complete."""
        end = len(self.text) if self.finished else self._settled_length()
        delta = self.text[self._streamed : end]
        self._streamed = max(self._streamed, end)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _find_stop(self, searched_to: int) -> int | None:
        start = max(0, searched_to - self._longest_stop + 1)
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i != -1]
        return min(hits) if hits else None

    def _cut_at(self, cut: int) -> None:
        """Keep the text before the stop, with ids whose decoding is exactly that text."""
        target = self.text[:cut]
        keep = len(self.token_ids)
        prefix = self.text
        while keep and not target.startswith(prefix):
            keep -= 1
            prefix = self._decode(self.token_ids[:keep])
        tail = target[len(prefix) :]
        tail_ids = self._tokenizer.encode(tail, add_special_tokens=False) if tail else []
        self.token_ids = self.token_ids[:keep] + tail_ids
        self.text = target

    def _settled_length(self) -> int:
        end = len(self.text)
        while end and self.text[end - 1] == REPLACEMENT_CHAR:
            end -= 1
        for length in range(min(self._longest_stop - 1, end), 0, -1):
            tail = self.text[end - length : end]
            if any(s.startswith(tail) for s in self._stops):
                return end - length
        return end
