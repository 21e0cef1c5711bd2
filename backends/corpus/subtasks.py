"""Synthetic agent subtasks: what the drafters learn the target's answers to, and the classifier's corpus.

Agent frameworks send the router many small subtasks. Some are copy-and-format jobs (pull the fields out of a
sentence, fill in tool-call arguments, finish a very regular function) whose answer a small model can predict
several tokens ahead; others (stories, chat, brainstorms) have no single right answer. This module makes both
from small inline word lists, so that

* a tiny model trained for half an hour on two CPU cores can learn the deterministic kinds: their answers are
  literal copies of values in the prompt, reshaped in one canonical way;
* the open-ended kinds stay genuinely unpredictable: their answers are random draws from phrase pools;
* every subtask names the template it came from, so a classifier can be tested on templates it never saw.

All patterns use :class:`string.Template` placeholders (``$city``), never ``{}``, because the code snippets are
full of braces. Every draw goes through one seeded :class:`random.Random`: the same seed gives the same subtasks.
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from string import Template
from typing import Any

KINDS: tuple[str, ...] = (
    "code_completion",
    "code_edit",
    "json_extraction",
    "tool_call_arguments",
    "classification",
    "qa_context",
    "summarisation",
    "rewriting",
    "brainstorming",
    "creative_writing",
    "open_chat",
)
OPEN_ENDED_KINDS: frozenset[str] = frozenset({"brainstorming", "creative_writing", "open_chat"})


@dataclass(frozen=True)
class Subtask:
    """One agent subtask: the OpenAI chat-completions arguments plus the answer a good model gives.

    ``reference`` is the exact canonical output for the deterministic kinds, and one random sample of many
    equally good answers for the open-ended kinds (see :data:`OPEN_ENDED_KINDS`).
    """

    kind: str
    template: str
    messages: list[dict[str, str]]
    response_format: dict[str, Any] | None
    tools: list[dict[str, Any]] | None
    temperature: float
    top_p: float
    max_tokens: int
    stop: list[str]
    reference: str

    @property
    def open_ended(self) -> bool:
        return self.kind in OPEN_ENDED_KINDS

    def to_request_dict(self) -> dict[str, Any]:
        """Arguments for ``chat.completions.create``; None and an empty stop list are left out, as the API
        rejects ``stop=[]``. Copies, so a caller that edits the request cannot change this frozen subtask."""
        request = {
            "messages": copy.deepcopy(self.messages),
            "response_format": copy.deepcopy(self.response_format),
            "tools": copy.deepcopy(self.tools),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "stop": list(self.stop) or None,
        }
        return {key: value for key, value in request.items() if value is not None}


# --- slot fillers -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Filler:
    """A slot type: how to draw a value, and the JSON schema every value satisfies. The schema is what lets
    the same table drive extraction schemas and tool parameters."""

    draw: Callable[[random.Random], str | int | float]
    schema: dict[str, Any]


def _pool(*values: str) -> _Filler:
    return _Filler(lambda rng: rng.choice(values), {"type": "string"})


def _enum(*values: str) -> _Filler:
    return _Filler(lambda rng: rng.choice(values), {"type": "string", "enum": list(values)})


def _integer(low: int, high: int, step: int = 1) -> _Filler:
    return _Filler(
        lambda rng: rng.randint(low // step, high // step) * step, {"type": "integer", "minimum": low, "maximum": high}
    )


def _formatted(draw: Callable[[random.Random], str], pattern: str) -> _Filler:
    return _Filler(draw, {"type": "string", "pattern": pattern})


FIRST_NAMES = ("Alice", "Bruno", "Carla", "Deepak", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi")
FIRST_NAMES += ("Lena", "Mateo", "Nadia", "Omar", "Priya", "Rosa", "Sven", "Tara", "Wei", "Yara", "Zoe")
LAST_NAMES = ("Smith", "Garcia", "Chen", "Okafor", "Novak", "Rossi", "Kim", "Silva", "Muller", "Patel", "Larsen")
LAST_NAMES += ("Dubois", "Tanaka", "Haddad", "Kowalski", "Nguyen")
CITIES = ("Paris", "Berlin", "Lisbon", "Madrid", "Rome", "Vienna", "Oslo", "Dublin", "Prague", "Warsaw", "Athens")
CITIES += ("Cairo", "Lagos", "Nairobi", "Tokyo", "Seoul", "Delhi", "Sydney", "Toronto", "Chicago", "Boston", "Lima")
COMPANIES = ("Acme Corp", "Globex", "Initech", "Umbrella Labs", "Hooli", "Vandelay Imports", "Tyrell Systems")
COMPANIES += ("Cyberdyne", "Aperture Science", "Pied Piper", "Soylent Foods", "Oscorp", "Massive Dynamic")
PRODUCTS = ("laptop", "desk lamp", "coffee grinder", "running shoes", "backpack", "smart watch", "office chair")
PRODUCTS += ("water bottle", "headphones", "keyboard", "monitor", "blender", "tent", "bike helmet", "printer")
TOPICS = ("remote work", "city gardens", "electric cars", "learning a language", "space travel", "board games")
TOPICS += ("healthy breakfasts", "public libraries", "night trains", "rainy weekends", "small businesses")
_DOMAINS = ("example.com", "mail.test", "corp.example", "inbox.test")


def _price(rng: random.Random) -> float:
    # Built from its own text, so the number in the prompt and in json.dumps() are the same characters.
    return float(f"{rng.randint(5, 499)}.{rng.choice((25, 49, 50, 75, 99))}")


_FILLERS: dict[str, _Filler] = {
    # Values the text subtasks copy.
    "name": _pool(*(f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES)),
    "email": _formatted(
        lambda rng: f"{rng.choice(FIRST_NAMES).lower()}.{rng.choice(LAST_NAMES).lower()}@{rng.choice(_DOMAINS)}",
        r"^[a-z]+\.[a-z]+@[a-z.]+$",
    ),
    "phone": _formatted(lambda rng: f"555-{rng.randint(1000, 9999)}", r"^555-\d{4}$"),
    "city": _pool(*CITIES),
    "company": _pool(*COMPANIES),
    "product": _pool(*PRODUCTS),
    "job": _pool("engineer", "designer", "analyst", "manager", "teacher", "nurse", "chef", "pilot", "lawyer"),
    "event": _pool("workshop", "team meeting", "product demo", "board review", "training session", "job interview"),
    "restaurant": _pool("Blue Door", "La Piazza", "Golden Dragon", "Green Fork", "Sakura House", "Casa Luna"),
    "subject": _pool("Quarterly report", "Invoice question", "Project kickoff", "Travel plans", "Contract renewal"),
    "task": _pool("call the bank", "renew my passport", "water the plants", "pay the rent", "send the slides"),
    "service": _pool("payments", "login", "search", "checkout", "email", "billing", "upload"),
    "cause": _pool("full disk", "bad deploy", "power cut", "network fault", "database lock", "config error"),
    "part": _pool("battery", "zipper", "hinge", "cable", "screen", "strap", "handle"),
    "currency": _enum("EUR", "USD", "GBP", "JPY", "CHF"),
    "status": _enum("pending", "shipped", "delivered", "cancelled"),
    "priority": _enum("low", "medium", "high"),
    "age": _integer(18, 79),
    "quantity": _integer(1, 20),
    "party": _integer(1, 8),
    "days": _integer(2, 60),
    "minutes": _integer(5, 180),
    "percent": _integer(2, 40),
    "rating": _integer(1, 5),
    "quarter": _integer(1, 4),
    "amount": _integer(100, 9900, step=100),
    "salary": _integer(30_000, 150_000, step=1000),
    "price": _Filler(_price, {"type": "number"}),
    "date": _formatted(
        lambda rng: f"{rng.randint(2023, 2026)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        r"^\d{4}-\d{2}-\d{2}$",
    ),
    "time": _formatted(
        lambda rng: f"{rng.randint(7, 20):02d}:{rng.choice(('00', '15', '30', '45'))}", r"^\d{2}:\d{2}$"
    ),
    "order_id": _formatted(lambda rng: f"ORD-{rng.randint(10000, 99999)}", r"^ORD-\d{5}$"),
    "ticket_id": _formatted(lambda rng: f"TCK-{rng.randint(1000, 9999)}", r"^TCK-\d{4}$"),
    "flight": _formatted(
        lambda rng: f"{rng.choice(('LH', 'AF', 'BA', 'KL', 'IB'))}{rng.randint(100, 999)}", r"^[A-Z]{2}\d{3}$"
    ),
    # Identifiers and literals for the code snippets.
    "field": _pool("price", "weight", "score", "amount", "count", "duration", "size", "cost", "balance", "distance"),
    "cls": _pool("User", "Order", "Invoice", "Product", "Ticket", "Flight", "Account", "Booking", "Customer"),
    "attr": _pool("name", "email", "city", "price", "status", "owner", "created_at", "quantity", "title", "country"),
    "var": _pool("age", "port", "percent", "rating", "timeout", "retries", "level", "volume"),
    "low": _integer(0, 10),
    "high": _integer(20, 500),
    "setting": _pool("timeout", "host", "port", "retries", "debug", "log_level", "workers", "region"),
    "default": _pool("None", "0", "3", "30", "False", "True", '"info"', '"localhost"', "[]"),
    "noun": _pool("orders", "users", "items", "invoices", "tickets", "events", "names", "emails", "urls", "tags"),
    "state": _pool("open", "closed", "paid", "failed", "pending", "active"),
    # Prompt material for the open-ended kinds.
    "topic": _pool(*TOPICS),
    "character": _pool("lighthouse keeper", "retired pilot", "young chef", "lost robot", "street musician", "fox"),
    "place": _pool("train station", "harbour", "market", "rooftop", "library", "bakery", "forest cabin", "airport"),
    "count": _integer(3, 5),
}
# Slots that share a filler draw distinct values, so "from $origin to $destination" never names one city twice.
_ALIASES = {
    "origin": "city",
    "destination": "city",
    "colleague": "name",
    "recipient": "email",
    "attendee": "email",
    "from_currency": "currency",
    "to_currency": "currency",
    "passengers": "party",
    "people": "party",
    "a": "attr",
    "b": "attr",
    "c": "attr",
}
_PLACEHOLDER = re.compile(r"\$(?:(\w+)|\{(\w+)\})")


def _filler(key: str) -> _Filler:
    return _FILLERS[_ALIASES.get(key, key)]


def _slots(pattern: str) -> list[str]:
    """Placeholder names in order of first appearance: that order is the key order of the JSON answers."""
    return list(dict.fromkeys(m.group(1) or m.group(2) for m in _PLACEHOLDER.finditer(pattern)))


def _draw(keys: Iterable[str], rng: random.Random) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key in keys:
        filler = _filler(key)
        taken = {value for other, value in values.items() if _filler(other) is filler}
        value = filler.draw(rng)
        while value in taken:
            value = filler.draw(rng)
        values[key] = value
    return values


def _render(pattern: str, values: dict[str, Any]) -> str:
    return Template(pattern).substitute(values)


def _fill(pattern: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    values = _draw(_slots(pattern), rng)
    return _render(pattern, values), values


def _join(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _object_schema(keys: Iterable[str]) -> dict[str, Any]:
    keys = list(keys)
    return {
        "type": "object",
        "properties": {key: copy.deepcopy(_filler(key).schema) for key in keys},
        "required": keys,
        "additionalProperties": False,
    }


def _json_schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


# --- template registry ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Draft:
    """What a template decides; the sampling parameters and system prompt are drawn per kind afterwards."""

    user: str
    reference: str
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    stop: tuple[str, ...] = ()


_Builder = Callable[[random.Random], _Draft]
_TEMPLATES: dict[str, tuple[str, _Builder]] = {}

# Several phrasings per kind, drawn per subtask: a template id names the structure of a subtask, not its wording.
_WRAPPERS: dict[str, tuple[str, ...]] = {
    "code_completion": (
        "Complete this Python code. Reply with the missing lines only.\n```python\n$code\n```",
        "```python\n$code\n```\nWrite the rest of the function.",
        "Finish the function:\n$code",
    ),
    "code_edit": (
        "$instruction Return the full updated code.\n```python\n$code\n```",
        "```python\n$code\n```\n$instruction",
        "Edit this code. $instruction\n$code",
    ),
    "json_extraction": (
        "Extract $fields from the text as JSON.\n\nText: $text",
        "Return a JSON object with the keys $fields.\n$text",
        "$text\n\nGive the $fields as JSON.",
    ),
    "classification": (
        "Classify $what. Labels: $labels. $answer\n\n$field: $text",
        "$field: $text\n\nWhich label fits $what? Options: $labels. $answer",
    ),
    "qa_context": (
        "Context: $context\n\nQuestion: What is the $label? $answer",
        "$context\n\nBased on the text above, what is the $label? $answer",
        "Read this: $context\nWhat is the $label? $answer",
    ),
    "summarisation": (
        "Summarise in one sentence:\n\n$text",
        "TL;DR:\n$text",
        "Write a one-line summary of this text.\n\n$text",
    ),
    "rewriting": ("$instruction\n\n$text", "$instruction\nText: $text"),
}
_SYSTEM_PROMPTS = {
    "code_completion": "You are a coding assistant. Reply with code only.",
    "code_edit": "You are a coding assistant. Reply with code only.",
    "json_extraction": "You extract structured data. Reply with JSON only.",
    "tool_call_arguments": "You are an agent that calls tools.",
    "classification": "You are a text classifier.",
    "qa_context": "Answer using only the given context.",
    "summarisation": "You write short, factual summaries.",
    "rewriting": "You rewrite text exactly as instructed.",
    "brainstorming": "You are a creative brainstorming partner.",
    "creative_writing": "You are a creative writer.",
    "open_chat": "You are a friendly assistant.",
}
# Every option is at least the longest reference of its kind in characters, so no byte-level tokenizer truncates it.
_MAX_TOKENS = {
    "code_completion": (256, 512),
    "code_edit": (512, 1024),
    "json_extraction": (256, 512),
    "tool_call_arguments": (256, 512),
    "classification": (32, 64),
    "qa_context": (64, 128),
    "summarisation": (256, 512),
    "rewriting": (512, 1024),
    "brainstorming": (512, 1024),
    "creative_writing": (512, 1024),
    "open_chat": (256, 512, 1024),
}


def _register(kind: str, name: str, build: _Builder) -> None:
    _TEMPLATES[f"{kind}/{name}"] = (kind, build)


def _wrap(kind: str, rng: random.Random, **values: str) -> str:
    return _render(rng.choice(_WRAPPERS[kind]), values)


# --- records: json_extraction, qa_context, rewriting/dates_v1 -----------------------------------------------

_RECORDS = {
    "person_v1": "$name is a $age-year-old $job from $city.",
    "person_v2": "Contact card: $name, email $email, phone $phone, based in $city.",
    "order_v1": "Order $order_id for $quantity x $product was $status on $date.",
    "invoice_v1": "Invoice from $company dated $date: total $amount $currency, due in $days days.",
    "event_v1": "The $event with $name is on $date at $time in $city.",
    "product_v1": "The $product from $company costs $price $currency and is rated $rating out of 5.",
    "flight_v1": "Flight $flight from $origin to $destination leaves on $date at $time.",
    "employee_v1": "$name joined $company as a $job on $date with a salary of $salary $currency.",
    "ticket_v1": "Ticket $ticket_id from $email has $priority priority: the $product does not start.",
}


def _build_extraction(name: str, pattern: str, rng: random.Random) -> _Draft:
    text, values = _fill(pattern, rng)
    user = _wrap("json_extraction", rng, text=text, fields=_join(list(values)))
    roll = rng.random()
    if roll < 0.7:
        response_format = _json_schema_format(name, _object_schema(values))
    elif roll < 0.9:
        response_format = {"type": "json_object"}
    else:
        response_format = None
    return _Draft(user, json.dumps(values), response_format)


def _build_qa(name: str, pattern: str, rng: random.Random) -> _Draft:
    text, values = _fill(pattern, rng)
    key = rng.choice(list(values))
    # The distractor sentence must not hold another value of the asked slot's type, or the question is ambiguous.
    distractors = [
        other
        for other_name, other in _RECORDS.items()
        if other_name != name and all(_filler(slot) is not _filler(key) for slot in _slots(other))
    ]
    distractor, _ = _fill(rng.choice(distractors), rng)
    context = " ".join(rng.sample([text, distractor], 2))
    label = key.replace("_", " ")
    if rng.random() < 0.7:
        answer, reference = "Answer with the value only.", str(values[key])
    else:
        answer, reference = "Answer in one sentence.", f"The {label} is {values[key]}."
    return _Draft(_wrap("qa_context", rng, context=context, label=label, answer=answer), reference)


for _name, _pattern in _RECORDS.items():
    _register("json_extraction", _name, partial(_build_extraction, _name, _pattern))
    _register("qa_context", _name, partial(_build_qa, _name, _pattern))


# --- tool_call_arguments --------------------------------------------------------------------------------------

_TOOLS: dict[str, tuple[str, tuple[str, ...]]] = {
    "get_weather": ("Get the weather forecast for a city on a date.", ("city", "date")),
    "send_email": ("Send an email.", ("recipient", "subject")),
    "create_event": ("Add an event to the calendar.", ("event", "date", "time", "attendee")),
    "search_flights": ("Search flights between two cities.", ("origin", "destination", "date", "passengers")),
    "convert_currency": ("Convert an amount between currencies.", ("amount", "from_currency", "to_currency")),
    "lookup_order": ("Look up the status of an order.", ("order_id",)),
    "book_table": ("Reserve a restaurant table.", ("restaurant", "city", "time", "people")),
    "set_reminder": ("Create a reminder.", ("task", "date", "time")),
    "create_ticket": ("Open a support ticket.", ("product", "priority")),
}
_TOOL_REQUESTS = {
    "weather_v1": ("get_weather", "What will the weather be in $city on $date?"),
    "weather_v2": ("get_weather", "Do I need an umbrella in $city on $date?"),
    "email_v1": ("send_email", 'Email $recipient with the subject "$subject".'),
    "event_v1": ("create_event", "Put a $event on my calendar for $date at $time and invite $attendee."),
    "flights_v1": ("search_flights", "Find flights from $origin to $destination on $date for $passengers people."),
    "currency_v1": ("convert_currency", "How much is $amount $from_currency in $to_currency?"),
    "order_v1": ("lookup_order", "Where is my order $order_id?"),
    "table_v1": ("book_table", "Book a table at $restaurant in $city for $people at $time."),
    "reminder_v1": ("set_reminder", "Remind me to $task on $date at $time."),
    "ticket_v1": ("create_ticket", "My $product is broken, please open a $priority priority ticket."),
}


def _tool_spec(name: str) -> dict[str, Any]:
    description, parameters = _TOOLS[name]
    function = {"name": name, "description": description, "parameters": _object_schema(parameters)}
    return {"type": "function", "function": function}


def _build_tool_call(tool: str, pattern: str, rng: random.Random) -> _Draft:
    user, values = _fill(pattern, rng)
    offered = [tool, *rng.sample([other for other in _TOOLS if other != tool], rng.randint(0, 2))]
    rng.shuffle(offered)
    # Arguments follow the tool's parameter order, not the sentence's: the model has to look the values up.
    arguments = {key: values[key] for key in _TOOLS[tool][1]}
    reference = json.dumps({"name": tool, "arguments": arguments})
    return _Draft(user, reference, tools=[_tool_spec(name) for name in offered])


for _name, (_tool, _pattern) in _TOOL_REQUESTS.items():
    _register("tool_call_arguments", _name, partial(_build_tool_call, _tool, _pattern))


# --- classification -------------------------------------------------------------------------------------------

# (what is classified, field label, label -> phrasings): the label follows from keywords a small model can learn.
_CLASSIFIERS: dict[str, tuple[str, str, dict[str, tuple[str, ...]]]] = {
    "sentiment_v1": (
        "the sentiment of this review",
        "Review",
        {
            "positive": ("The $product works perfectly.", "I love my new $product, great value."),
            "negative": ("The $product broke after $days days.", "Terrible $product, a waste of money."),
            "neutral": ("The $product arrived on $date.", "The $product is okay, nothing special."),
        },
    ),
    "intent_v1": (
        "the intent of this customer message",
        "Message",
        {
            "refund": ("I want my money back for order $order_id.", "Please refund the $price $currency I paid."),
            "cancel": ("Please cancel order $order_id.", "I no longer need the $product, cancel my order."),
            "shipping": ("When will order $order_id arrive in $city?", "My $product has not been delivered yet."),
            "login": ("I cannot log in with $email.", "The password reset email never reached $email."),
        },
    ),
    "topic_v1": (
        "the topic of this headline",
        "Headline",
        {
            "sports": ("$city wins the cup final after extra time", "Star striker signs with $city club"),
            "finance": ("$company shares rise $percent percent", "$company reports record profit in quarter $quarter"),
            "technology": ("$company unveils a faster $product", "New chip from $company doubles battery life"),
            "weather": ("Heavy rain expected in $city on $date", "Heatwave hits $city this week"),
        },
    ),
    "spam_v1": (
        "this email as spam or not_spam",
        "Email",
        {
            "spam": ("WIN a free $product now!!! Click here", "You won $amount $currency, send your bank details"),
            "not_spam": ("Can we move the $event to $date?", "Hi $name, the invoice from $company is attached."),
        },
    ),
    "urgency_v1": (
        "the urgency of this ticket",
        "Ticket",
        {
            "high": ("The $service service is down for all users in $city!", "Every $service request fails."),
            "medium": ("The $service page is slow since $date.", "Some users in $city see $service errors."),
            "low": ("Please update the logo on the $service page.", "Typo in the $service help text."),
        },
    ),
}


def _build_classification(what: str, field: str, phrases: dict[str, tuple[str, ...]], rng: random.Random) -> _Draft:
    label = rng.choice(list(phrases))
    text, _ = _fill(rng.choice(phrases[label]), rng)
    prompt = partial(_wrap, "classification", rng, what=what, labels=", ".join(phrases), field=field, text=text)
    if rng.random() < 0.3:
        schema = {
            "type": "object",
            "properties": {"label": {"type": "string", "enum": list(phrases)}},
            "required": ["label"],
            "additionalProperties": False,
        }
        response_format = _json_schema_format("label", schema)
        return _Draft(prompt(answer='Reply in JSON as {"label": ...}.'), json.dumps({"label": label}), response_format)
    stop = ("\n",) if rng.random() < 0.3 else ()
    return _Draft(prompt(answer="Answer with the label only."), label, stop=stop)


for _name, (_what, _field, _phrases) in _CLASSIFIERS.items():
    _register("classification", _name, partial(_build_classification, _what, _field, _phrases))


# --- summarisation --------------------------------------------------------------------------------------------

# (source, summary): the summary reuses the source's values in a fixed order, so it is extractive and predictable.
_SUMMARIES = {
    "meeting_v1": (
        "Notes: $name met the $company team on $date to discuss the $product launch. "
        "$colleague will send a budget of $amount $currency by Friday.",
        "$name and $company discussed the $product launch on $date; $colleague will send the $amount $currency budget.",
    ),
    "incident_v1": (
        "At $time on $date the $service service in $city was down for $minutes minutes. "
        "The cause was a $cause. $name fixed it.",
        "Outage of the $service service in $city on $date: $minutes minutes, caused by a $cause, fixed by $name.",
    ),
    "delay_v1": (
        "Hi team, order $order_id for the $product is delayed until $date because of a $cause. "
        "Please tell the customers in $city. Thanks, $name",
        "Order $order_id ($product) is delayed until $date by a $cause; tell the $city customers.",
    ),
    "review_v1": (
        "I bought the $product from $company for $price $currency. "
        "It works well, but the $part broke after $days days.",
        "The $product from $company ($price $currency) works well, but the $part broke after $days days.",
    ),
    "earnings_v1": (
        "$company reported revenue of $amount $currency for quarter $quarter, up $percent percent. "
        "CEO $name credited the new $product.",
        "$company quarter $quarter revenue: $amount $currency, up $percent percent, thanks to the $product.",
    ),
}


def _build_summary(source: str, summary: str, rng: random.Random) -> _Draft:
    text, values = _fill(source, rng)
    return _Draft(_wrap("summarisation", rng, text=text), _render(summary, values))


for _name, (_source, _summary) in _SUMMARIES.items():
    _register("summarisation", _name, partial(_build_summary, _source, _summary))


# --- rewriting ------------------------------------------------------------------------------------------------

# (informal, formal) pairs with the same slots: a fixed phrase book the model can learn by heart.
_OPENERS = (("hey $name,", "Dear $name,"), ("hi $name!", "Hello $name,"), ("yo $name,", "Dear $name,"))
_REQUESTS = (
    ("can't make it to the $event on $date.", "I cannot attend the $event on $date."),
    ("gonna send the $product specs tmrw.", "I am going to send the $product specifications tomorrow."),
    ("thx for the help with $company.", "Thank you for your help with $company."),
    ("pls reply asap.", "Please reply as soon as possible."),
    ("wanna move the call to $time?", "Would you like to move the call to $time?"),
    ("lemme know about $city.", "Please let me know about $city."),
)
_CLOSERS = (("cheers, $colleague", "Kind regards, $colleague"), ("ttyl, $colleague", "Best regards, $colleague"))
_ACTIONS = (
    "book the $event room",
    "email $name",
    "update the $product page",
    "pay the $company invoice",
    "test the $service service",
    "call the $city office",
)
_HEADLINES = (
    "$company opens a new office in $city",
    "$name wins the $city marathon",
    "the best $product deals this week",
    "how $company rebuilt its $service team",
    "$city plans a new airport by $date",
)
_TYPOS = {
    "the": "teh",
    "receive": "recieve",
    "address": "adress",
    "separate": "seperate",
    "until": "untill",
    "which": "wich",
    "tomorrow": "tommorow",
    "definitely": "definately",
    "because": "becuase",
}
_TYPO_SENTENCES = (
    "I will definitely receive the $product tomorrow.",
    "Please send the address of the office to $name.",
    "Keep the invoices separate until the end of the month.",
    "Which office in $city will host the $event?",
    "$name is late because the train from $city stopped.",
)


def _formal(rng: random.Random) -> tuple[str, str]:
    pairs = [rng.choice(_OPENERS), *rng.sample(_REQUESTS, 2), rng.choice(_CLOSERS)]
    values = _draw(_slots(" ".join(informal for informal, _ in pairs)), rng)
    informal, formal = (" ".join(_render(pair[side], values) for pair in pairs) for side in (0, 1))
    return informal, formal


def _bullets(rng: random.Random) -> tuple[str, str]:
    actions = rng.sample(_ACTIONS, rng.randint(2, 4))
    values = _draw(_slots(" ".join(actions)), rng)
    items = [_render(action, values) for action in actions]
    return f"We need to {_join(items)}.", "\n".join(f"- {item[0].upper()}{item[1:]}" for item in items)


def _title_case(rng: random.Random) -> tuple[str, str]:
    headline = _fill(rng.choice(_HEADLINES), rng)[0].lower()
    return headline, " ".join(word[:1].upper() + word[1:] for word in headline.split(" "))


def _fix_typos(rng: random.Random) -> tuple[str, str]:
    correct, _ = _fill(" ".join(rng.sample(_TYPO_SENTENCES, 2)), rng)
    typo_words = [word for word in _TYPOS if rng.random() < 0.8]
    wrong = re.sub(rf"\b({'|'.join(typo_words)})\b", lambda m: _TYPOS[m.group(1)], correct) if typo_words else correct
    return wrong, correct


def _dates(rng: random.Random) -> tuple[str, str]:
    dated = [pattern for pattern in _RECORDS.values() if "$date" in pattern]
    text, _ = _fill(" ".join(rng.sample(dated, 2)), rng)
    return text, re.sub(r"(\d{4})-(\d{2})-(\d{2})", r"\3/\2/\1", text)


_REWRITES: dict[str, tuple[str, Callable[[random.Random], tuple[str, str]]]] = {
    "formal_v1": ("Rewrite this message in a formal tone.", _formal),
    "bullets_v1": ("Turn this sentence into a bullet list.", _bullets),
    "titlecase_v1": ("Capitalise the first letter of every word.", _title_case),
    "typos_v1": ("Fix the spelling mistakes.", _fix_typos),
    "dates_v1": ("Rewrite every date in DD/MM/YYYY format.", _dates),
}


def _build_rewrite(
    instruction: str, transform: Callable[[random.Random], tuple[str, str]], rng: random.Random
) -> _Draft:
    source, target = transform(rng)
    return _Draft(_wrap("rewriting", rng, instruction=instruction, text=source), target)


for _name, (_instruction, _transform) in _REWRITES.items():
    _register("rewriting", _name, partial(_build_rewrite, _instruction, _transform))


# --- code_completion and code_edit ----------------------------------------------------------------------------

# (header, body): the body follows from the header by copying its names, in one house style.
_SNIPPETS = {
    "sum_field": (
        'def total_$field(items):\n    """Return the sum of item.$field over all items."""',
        "    total = 0\n    for item in items:\n        total += item.$field\n    return total",
    ),
    "filter_min": (
        'def filter_by_$field(items, min_$field):\n    """Keep the items whose $field is at least min_$field."""',
        "    return [item for item in items if item.$field >= min_$field]",
    ),
    "init_assign": (
        'class $cls:\n    def __init__(self, $a, $b, $c):\n        """Store the $a, $b and $c."""',
        "        self.$a = $a\n        self.$b = $b\n        self.$c = $c",
    ),
    "to_dict": (
        'class $cls:\n    def to_dict(self):\n        """Return $a, $b and $c as a dict."""',
        '        return {"$a": self.$a, "$b": self.$b, "$c": self.$c}',
    ),
    "check_range": (
        'def check_$var(value):\n    """Raise ValueError unless $low <= value <= $high."""',
        "    if value < $low or value > $high:\n"
        '        raise ValueError(f"$var must be between $low and $high, got {value}")\n'
        "    return value",
    ),
    "get_setting": (
        'def get_$setting(config):\n    """Return config["$setting"], or $default when it is missing."""',
        '    return config.get("$setting", $default)',
    ),
    "count_state": (
        'def count_$state($noun):\n    """Count the $noun whose status is "$state"."""',
        '    return sum(1 for x in $noun if x.status == "$state")',
    ),
    "load_lines": (
        'def load_$noun(path):\n    """Read $noun from a text file, one per line, skipping blank lines."""',
        "    with open(path) as f:\n        return [line.strip() for line in f if line.strip()]",
    ),
}
_NEW_FUNCTION_NAMES = ("compute", "process", "handle", "run_check", "collect", "prepare", "evaluate", "build")
_NEW_VARIABLE_NAMES = ("values", "records", "entries", "rows", "data", "batch", "limit", "threshold", "cfg", "src")
_TODO_NOTES = ("handle None", "add logging", "check types", "cache this", "write tests", "support async")


def _fresh_name(code: str, candidates: Sequence[str], rng: random.Random) -> str:
    return rng.choice([name for name in candidates if not re.search(rf"\b{name}\b", code)])


def _rename(code: str, old: str, new: str) -> str:
    # Attribute accesses (item.price) keep their name: renaming a parameter must not rename fields.
    return re.sub(rf"(?<!\.)\b{re.escape(old)}\b", new, code)


def _rename_function(code: str, rng: random.Random) -> tuple[str, str] | None:
    match = re.search(r"def (?!__)(\w+)\(", code)
    if match is None:
        return None
    new = _fresh_name(code, _NEW_FUNCTION_NAMES, rng)
    return f"Rename the function `{match.group(1)}` to `{new}`.", _rename(code, match.group(1), new)


def _rename_parameter(code: str, rng: random.Random) -> tuple[str, str] | None:
    signature = re.search(r"def \w+\(([^)]*)\)", code)
    params = [p for p in signature.group(1).split(", ") if p not in ("", "self")] if signature else []
    if not params:
        return None
    old, new = rng.choice(params), _fresh_name(code, _NEW_VARIABLE_NAMES, rng)
    return f"Rename the parameter `{old}` to `{new}`.", _rename(code, old, new)


def _remove_docstring(code: str, rng: random.Random) -> tuple[str, str] | None:
    return "Remove the docstring.", "\n".join(line for line in code.split("\n") if not line.lstrip().startswith('"""'))


