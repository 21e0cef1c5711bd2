"""An agent's trace for ``bench trace``: jobs of one template each, sent many times with different contents.

An agent does not send independent prompts: one job sends the same system prompt, schema or tool, and the same
instructions, with different content, over and over. Each job here is such a template, written for this benchmark
(none comes from the evaluation prompts, and none is a template of the drafters' or the classifier's corpus), with
contents drawn from word lists by a seeded generator, so the trace is the same on every run and machine.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FIRST = ("Ana", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena", "Mateo")
LAST = ("Silva", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Novak", "Haddad", "Kowalski", "Ferreira", "Ibsen")
CITIES = ("Porto", "Leeds", "Graz", "Tartu", "Bologna", "Aarhus", "Cork", "Lyon", "Gdansk", "Zaragoza", "Ghent")
COMPANIES = ("Northwind", "Bluefin Labs", "Orchard Health", "Kestrel Freight", "Lumen Print", "Quarry Bank")
ROLES = ("data engineer", "product manager", "nurse", "logistics planner", "accountant", "UX researcher")
PRODUCTS = ("router", "invoice export", "mobile app", "billing page", "password reset", "CSV import", "dashboard")
PROBLEMS = (
    "stops responding after the latest update",
    "charges me twice every month",
    "shows an empty page when I log in",
    "loses my settings when I restart",
    "is very slow since yesterday",
    "rejects my card although it is valid",
)
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")
TOPICS = ("budget review", "onboarding", "quarterly planning", "design critique", "vendor call", "retro")
VERBS = ("total", "count", "average", "list", "find")

SYSTEM_EXTRACT = (
    "You extract contact records for a CRM. Read the note and return the person's details as JSON matching the "
    "schema exactly. Use null for anything the note does not say."
)
CONTACT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": ["string", "null"]},
        "company": {"type": ["string", "null"]},
        "role": {"type": ["string", "null"]},
        "city": {"type": ["string", "null"]},
    },
    "required": ["name", "email", "company", "role", "city"],
    "additionalProperties": False,
}
EVENT_TOOL = {
    "type": "function",
    "function": {
        "name": "create_event",
        "description": "Create a calendar event",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "day": {"type": "string", "enum": list(WEEKDAYS)},
                "start": {"type": "string", "description": "24-hour time, HH:MM"},
                "minutes": {"type": "integer"},
                "attendees": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["title", "day", "start", "minutes", "attendees"],
        },
    },
}
SQL_SCHEMA = (
    "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT, signed_up DATE);\n"
    "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), "
    "placed DATE, total_cents INTEGER);\n"
    "CREATE TABLE items (order_id INTEGER REFERENCES orders(id), sku TEXT, quantity INTEGER);"
)
FUNCTIONS = (
    ("clamp", "value, low, high", "return max(low, min(value, high))"),
    ("chunks", "items, size", "return [items[i : i + size] for i in range(0, len(items), size)]"),
    ("slugify", "text", 'return "-".join(text.lower().split())'),
    ("mean", "values", "return sum(values) / len(values) if values else 0.0"),
    ("invert", "mapping", "return {value: key for key, value in mapping.items()}"),
    ("is_leap", "year", "return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)"),
    ("flatten", "rows", "return [cell for row in rows for cell in row]"),
    ("initials", "name", 'return "".join(part[0].upper() for part in name.split())'),
)
SENTENCES = (
    "hey can u send me the report by tmrw, its kinda urgent",
    "we gotta push the launch cause the tests r failing",
    "thx for the help yesterday, the fix works now",
    "pls dont forget to book the room for the {topic} on {day}",
    "i think the numbers r wrong in the {topic} slides",
    "can we move the {topic} to {day} morning?",
)


def _person(rng: random.Random) -> dict[str, str]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    return {
        "name": f"{first} {last}",
        "email": f"{first.lower()}.{last.lower()}@{rng.choice(COMPANIES).split()[0].lower()}.com",
        "company": rng.choice(COMPANIES),
        "role": rng.choice(ROLES),
        "city": rng.choice(CITIES),
    }


def extraction(rng: random.Random) -> dict[str, Any]:
    p = _person(rng)
    note = rng.choice(
        (
            "Met {name} at the fair; works as a {role} at {company} in {city}. Email: {email}.",
            "{name} ({email}) is the new {role} at {company}, based in {city}.",
            "Call back {name}, {role} with {company}, {city} office, {email}.",
        )
    ).format(**p)
    return {
        "messages": [{"role": "system", "content": SYSTEM_EXTRACT}, {"role": "user", "content": f"Note: {note}"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "contact", "schema": CONTACT_SCHEMA}},
    }


def tool_arguments(rng: random.Random) -> dict[str, Any]:
    people = rng.sample(FIRST, rng.randint(1, 3))
    ask = (
        f"Set up a {rng.choice((30, 45, 60, 90))}-minute {rng.choice(TOPICS)} on {rng.choice(WEEKDAYS)} at "
        f"{rng.randint(8, 17)}:{rng.choice(('00', '30'))} with {', '.join(people)}."
    )
    return {
        "messages": [
            {"role": "system", "content": "You schedule meetings by calling the calendar tool."},
            {"role": "user", "content": ask},
        ],
        "tools": [EVENT_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "create_event"}},
    }


def triage(rng: random.Random) -> dict[str, Any]:
    ticket = f"My {rng.choice(PRODUCTS)} {rng.choice(PROBLEMS)}. Order {rng.randint(10000, 99999)}."
    return {
        "messages": [
            {
                "role": "system",
                "content": "Triage support tickets. Answer with a JSON object with keys category (billing, bug, "
                "account or other), priority (low, medium or high) and summary (one short sentence).",
            },
            {"role": "user", "content": f"Ticket: {ticket}"},
        ],
        "response_format": {"type": "json_object"},
    }


def _about_function(rng: random.Random, instruction: str) -> dict[str, Any]:
    """A request about one of :data:`FUNCTIONS`, shown as a code block after ``instruction``."""
    name, params, body = rng.choice(FUNCTIONS)
    code = f"```python\ndef {name}({params}):\n    {body}\n```"
    return {"messages": [{"role": "user", "content": f"{instruction}\n\n{code}"}]}


def docstring(rng: random.Random) -> dict[str, Any]:
    return _about_function(
        rng,
        "Write a Google-style docstring (Args and Returns sections) for this Python function. Reply with the whole "
        "function.",
    )


def sql(rng: random.Random) -> dict[str, Any]:
    city, verb = rng.choice(CITIES), rng.choice(VERBS)
    question = {
        "total": f"the total value of orders placed by customers from {city}",
        "count": f"how many customers from {city} placed at least {rng.randint(2, 5)} orders",
        "average": f"the average order total for customers who signed up in {rng.randint(2019, 2024)}",
        "list": f"the names of customers from {city} with an order over {rng.randint(50, 500)} dollars",
        "find": f"the sku sold in the largest quantity to customers from {city}",
    }[verb]
    return {
        "messages": [
            {"role": "system", "content": f"You write SQLite queries for this schema:\n{SQL_SCHEMA}"},
            {"role": "user", "content": f"Write one query that returns {question}. Reply with the SQL only."},
        ]
    }


def rewrite(rng: random.Random) -> dict[str, Any]:
    sentence = rng.choice(SENTENCES).format(topic=rng.choice(TOPICS), day=rng.choice(WEEKDAYS))
    return {
        "messages": [
            {"role": "system", "content": "Rewrite the user's message in clear, polite business English."},
            {"role": "user", "content": sentence},
        ]
    }


def listing(rng: random.Random) -> dict[str, Any]:
    product = rng.choice(("desk lamp", "kettle", "backpack", "monitor arm", "office chair", "standing mat"))
    price, colour = rng.randint(15, 300), rng.choice(("black", "white", "grey", "oak", "navy"))
    text = f"{rng.choice(COMPANIES)} {product}, {colour}, ${price}, ships from {rng.choice(CITIES)} in 3 days."
    return {
        "messages": [
            {
                "role": "user",
                "content": "Turn this listing into JSON with keys brand, product, colour, price_usd and ships_from:"
                f"\n{text}",
            }
        ],
        "response_format": {"type": "json_object"},
    }


def tests_for(rng: random.Random) -> dict[str, Any]:
    return _about_function(rng, "Write two pytest test functions for this function.")


@dataclass(frozen=True)
class Job:
    name: str
    build: Callable[[random.Random], dict[str, Any]]
    max_tokens: int


JOBS = (
    Job("extraction", extraction, 96),
    Job("tool_arguments", tool_arguments, 96),
    Job("triage", triage, 80),
    Job("docstrings", docstring, 160),
    Job("sql", sql, 96),
    Job("rewrites", rewrite, 64),
    Job("listings", listing, 96),
    Job("unit_tests", tests_for, 160),
)


def requests(job: Job, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` greedy requests of ``job``, the same for a seed on every run."""
    rng = random.Random(f"{job.name}/{seed}")
    return [{**job.build(rng), "max_tokens": job.max_tokens, "temperature": 0} for _ in range(count)]
