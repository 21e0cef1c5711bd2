"""One grammar constraint for every decoder: which tokens may come next, for one token or a whole span.

The autoregressive loop asks for the mask at the current state; DSpark asks how much of a drafted span the
grammar accepts and for the masks at every position of the span, all without moving the state, and then
commits what the target model verified. Both go through :class:`GrammarConstraint`, so a request is held to
the same grammar whichever backend serves it.

llguidance rather than xgrammar, because DSpark needs what only llguidance's matcher offers directly:

- ``validate_tokens`` tells how many tokens of a span the grammar accepts *without consuming them*;
  xgrammar can only test a token by accepting it, so checking a draft means accept-then-rollback per token;
- masks for every position of a draft come from one call
  (``unsafe_compute_mask_ptr_with_draft_token``), and ``rollback`` undoes any number of committed tokens,
  with no rollback window fixed when the matcher is built;
- ``compute_ff_tokens`` returns forced text as *tokens*, already healed (bytes that could still merge with
  what follows are held back), where xgrammar's jump-forward hands back a string to re-tokenise;
- it compiles the most real-world JSON schemas (JSONSchemaBench, arXiv 2501.10868), and refuses a keyword
  it cannot enforce instead of ignoring it, so a schema is either honoured or refused before decoding.

EOS is part of the mask: the llguidance tokenizer knows the model's EOS ids, allows them exactly when the
grammar accepts and forbids them before. EOS itself is tracked here, not fed to llguidance, because
llguidance's rollback over a consumed EOS does not restore the state before it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from transformers import PreTrainedTokenizerBase

from backends.constraints.formats import request_grammar
from backends.constraints.vocabulary import llg_tokenizer
from backends.errors import BackendError, UnsupportedFormatError
from backends.sampling import greedy_tokens
from backends.types import GenerationRequest

BITS = 32
T = TypeVar("T")
# Short error messages: the verbose ones dump parser state and the whole grammar into the client's error.
LIMITS = LLParserLimits(verbose_errors=False)


def _timed(method: Callable[..., T]) -> Callable[..., T]:
    """Adds the call's duration to ``elapsed_s``: the constraint's share of a request's time, reported in its
    stats, so the cost of structured output is measured rather than guessed."""

    @functools.wraps(method)
    def wrapper(self: GrammarConstraint, *args: Any, **kwargs: Any) -> T:
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.elapsed_s += time.perf_counter() - started

    return wrapper


class ConstraintError(BackendError):
    """The decoder committed a token the grammar had not allowed, or the grammar hit a resource limit."""


@dataclass(frozen=True)
class GrammarDraft:
    """A draft as the grammar lets it stand (:meth:`GrammarConstraint.follow`)."""

    tokens: list[int]
    forced: list[bool]
    """Per token: the grammar forces it (committed unchecked, as plain decoding commits forced text)."""
    drafted: int
    """The leading tokens that are the draft's own, at its positions: what the drafter or lookup is measured on."""
    refused: bool
    """The draft's token after those was refused by the grammar (its distribution is needed to sample exactly)."""

    def rows(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft distributions ``probs`` (one row per drafted token) of the tokens kept as the draft's own, and
        that of the refused token after them (None where none was refused)."""
        return probs[: self.drafted], probs[self.drafted] if self.refused else None


class GrammarConstraint:
    """The state of one request's grammar over the tokens committed so far."""

    def __init__(self, matcher: LLMatcher, tokenizer: LLTokenizer, vocab_size: int) -> None:
        self._matcher = matcher
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = frozenset(tokenizer.eos_tokens)
        self._words = (tokenizer.vocab_size + BITS - 1) // BITS
        self._eos_only = _pack(self._eos_ids, self._words)
        self._consumed = 0
        self._ended = False
        self.elapsed_s = 0.0

    @classmethod
    def from_request(
        cls,
        request: GenerationRequest,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_ids: Collection[int] | None = None,
    ) -> GrammarConstraint | None:
        """The request's constraint, compiled now so a bad format is refused before any decoding.

        None when the output may be any text (no ``response_format`` or type ``text``, and no tool call
        possible). ``vocab_size`` is the model's logits width; ``eos_ids`` the model's stop tokens
        (``LoadedModel.eos_ids``). Raises :class:`~backends.errors.UnsupportedFormatError`.
        """
        grammar = request_grammar(request)
        if grammar is None:
            return None
        return cls.compile(grammar.lark, tokenizer, vocab_size, eos_ids, param=grammar.param)

    @classmethod
    def compile(
        cls,
        lark: str,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_ids: Collection[int] | None = None,
        *,
        param: str = "response_format",
    ) -> GrammarConstraint:
        """A constraint from Lark text (llguidance's dialect); a grammar that does not compile is refused."""
        llg = llg_tokenizer(tokenizer, vocab_size, eos_ids)
        matcher = LLMatcher(llg, LLMatcher.grammar_from_lark(lark), log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise UnsupportedFormatError(f"cannot constrain output to this {param}: {matcher.get_error()}", param=param)
        return cls(matcher, llg, vocab_size)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing but EOS: the decoder should end the completion now."""
        return self._ended or self._matcher.is_stopped()

    def allowed_tokens(self) -> torch.Tensor:
        """Bool mask ``[vocab_size]`` of the tokens allowed next (EOS only once the grammar accepts)."""
        return self.span_masks([])[0]

    @_timed
    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits of tokens not allowed next to -inf, in place, and return them.

        ``logits`` is ``[..., vocab_size]``; every row gets the current state's mask. Rows that stand at
        different states (a draft span) take their rows of :meth:`span_masks` instead.
        """
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits are {logits.shape[-1]} wide, the constraint {self.vocab_size}")
        words = self._mask_words([]).to(logits.device)
        return logits.masked_fill_(~_unpack(words[0], self.vocab_size), float("-inf"))

    @_timed
    def span_masks(self, tokens: list[int]) -> torch.Tensor:
        """Bool masks ``[len(tokens) + 1, vocab_size]``: row i is what may follow ``tokens[:i]``.

        For verifying a draft in one forward pass; the state is left as it was. Rows past the first token the
        grammar rejects, or past an EOS, allow only EOS: the grammar has nothing to say there, and a row that
        is not all -inf keeps a softmax over it finite. A verifier never reaches them, since the rejected
        token has probability zero in the row before.
        """
        return _unpack(self._mask_words(tokens), self.vocab_size)

    @_timed
    def greedy(self, logits: torch.Tensor, tokens: list[int], forced: list[bool] | None = None) -> list[int]:
        """Row i's argmax of ``logits`` ``[len(tokens) + 1, V]`` among what may follow ``tokens[:i]``: what
        greedy verification of a draft (and a greedy step, with no tokens) keeps, with the state left as it was.

        A row's own argmax stands where the grammar allows it, since it is then the masked row's argmax too, ties
        included (no allowed token before it has its value); only a refused one's row is masked. So the usual
        round reads a bit per row where masking every row built and applied ``[n, V]`` masks (five rows: 1.2 ms
        on a 2-core Xeon, against a forward of 16 rows' 16 ms). Rows at ``forced`` tokens keep their bare argmax:
        the verifier keeps forced text without asking the model."""
        words = self._mask_words(tokens)
        choices = greedy_tokens(logits)
        for row, token in enumerate(choices):
            if forced is not None and row < len(forced) and forced[row]:
                continue
            if not int(words[row, token // BITS]) >> (token % BITS) & 1:
                refused = ~_unpack(words[row], self.vocab_size).to(logits.device)
                choices[row] = greedy_tokens(logits[row].masked_fill(refused, float("-inf")).view(1, -1))[0]
        return choices

    @_timed
    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts (an EOS counts once the grammar is complete)."""
        if self._ended:
            return 0
        if self._matcher.is_stopped():
            # Once stopped, llguidance's validate_tokens refuses even the EOS its own mask allows.
            return int(bool(tokens) and tokens[0] in self._eos_ids)
        return self._matcher.validate_tokens(tokens)

    @_timed
    def consume(self, tokens: list[int]) -> None:
        """Commit ``tokens``; a token the grammar rejects raises :class:`ConstraintError` and commits nothing."""
        accepted = self.valid_prefix(tokens)
        if accepted < len(tokens):
            bad = tokens[accepted]
            raise ConstraintError(
                f"token {bad} ({self._tokenizer.decode_str([bad])!r}) is not allowed by the grammar after "
                f"{self._consumed + accepted} tokens"
            )
        if tokens and tokens[-1] in self._eos_ids:
            tokens = tokens[:-1]
            self._ended = True
        self._matcher.consume_tokens(tokens)
        self._consumed += len(tokens)
        self._raise_on_error()

    @_timed
    def rollback(self, n: int) -> None:
        """Undo the last ``n`` committed tokens (a DSpark span the target model did not keep)."""
        committed = self._consumed + int(self._ended)
        if not 0 <= n <= committed:
            raise ConstraintError(f"cannot roll back {n} tokens; {committed} are committed")
        if n and self._ended:
            self._ended = False
            n -= 1
        if n:
            self._matcher.rollback(n)
            self._consumed -= n
            self._raise_on_error()

    def follow(self, draft: list[int], limit: int) -> GrammarDraft:
        """``draft`` as the grammar lets it stand, at most ``limit`` tokens, with the state left as it was.

        Walking the draft from the current state: where the grammar forces text, the forced tokens stand in the
        draft's place (flagged: plain decoding commits them unsampled, so verification must keep them unchecked),
        and the draft goes on after them only if it wrote those very tokens; a drafted token the grammar refuses
        ends it. Text the grammar forces where the draft stops is appended, certain once the draft before is kept.
        """
        tokens: list[int] = []
        forced: list[bool] = []
        drafted, refused = 0, False  # drafted: the draft's tokens stood for, while they are the walk's own
        try:
            while len(tokens) < limit and not self.is_finished:
                run = self.forced_tokens()[: limit - len(tokens)]
                if run:
                    ahead = draft[drafted : drafted + len(run)]
                    if drafted == len(tokens) and ahead == run[: len(ahead)]:
                        drafted += len(ahead)
                    self.consume(run)
                    tokens += run
                    forced += [True] * len(run)
                    continue
                if drafted < len(tokens) or drafted == len(draft):
                    break
                if not self.valid_prefix(draft[drafted : drafted + 1]):
                    refused = True
                    break
                self.consume(draft[drafted : drafted + 1])
                tokens.append(draft[drafted])
                forced.append(False)
                drafted += 1
        finally:
            self.rollback(len(tokens))
        return GrammarDraft(tokens, forced, min(drafted, len(tokens)), refused)

    @_timed
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward), to commit without sampling; often empty."""
        return [] if self._ended else self._matcher.compute_ff_tokens()

    def _mask_words(self, tokens: list[int]) -> torch.Tensor:
        """Packed llguidance bitmasks, one ``int32`` row per position of the span."""
        words = self._eos_only.repeat(len(tokens) + 1, 1)
        if not self._ended:
            row_bytes = self._words * 4
            self._matcher.unsafe_compute_mask_ptr_with_draft_token(words.data_ptr(), row_bytes, tokens)
            self._raise_on_error()
        return words

    def _raise_on_error(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"grammar constraint failed: {self._matcher.get_error()}")


def _pack(token_ids: Collection[int], words: int) -> torch.Tensor:
    """A ``[words]`` int32 bitmask (llguidance's layout: bit ``t % 32`` of word ``t // 32``) with ``token_ids`` set."""
    values = [0] * words
    for token in token_ids:
        values[token // BITS] |= 1 << (token % BITS)
    return torch.tensor([v - (1 << BITS) if v >= 1 << (BITS - 1) else v for v in values], dtype=torch.int32)


def _unpack(words: torch.Tensor, width: int) -> torch.Tensor:
    """Bool masks ``[..., width]`` from packed ``[..., words]`` int32 bitmasks, on the words' device."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :width].bool()