def _add_todo(code: str, rng: random.Random) -> tuple[str, str] | None:
    note = rng.choice(_TODO_NOTES)
    *head, last = code.split("\n")
    indent = last[: len(last) - len(last.lstrip())]
    return f"Add the comment `# TODO: {note}` above the last line.", "\n".join([*head, f"{indent}# TODO: {note}", last])


_EDITS: dict[str, Callable[[str, random.Random], tuple[str, str] | None]] = {
    "rename_function_v1": _rename_function,
    "rename_parameter_v1": _rename_parameter,
    "remove_docstring_v1": _remove_docstring,
    "add_todo_v1": _add_todo,
}


def _build_completion(header: str, body: str, rng: random.Random) -> _Draft:
    values = _draw(_slots(f"{header}\n{body}"), rng)
    stop = rng.choice(((), ("\ndef ", "\nclass "), ("```",)))
    return _Draft(_wrap("code_completion", rng, code=_render(header, values)), _render(body, values), stop=stop)


def _build_edit(edit: Callable[[str, random.Random], tuple[str, str] | None], rng: random.Random) -> _Draft:
    # Not every edit suits every snippet (a method with only self has no parameter to rename): try them in turn.
    for header, body in rng.sample(list(_SNIPPETS.values()), len(_SNIPPETS)):
        code, _ = _fill(f"{header}\n{body}", rng)
        result = edit(code, rng)
        if result is not None:
            instruction, edited = result
            return _Draft(_wrap("code_edit", rng, instruction=instruction, code=code), edited)
    raise ValueError(f"no snippet suits the edit {edit.__name__}")


