"""A small agent on the router: split a task into subtasks, fan them out with ``Router.map``, show where each ran.

The subtasks are the kinds an agent framework sends all day: tool-call arguments, a JSON extraction, a function to
finish, a summary, and a story. The first four have one right answer that a small model can draft several tokens
ahead; the story does not. The table shows what the router made of each: the pool, the rule or classifier score
behind the choice, the mean tokens accepted per forward pass, and the time.

    python examples/agent_pipeline.py                      # the embedded default: both pools on models/dspark-mini
    python examples/agent_pipeline.py --config router.yaml --task "Plan a team offsite in Porto"
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from backends.errors import DSparkRouterError
from router import RoutedResult, Router

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
                max_tokens=64,
            ),
        ),
        (
            "json extraction",
            chat(
                "You extract structured data. Reply with JSON only.",
                "Extract name, city and date: Elena Rossi arrives in Lisbon on 2025-06-11.",
                response_format={"type": "json_object"},
                max_tokens=64,
            ),
        ),
        (
            "code",
            chat(
                "You are a coding assistant. Reply with code only.",
                "Complete the function:\ndef slugify(title: str) -> str:\n    ",
                max_tokens=96,
            ),
        ),
        (
            "summary",
            chat(
                "You write short, factual summaries.",
                f"Summarise in one sentence: {task}. Twelve people, three days in Lisbon, one workshop a day, "
                "a shared dinner on the last evening, budget 9000 euros.",
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


def decision_cell(result: RoutedResult) -> str:
    d = result.decision
    why = f"score {d.score:.2f}" if d.rule == "classifier" else d.rule
    flags = [name for name in ("explored", "overflowed", "fell_back") if getattr(d, name)]
    return why + (f" ({', '.join(flags)})" if flags else "")


def show(console: Console, labels: list[str], results: list[RoutedResult | Exception], wall_s: float) -> None:
    table = Table(title="Agent subtasks through the router")
    for column in ("subtask", "pool", "why", "accepted/pass", "tokens", "tok/s", "latency"):
        table.add_column(column, no_wrap=True)
    table.add_column("output", overflow="ellipsis", no_wrap=True, max_width=40)
    for label, result in zip(labels, results):
        if isinstance(result, Exception):
            table.add_row(label, "-", f"[red]{type(result).__name__}[/red]", "", "", "", "", str(result)[:60])
            continue
        m = result.measured
        accepted = f"{m.mean_accepted_tokens:.2f}" if m.mean_accepted_tokens is not None else "n/a"
        table.add_row(
            label,
            result.decision.pool,
            decision_cell(result),
            accepted,
            str(result.usage.completion_tokens),
            f"{m.tokens_per_s:.0f}",
            f"{m.latency_s:.2f}s",
            result.text.strip().replace("\n", " ")[:60],
        )
    console.print(table)
    console.print(f"{len(results)} subtasks in {wall_s:.2f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="router YAML (default: the embedded config on models/dspark-mini)")
    parser.add_argument("--task", default="Plan a three-day team offsite in Lisbon")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, help="cap every subtask's max_tokens (for a quick run)")
    args = parser.parse_args(argv)
    console = Console()
    subtasks = plan(args.task)
    if args.max_tokens:
        subtasks = [(label, {**request, "max_tokens": args.max_tokens}) for label, request in subtasks]
    try:
        with Router.from_config(args.config) as router:
            router.warmup()
            started = time.perf_counter()
            results = router.map([request for _, request in subtasks], concurrency=args.concurrency)
            show(console, [label for label, _ in subtasks], results, time.perf_counter() - started)
    except DSparkRouterError as exc:
        console.print(f"[red]{exc.message}[/red]")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
