"""Requests the target writes itself (the Magpie method, arXiv 2406.08464): first turns and follow-ups.

An instruct model, given its own chat template up to the start of a user turn, writes what a user would ask
there, since that is what it has read after those markers. So the target can synthesise prompts in its own
distribution with no download: sample the user turn (temperature 1, seeded), keep it if it reads as a request,
then answer it as any other. A system prompt per domain (code, data extraction, tool use, maths, writing,
everyday questions) steers the topics towards what agents send; the default system prompt of the template
keeps the rest general. Follow-ups continue a finished conversation the same way: the template up to the next
user turn, after the first answer, so the drafters also see multi-turn contexts.

Each request carries its seed, so the same recipe writes the same prompts on any machine in the same precision.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.corpus.stdlib import SPECIAL_TEXT
from backends.types import GenerationRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SYNTHESIS_TEMPERATURE = 1.0
SYNTHESIS_TOP_P = 0.98
SYNTHESIS_MAX_TOKENS = 160
MIN_WORDS = 4
MAX_CHARS = 1200
DOMAINS: dict[str, str | None] = {
    "general": None,
    "code": "You are an expert Python programmer who writes clear, correct code.",
    "extraction": "You extract structured data from text and answer in JSON.",
    "tools": "You are an assistant that calls tools and APIs on the user's behalf.",
    "math": "You solve math word problems step by step.",
    "writing": "You are a writing assistant: emails, summaries, stories and rewrites.",
    "analysis": "You answer questions about data, science and everyday facts concisely.",
}
"""The system prompt of each synthesis domain (None: the template's own default)."""
_MARK = "\u0000USER-TURN\u0000"


@dataclass(frozen=True)
class Conversation:
    """A finished exchange whose next user turn is to be synthesised."""

    domain: str
    messages: list[dict[str, str]]


def turn_prefix(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """The chat template's text for ``messages`` followed by an open user turn: everything the template writes
    before a user's words."""
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": _MARK}], tokenize=False)
    return text[: text.index(_MARK)]


def system_messages(domain: str) -> list[dict[str, str]]:
    """The messages a turn of ``domain`` is written and answered under: its system prompt, if it has one."""
    prompt = DOMAINS[domain]
    return [] if prompt is None else [{"role": "system", "content": prompt}]


def _sampling(seed: int) -> dict:
    return {
        "temperature": SYNTHESIS_TEMPERATURE,
        "top_p": SYNTHESIS_TOP_P,
        "seed": seed,
        "max_tokens": SYNTHESIS_MAX_TOKENS,
        "stop": list(SPECIAL_TEXT),
    }


def first_turn_requests(
    tokenizer: PreTrainedTokenizerBase, count: int, seed: int
) -> list[tuple[str, GenerationRequest]]:
    """``count`` (domain, request) pairs: domains in turn, each request a raw prompt ending where a user's first
    words go, sampled with its own seed."""
    names = list(DOMAINS)
    pairs = []
    for i in range(count):
        domain = names[i % len(names)]
        prompt = turn_prefix(tokenizer, system_messages(domain))
        pairs.append((domain, GenerationRequest(prompt=prompt, **_sampling(_seed(seed, "first", i)))))
    return pairs


def follow_up_requests(
    tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation], seed: int
) -> list[GenerationRequest]:
    """One request a conversation: its text up to the open next user turn."""
    prompts = [turn_prefix(tokenizer, [*system_messages(c.domain), *c.messages]) for c in conversations]
    return [GenerationRequest(prompt=p, **_sampling(_seed(seed, "next", i))) for i, p in enumerate(prompts)]


def user_turn(text: str) -> str | None:
    """The synthesised turn, trimmed, or None where it does not read as a request: too short or long, or holding
    template markers."""
    text = text.strip()
    if any(marker in text for marker in SPECIAL_TEXT) or len(text) > MAX_CHARS:
        return None
    return text if len(text.split()) >= MIN_WORDS else None


def _seed(seed: int, stage: str, index: int) -> int:
    return random.Random(f"synthesis:{seed}:{stage}:{index}").getrandbits(31)