for _name, (_header, _body) in _SNIPPETS.items():
    _register("code_completion", _name, partial(_build_completion, _header, _body))
for _name, _edit in _EDITS.items():
    _register("code_edit", _name, partial(_build_edit, _edit))


# --- open-ended kinds -----------------------------------------------------------------------------------------

# Every word is an independent draw from these pools, so no model can guess the next phrase of a reference.
_WORDS: dict[str, tuple[str, ...]] = {
    "adj": ("quiet", "golden", "restless", "tiny", "bright", "old", "gentle", "strange", "warm", "silver", "hidden"),
    "noun": ("river", "lantern", "garden", "window", "letter", "engine", "cloud", "bridge", "melody", "street"),
    "verb": ("drifts", "waits", "shines", "wanders", "hums", "falls", "grows", "listens", "turns", "fades"),
    "base": ("host", "build", "try", "start", "plan", "share", "learn", "visit", "map", "write", "paint"),
    "prep": ("beside", "under", "across", "behind", "near", "above", "through", "around"),
    "adv": ("slowly", "softly", "again", "suddenly", "quietly", "always", "rarely", "gladly"),
    "opener": ("Honestly,", "I think", "Maybe", "To be fair,", "In my view,", "Sometimes", "Well,"),
}
_WORDS["adj2"], _WORDS["noun2"] = _WORDS["adj"], _WORDS["noun"]
_FRAMES: dict[str, tuple[str, ...]] = {
    "prose": ("the $adj $noun $verb $prep the $noun2.", "a $adj $noun $verb $adv $prep the $adj2 $noun2."),
    "verse": ("$adj $noun, $adj2 $noun2", "the $noun $verb $adv", "$prep the $adj $noun"),
    "idea": ("$base a $adj $noun", "$base the $noun $prep the $noun2", "$base $adv with a $adj $noun"),
    "question": ("why is the $noun so $adj?", "what makes a $noun $adj?", "how could we $base a $adj $noun?"),
    "name": ("$adj $noun", "$noun $noun2"),
    "chat": ("$opener the $noun $verb $adv.", "$opener a $adj $noun is nice.", "$opener I would $base a $noun."),
}


