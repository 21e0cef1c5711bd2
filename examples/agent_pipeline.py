"""A small agent on the router: split a task into subtasks, fan them out with ``Router.map``, show where each ran.

The subtasks are the kinds an agent framework sends all day: tool-call arguments, a JSON extraction, a function to
finish, a summary, and a story. The first four have one right answer that a small model can draft several tokens
ahead; the story does not. The table shows what the router made of each: the pool, the rule or classifier score
behind the choice, the mean tokens accepted per forward pass, and the time.

    python examples/agent_pipeline.py                      # embedded default: SmolLM2-135M-Instruct
    python examples/agent_pipeline.py --config router.yaml --task "Plan a team offsite in Porto"
    python examples/agent_pipeline.py --gateway            # what `make demo` runs: the same, over HTTP
    python examples/agent_pipeline.py --base-url http://127.0.0.1:8000/v1   # a gateway that is already running

In-process the subtasks go through ``Router.map``. With ``--gateway`` the example starts ``dspark-router serve`` on a
free loopback port, sends the same subtasks to it with the openai SDK (an agent framework's view: nothing but a
base URL), reads the decision from each response, and stops the server when done.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from backends.errors import DSparkRouterError
from router import Decision, RoutedResult, Router

BOOKING_TOOL = {
    "type": "function",
    "function": {
        "name": "book_venue",
        "description": "Book a venue for a group",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "people": {"type": "integer"},
                "date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"},
            },
            "required": ["city", "people", "date"],
        },
    },
}

ARRIVAL = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "date": {"type": "string"}},
    "required": ["name", "city", "date"],
    "additionalProperties": False,
}


def plan(task: str) -> list[tuple[str, dict[str, Any]]]:
    """The agent's planner: one task in, labelled subtasks (chat-completions arguments) out."""

    def chat(system: str, user: str, **extra: Any) -> dict[str, Any]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return {"messages": messages, "metadata": {"tags": ["agent-demo"]}, **extra}

    return [
        (
            "tool-call arguments",
            chat(
                "You are an agent that calls tools.",
                f"{task}: book a venue in Lisbon for 12 people on 2025-06-12.",
                tools=[BOOKING_TOOL],
                tool_choice="required",
                temperature=0,
                max_tokens=64,
            ),
        ),
        (
            "json extraction",
            chat(
                "You extract structured data. Reply with JSON only.",
                "Extract name, city and date: Elena Rossi arrives in Lisbon on 2025-06-11.",
                response_format={"type": "json_schema", "json_schema": {"name": "arrival", "schema": ARRIVAL}},
                temperature=0,
                max_tokens=64,
            ),
        ),
        (
            "code",
            chat(
                "You are a coding assistant. Reply with code only.",
                "Write a Python function is_even(n) that returns True when n is even.",
                temperature=0,
                stop=["\n```"],
                max_tokens=64,
            ),
        ),
        (
            "summary",
            chat(
                "You write short, factual summaries.",
                "Summarise in one sentence: Twelve people will spend three days in Lisbon, with one workshop a day "
                "and a shared dinner on the last evening; the budget is 9000 euros.",
                temperature=0,
                max_tokens=64,
            ),
        ),
        (
            "story",
            chat(
                "You are a creative writer.",
                f"Write a short story about a team that went on this trip: {task}.",
                temperature=0.9,
                top_p=0.95,
                max_tokens=96,
            ),
        ),
    ]


class Row(NamedTuple):
    """What the table shows of one answered subtask, whether it was answered in-process or over HTTP."""

    decision: Decision
    mean_accepted: float | None
    tokens: int
    tokens_per_s: float
    latency_s: float
    text: str

    @classmethod
    def of(cls, result: RoutedResult) -> Row:
        m = result.measured
        usage = result.usage.completion_tokens
        return cls(result.decision, m.mean_accepted_tokens, usage, m.tokens_per_s, m.latency_s, result.text)


def decision_cell(d: Decision) -> str:
    if d.rule == "classifier":
        why = f"score {d.score:.2f}"
    elif d.rule == "time_saved" and d.load:
        # The speedup expected at DSpark's load when the request came, which is what decided, not the solo one.
        now = next(seen.speedup for seen in d.load.values() if seen.speedup is not None)
        why = f"expects {now:.2f}x"
    else:
        why = d.rule
    flags = [name for name in ("explored", "overflowed", "fell_back") if getattr(d, name)]
    return why + (f" ({', '.join(flags)})" if flags else "")


