"""llama.cpp as a measured peer in ``bench decode``: the same GGUF the default model is converted from, decoded
through ``llama-cpp-python`` from the same chat-templated token ids, on the same number of threads, plainly and
with its own prompt-lookup drafting (``LlamaPromptLookupDecoding``).

``llama-cpp-python`` is in the ``bench`` extra (``make bench`` builds it with the flags these CPUs need); where it
is not installed, or the model has no GGUF, ``bench decode`` runs without this peer and says so.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.convert import packaged_gguf
from backends.default_model import DEFAULT_MODEL
from backends.types import GenerationRequest

CONTEXT = 2048
"""Positions llama.cpp holds: every prompt of the bench plus its answer fits."""
LOOKUP_TOKENS = 10
"""Draft tokens a prompt-lookup round proposes: transformers' ``prompt_lookup_num_tokens`` as the bench runs it."""


def gguf_for(model: Path, given: Path | None) -> Path | None:
    """The GGUF to run: the one given, else the default model's own (from its wheel); None for another model."""
    if given is not None:
        return given
    if model.resolve() == DEFAULT_MODEL.resolve() and importlib.util.find_spec("llama_cpp") is not None:
        return packaged_gguf()
    return None


@dataclass(frozen=True)
class Answer:
    """What one request decoded: its tokens (up to end-of-sequence), the seconds it took, and the tokens llama.cpp
    committed (end-of-sequence included) over the forwards it ran (``eval`` calls, the prompt's included)."""

    tokens: list[int]
    seconds: float
    committed: int
    forwards: int


class LlamaCppPeer:
    """One llama.cpp model; ``run`` decodes a request's prompt ids to EOS or ``max_tokens``."""

    def __init__(self, gguf: Path, eos_ids: frozenset[int], prompt_lookup: bool = False) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if prompt_lookup else None
        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=CONTEXT,
            n_threads=torch.get_num_threads(),
            n_threads_batch=torch.get_num_threads(),
            draft_model=draft,
            logits_all=prompt_lookup,  # verifying a draft reads the logits at every drafted position
            verbose=False,
        )
        self.eos_ids = eos_ids
        self.forwards = 0
        evaluate = self.llm.eval

        def counted_eval(tokens):
            self.forwards += 1
            return evaluate(tokens)

        self.llm.eval = counted_eval  # generate() runs each forward, a draft's verification too, as one eval

    def run(self, prompt: list[int], request: GenerationRequest) -> Answer:
        """The tokens decoded and the seconds it took, prompt evaluation included (as our backends' wall time is).
        The cache is reset first, so no prompt prefix is reused from the request before."""
        self.llm.reset()
        if not request.greedy:
            self.llm.set_seed(request.seed or 0)
        tokens: list[int] = []
        committed, self.forwards = 0, 0
        started = time.perf_counter()
        for token in self.llm.generate(
            prompt,
            temp=request.temperature,
            top_k=0,
            top_p=request.top_p if request.top_p is not None else 1.0,
            min_p=0.0,
            repeat_penalty=1.0,
            reset=False,
        ):
            committed += 1
            if token in self.eos_ids:
                break
            tokens.append(token)
            if len(tokens) >= request.max_tokens:
                break
        return Answer(tokens, time.perf_counter() - started, committed, self.forwards)