def _phrase(frames: str, rng: random.Random) -> str:
    frame = rng.choice(_FRAMES[frames])
    text = _render(frame, {slot: rng.choice(_WORDS[slot]) for slot in _slots(frame)})
    return text[0].upper() + text[1:]


def _layout(layout: str, frames: str, values: dict[str, Any], rng: random.Random) -> str:
    if layout == "numbered":
        return "\n".join(f"{i}. {_phrase(frames, rng)}" for i in range(1, values.get("count", 3) + 1))
    if layout == "lines":
        return "\n".join(_phrase(frames, rng) for _ in range(rng.randint(3, 5)))
    return " ".join(_phrase(frames, rng) for _ in range(rng.randint(2, 4)))


_OPEN_TEMPLATES: dict[str, dict[str, tuple[str, str, str]]] = {  # kind -> name -> (prompt, frames, layout)
    "brainstorming": {
        "ideas_v1": ("Give me $count ideas for $topic.", "idea", "numbered"),
        "names_v1": ("Suggest $count names for a new $product brand.", "name", "numbered"),
        "questions_v1": ("List $count questions to ask about $topic.", "question", "numbered"),
    },
    "creative_writing": {
        "story_v1": ("Write a very short story about a $character in $city.", "prose", "paragraph"),
        "poem_v1": ("Write a short poem about $topic.", "verse", "lines"),
        "scene_v1": ("Describe the $place at night in a few sentences.", "prose", "paragraph"),
    },
    "open_chat": {
        "opinion_v1": ("What do you think about $topic?", "chat", "paragraph"),
        "smalltalk_v1": ("Hi! How is your day going?", "chat", "paragraph"),
        "weekend_v1": ("Any plans for a weekend in $city?", "idea", "lines"),
    },
}