def show(console: Console, labels: list[str], rows: list[Row | Exception], wall_s: float, where: str = "") -> None:
    """A table of where each subtask ran and how fast, then each output on a line of its own: both fit 80
    columns, where an output column would squeeze every other one."""
    table = Table(
        title="Agent subtasks through the router",
        caption="acc: tokens committed per forward pass; tok: completion tokens",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for column in ("subtask", "pool", "why", "acc", "tok", "tok/s", "time"):
        table.add_column(column, no_wrap=True, overflow="ellipsis")
    outputs = []
    for label, row in zip(labels, rows):
        if isinstance(row, Exception):
            table.add_row(label, "-", f"[red]{type(row).__name__}[/red]", "", "", "", "")
            outputs.append((label, str(row)))
            continue
        accepted = f"{row.mean_accepted:.2f}" if row.mean_accepted is not None else "n/a"
        cells = (row.decision.pool, decision_cell(row.decision), accepted, str(row.tokens))
        table.add_row(label, *cells, f"{row.tokens_per_s:.0f}", f"{row.latency_s:.2f}s")
        outputs.append((label, row.text.strip().replace("\n", " ")))
    console.print(table)
    for label, text in outputs:
        console.print(f"[bold]{label}[/bold]: {escape(text)}", overflow="ellipsis", no_wrap=True, highlight=False)
    console.print(f"{len(rows)} subtasks in {wall_s:.2f}s{where}")


Answers = tuple[list[Row | Exception], float]


def in_process(config: str | None, requests: list[dict[str, Any]], concurrency: int) -> Answers:
    """The fan-out through ``Router.map``, timed once the models are loaded; the rows and the wall time."""
    with Router.from_config(config) as router:
        router.warmup()
        started = time.perf_counter()
        results = router.map(requests, concurrency=concurrency)
    return [Row.of(r) if isinstance(r, RoutedResult) else r for r in results], time.perf_counter() - started


def over_http(base_url: str, requests: list[dict[str, Any]], concurrency: int) -> Answers:
    """The same fan-out through the gateway with the openai SDK; the decision rides on each response."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=os.environ.get("DSPARK_ROUTER_API_KEY", "none"), max_retries=0)

    def one(request: dict[str, Any]) -> Row | Exception:
        started = time.perf_counter()
        try:
            completion = client.chat.completions.create(model="dspark-router/auto", **request)
        except openai.APIError as exc:
            return exc
        latency = time.perf_counter() - started
        routed = completion.model_extra["dspark_router"]
        message = completion.choices[0].message
        if message.tool_calls:  # shown as the model wrote it, as in-process (arguments cut by max_tokens too)
            call = message.tool_calls[0].function
            text = f'{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": {call.arguments}'
            text += "}" if completion.choices[0].finish_reason == "tool_calls" else ""
        else:
            text = message.content or ""
        return Row(
            decision=Decision.model_validate(routed["decision"]),
            mean_accepted=routed["measured"]["mean_accepted_tokens"],
            tokens=completion.usage.completion_tokens,
            tokens_per_s=routed["measured"]["tokens_per_s"],
            latency_s=latency,
            text=text,
        )

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        rows = list(pool.map(one, requests))
    return rows, time.perf_counter() - started


@contextmanager
def local_gateway(config: str | None) -> Iterator[str]:
    """``dspark-router serve`` on a free loopback port until the block ends; yields its base URL once ready."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "router", "serve", "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen([*command, *(["--config", config] if config else [])])
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the gateway exited with status {server.returncode} before it was ready")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="router YAML (default: the embedded config on the default model)")
    parser.add_argument("--task", default="Plan a three-day team offsite in Lisbon")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, help="cap every subtask's max_tokens (for a quick run)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gateway", action="store_true", help="start the REST gateway and go through it over HTTP")
    where.add_argument("--base-url", help="go through a running gateway, e.g. http://127.0.0.1:8000/v1")
    args = parser.parse_args(argv)
    console = Console()
    subtasks = plan(args.task)
    if args.max_tokens:
        subtasks = [(label, {**request, "max_tokens": args.max_tokens}) for label, request in subtasks]
    labels, requests = [label for label, _ in subtasks], [request for _, request in subtasks]
    try:
        if args.gateway or args.base_url:
            with local_gateway(args.config) if args.gateway else nullcontext(args.base_url) as base_url:
                rows, wall_s = over_http(base_url, requests, args.concurrency)
            show(console, labels, rows, wall_s, f" through the gateway at {base_url}")
        else:
            show(console, labels, *in_process(args.config, requests, args.concurrency))
    except (DSparkRouterError, RuntimeError) as exc:
        console.print(f"[red]{getattr(exc, 'message', exc)}[/red]")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
