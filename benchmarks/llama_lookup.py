"""llama.cpp's lookup decoding as ``bench trace``'s peer: ``llama-lookup`` (vendor/llama.cpp's example, built by
``make llama-lookup``) drafts from n-grams of the prompt and the output so far, and from a dynamic n-gram cache it
loads before a request and saves after it: llama.cpp's own way of drafting from the traffic. A job's requests
share one cache file, as a tenant's requests share our pool's traffic cache.

Each request runs the binary once on the same GGUF and threads as our engine, greedy, from the same chat-templated
prompt (our prompt ids written back as text, special tokens included, which it tokenizes to the same ids; passed on
the command line, since a prompt file loses its last newline there), under the same JSON schema where the request
has one. From its report: the tokens it decoded and those it took from a draft (a round commits its accepted tokens
and one of its own, so forwards = decoded - accepted, the prompt's pass giving the first token), and its decoding
loop's time (prompt evaluation and model loading left out). The same binary drafting nothing
(``--spec-draft-n-max 0``) is plain llama.cpp on the same request: its lookup is measured against that, as our
DSpark pool is against our standard pool.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.constraints.tools import call_schema, resolve_tool_choice
from backends.types import GenerationRequest

LLAMA_LOOKUP = Path(sys.prefix) / "llama.cpp" / "build" / "bin" / "llama-lookup"
"""Where ``make llama-lookup`` builds it (the Makefile's ``LLAMA_LOOKUP``, inside the virtual environment)."""
DRAFT_TOKENS = 3
"""Tokens a round drafts at most: llama.cpp's default, and the fastest of 3, 6 and 10 on the trace's extraction,
unit-test and SQL jobs (AMD EPYC Zen 3, late requests: 1.18x, 1.03x and 0.93x plain llama.cpp at 3; 0.94x, 0.67x
and 0.59x at 10, where a round verifies 2.9, 2.4 and 1.9 tokens: its verifying pass costs more than it saves)."""
CONTEXT = 2048
"""Positions llama.cpp holds: every trace prompt with its answer fits."""
_REPORT = {
    "prompt": re.compile(r"encoded\s+(\d+) tokens"),
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "accepted": re.compile(r"n_accept\s+=\s+(\d+)"),
}


@dataclass(frozen=True)
class LookupRun:
    """One request through ``llama-lookup``: its prompt's tokens as llama.cpp read them, the tokens decoded (the
    end-of-sequence token included), those a draft supplied, and the decoding loop's seconds."""

    prompt_tokens: int
    decoded: int
    accepted: int
    seconds: float

    @property
    def forwards(self) -> int:
        return self.decoded - self.accepted


def output_schema(request: GenerationRequest) -> dict[str, Any] | None:
    """The JSON schema a request's output must match, for ``--json-schema``: a required tool call's or the
    response format's; None for free text (a tool call the model may skip has no JSON schema)."""
    choice = resolve_tool_choice(request.tools, request.tool_choice)
    if choice is not None:
        return call_schema(choice.functions) if choice.required else None
    kind = (request.response_format or {}).get("type")
    if kind == "json_schema":
        return request.response_format["json_schema"]["schema"]
    return {"type": "object"} if kind == "json_object" else None


def run_lookup(
    gguf: Path, prompt: str, request: GenerationRequest, cache: Path, threads: int, draft_tokens: int = DRAFT_TOKENS
) -> LookupRun:
    """One request through ``llama-lookup``, reading and then updating the n-gram cache file ``cache``, drafting up
    to ``draft_tokens`` a round (0: plain decoding by the same binary)."""
    command = [
        str(LLAMA_LOOKUP), "-m", str(gguf), "-p", prompt, "-n", str(request.max_tokens), "-c", str(CONTEXT),
        "-t", str(threads), "-tb", str(threads), "--temp", "0", "-s", "0", "-lcd", str(cache),
        "--spec-draft-n-max", str(draft_tokens),
    ]  # fmt: skip
    if (schema := output_schema(request)) is not None:
        command += ["--json-schema", json.dumps(schema)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-lookup failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    return read_report(done.stdout + done.stderr)


def read_report(report: str) -> LookupRun:
    """What ``llama-lookup`` printed about a request: its prompt's tokens, the tokens decoded and accepted, and the
    decoding loop's seconds."""
    found = {name: pattern.search(report) for name, pattern in _REPORT.items()}
    if not all(found.values()):
        missing = ", ".join(name for name, match in found.items() if match is None)
        raise RuntimeError(f"llama-lookup's report lacks {missing}: {report[-2000:]}")
    return LookupRun(
        prompt_tokens=int(found["prompt"].group(1)),
        decoded=int(found["decoded"].group(1)),
        accepted=int(found["accepted"].group(1)),
        seconds=float(found["decoded"].group(2)),
    )