def _build_open(pattern: str, frames: str, layout: str, rng: random.Random) -> _Draft:
    user, values = _fill(pattern, rng)
    return _Draft(user, _layout(layout, frames, values, rng))


for _kind, _table in _OPEN_TEMPLATES.items():
    for _name, (_pattern, _frames, _layout_name) in _table.items():
        _register(_kind, _name, partial(_build_open, _pattern, _frames, _layout_name))


# --- public API -----------------------------------------------------------------------------------------------


def templates_of(kind: str) -> list[str]:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    return [name for name, (template_kind, _) in _TEMPLATES.items() if template_kind == kind]


def _sampling(kind: str, rng: random.Random) -> tuple[float, float]:
    """Agents mostly decode the deterministic kinds greedily and the open-ended ones with sampling, but not always:
    the classifier must learn from the content, not just from the temperature."""
    open_ended = kind in OPEN_ENDED_KINDS
    if rng.random() < (0.15 if open_ended else 0.8):
        return 0.0, 1.0
    temperature = rng.choice((0.7, 0.8, 0.9, 1.0)) if open_ended else 0.7
    return temperature, rng.choice((0.9, 0.95, 1.0))


def _realise(template: str, rng: random.Random) -> Subtask:
    kind, build = _TEMPLATES[template]
    draft = build(rng)
    messages = [{"role": "user", "content": draft.user}]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": _SYSTEM_PROMPTS[kind]})
    temperature, top_p = _sampling(kind, rng)
    return Subtask(
        kind=kind,
        template=template,
        messages=messages,
        response_format=draft.response_format,
        tools=draft.tools,
        temperature=temperature,
        top_p=top_p,
        max_tokens=rng.choice(_MAX_TOKENS[kind]),
        stop=list(draft.stop),
        reference=draft.reference,
    )


def generate_subtasks(
    n: int,
    seed: int = 0,
    kinds: Sequence[str] | None = None,
    templates: Sequence[str] | None = None,
) -> list[Subtask]:
    """``n`` subtasks, the selected kinds in equal shares (so any n >= number of kinds covers every kind), each
    from a template drawn uniformly within its kind, in shuffled order. ``kinds`` and ``templates`` both filter."""
    for kind in kinds or ():
        templates_of(kind)
    unknown = sorted(set(templates or ()) - set(_TEMPLATES))
    if unknown:
        raise ValueError(f"unknown templates: {', '.join(unknown)}")
    wanted = set(templates) if templates is not None else set(_TEMPLATES)
    pools = {kind: [t for t in templates_of(kind) if t in wanted] for kind in KINDS if kinds is None or kind in kinds}
    pools = {kind: pool for kind, pool in pools.items() if pool}
    if not pools:
        raise ValueError("no template matches the given kinds and templates")
    rng = random.Random(seed)
    order = list(pools)
    subtasks = [_realise(rng.choice(pools[order[i % len(order)]]), rng) for i in range(n)]
    rng.shuffle(subtasks)
    return subtasks


def split_by_template(
    subtasks: Sequence[Subtask],
    seed: int = 0,
    *,
    val_fraction: float = 0.15,
    test_fraction: float = 0.2,
) -> tuple[list[Subtask], list[Subtask], list[Subtask]]:
    """Train/val/test where val and test hold only templates that train never saw, so scores measure whether a
    classifier generalises to new task shapes rather than memorising the ones it was trained on.

    Templates are split within each kind: a kind with at least 3 templates gets at least one in each split (and
    so always appears in train); a kind with fewer keeps them all in train.
    """
    by_kind: dict[str, set[str]] = {}
    for subtask in subtasks:
        by_kind.setdefault(subtask.kind, set()).add(subtask.template)
    split_of: dict[str, int] = {}
    for kind, names in by_kind.items():
        order = sorted(names)
        random.Random(f"{seed}:{kind}").shuffle(order)
        n_test = n_val = 0
        if len(order) >= 3:
            n_test = max(1, round(len(order) * test_fraction))
            n_val = min(max(1, round(len(order) * val_fraction)), len(order) - n_test - 1)
        for i, name in enumerate(order):
            split_of[name] = 2 if i < n_test else 1 if i < n_test + n_val else 0
    splits: tuple[list[Subtask], list[Subtask], list[Subtask]] = ([], [], [])
    for subtask in subtasks:
        splits[split_of[subtask.template]].append(subtask)
    return splits


def write_jsonl(subtasks: Iterable[Subtask], path: str | Path) -> Path:
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for subtask in subtasks:
            f.write(json.dumps(asdict(subtask)) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[Subtask]:
    with Path(path).open(encoding="utf-8") as f:
        return [Subtask(**json.loads(line)) for line in f if line.strip()]
