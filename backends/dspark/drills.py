"""Copy drills: chat documents whose answers can only be written by copying values from the prompt.

The agent subtasks draw their values (names, cities, dates) from short lists, so a small model lowers its loss
fastest by learning those lists and guessing, which is what it does: asked for the fields of a sentence it
answers in the right shape with another sentence's values. Drills use values drawn from spaces far too large
to learn (invented words, codes, numbers, dates of 40 years), in the same shapes the subtasks ask for (JSON
fields, a value looked up by its key, tool-call arguments, text repeated exactly), so the only way to predict
an answer is to find the value in the prompt and copy it: the induction behaviour the subtasks need.

A model that has learnt to copy also copies its own last tokens when nothing in the prompt tells it what to
write: asked for an instance of an unfamiliar JSON schema under a grammar, it wrote numbers and lists that
never closed (`13E-1151515...`, `[385, 385, 385, ...`). Schema drills are the counterweight: random schemas in
the note every structured request carries (:func:`backends.prompting.prompt_messages`), each answered by one
short instance that copies the schema's keys and listed values and closes every number, string and list.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

from backends.prompting import format_instructions

_ONSETS = ("b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "kl", "l", "m", "n", "p", "pr", "r")
_ONSETS += ("s", "sh", "st", "t", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou")
_CODAS = ("", "", "", "n", "r", "s", "l", "m", "k", "x", "th")
KEYS = ("name", "city", "date", "time", "id", "code", "email", "amount", "product", "company", "country", "colour")
KEYS += ("order_id", "user", "title", "tag", "room", "team", "price", "quantity", "street", "phone", "ref", "model")
_FUNCTIONS = ("lookup", "create", "send", "book", "cancel", "update", "fetch", "schedule", "assign", "move")
_OBJECTS = ("order", "ticket", "meeting", "invoice", "user", "report", "room", "shipment", "task", "alert")
_SYSTEM = {
    "json": "You extract structured data. Reply with JSON only.",
    "lookup": "Answer using only the given context.",
    "tool": "You are an agent that calls tools.",
    "repeat": "You rewrite text exactly as instructed.",
}
_ASK_EXAMPLE = ("Give one JSON example of {}", "Write a JSON {} object.", "Fill in {} as JSON.", "{}")
_PLACEHOLDERS = {
    "string": ("example", "string", "text", "abc", "value", "test", "none"),
    "integer": (0, 1, 2, 5, 10, 100),
    "number": (0, 1, 0.5, 1.5, 10.0),
    "date": ("2024-01-01", "2025-06-30", "2020-12-31"),
    "date-time": ("2024-01-01T00:00:00Z", "2025-06-30T12:00:00Z"),
    "email": ("user@example.com", "name@example.org"),
    "uri": ("https://example.com", "https://example.org/path"),
    "uuid": ("00000000-0000-0000-0000-000000000000", "123e4567-e89b-12d3-a456-426614174000"),
}
"""What a schema drill answers where the prompt holds no value to copy: a handful of plain placeholders, never
random numbers or words. A drill that invented values taught the model that the numbers of a JSON answer are
its to make up, and its extractions then got dates, prices and salaries wrong (JSON fields 0.79 on held-out
subtasks against 1.00 without the drills)."""


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))


_KIND_OF = {"name": 0, "user": 0, "city": 1, "company": 1, "country": 1, "product": 1, "team": 1, "date": 2}
_KIND_OF |= {"time": 3, "id": 4, "code": 4, "order_id": 4, "ref": 4, "room": 4, "model": 4, "email": 5}
_KIND_OF |= {"amount": 6, "price": 6, "quantity": 6, "phone": 6, "title": 7, "street": 7, "tag": 7, "colour": 1}


def _value(rng: random.Random, key: str) -> str | int:
    """One value of the kind its key names (any kind for an invented key), drawn from a space no model of this
    size can memorise."""
    kind = _KIND_OF.get(key, rng.randrange(8))
    if kind == 0:
        return f"{_word(rng).title()} {_word(rng).title()}"
    if kind == 1:
        return _word(rng).title()
    if kind == 2:
        return f"{rng.randint(2000, 2039)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == 3:
        return f"{rng.randint(0, 23):02d}:{rng.choice(('00', '15', '30', '45', f'{rng.randint(0, 59):02d}'))}"
    if kind == 4:
        letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(rng.randint(2, 4)))
        return f"{letters}-{rng.randint(10, 99999)}"
    if kind == 5:
        return f"{_word(rng)}.{_word(rng)}@{_word(rng)}.{rng.choice(('com', 'org', 'test', 'io'))}"
    if kind == 6:
        return rng.randint(1, 99999)
    return " ".join(_word(rng) for _ in range(rng.randint(2, 4)))


def _fields(rng: random.Random) -> dict[str, str | int]:
    keys = rng.sample(KEYS, rng.randint(2, 5)) if rng.random() < 0.7 else [_word(rng) for _ in range(rng.randint(2, 4))]
    return {key: _value(rng, key) for key in dict.fromkeys(keys)}


def _said(fields: dict[str, str | int]) -> str:
    return ", ".join(f"{key} is {value}" for key, value in fields.items())


def _json_drill(rng: random.Random) -> tuple[str, str, str]:
    fields = _fields(rng)
    keys = ", ".join(fields)
    asks = (f"Put these fields in JSON: {_said(fields)}.", f"Text: {_said(fields)}.\n\nGive the {keys} as JSON.")
    return "json", rng.choice(asks), json.dumps(fields)


def _lookup_drill(rng: random.Random) -> tuple[str, str, str]:
    fields = _fields(rng)
    key = rng.choice(list(fields))
    context = "\n".join(f"{k}: {v}" for k, v in fields.items())
    return (
        "lookup",
        f"Context:\n{context}\n\nQuestion: What is the {key}? Answer with the value only.",
        str(fields[key]),
    )


def _tool_drill(rng: random.Random) -> tuple[str, str, str]:
    name = f"{rng.choice(_FUNCTIONS)}_{rng.choice(_OBJECTS)}"
    arguments = _fields(rng)
    call = json.dumps({"name": name, "arguments": arguments})
    return "tool", f"Call {name} with {_said(arguments)}.", call


def _repeat_drill(rng: random.Random) -> tuple[str, str, str]:
    text = " ".join(str(_value(rng, rng.choice(KEYS))) for _ in range(rng.randint(2, 6)))
    return "repeat", f"Repeat exactly: {text}", text


def _schema_and_instance(rng: random.Random, depth: int, key: str) -> tuple[dict[str, Any], Any]:
    """A random subschema of the shapes real schemas use most, and one short value it admits: a listed value
    copied from the schema, the key's own name, or a placeholder."""
    roll = rng.random()
    if depth < 2 and roll < 0.15:
        return _object_schema(rng, depth + 1)
    if depth < 2 and roll < 0.3:
        items, value = _schema_and_instance(rng, depth + 1, key)
        return {"type": "array", "items": items}, [value] if rng.random() < 0.7 else []
    if roll < 0.45:
        values = [_word(rng) for _ in range(rng.randint(2, 4))]
        return {"type": "string", "enum": values}, rng.choice(values)
    if roll < 0.6:
        low = rng.choice((0, 1, 0, -10))
        schema = {"type": "integer"} | ({"minimum": low} if rng.random() < 0.4 else {})
        return schema, max(low, rng.choice(_PLACEHOLDERS["integer"]))
    if roll < 0.68:
        return {"type": "number"}, rng.choice(_PLACEHOLDERS["number"])
    if roll < 0.76:
        return {"type": "boolean"}, rng.random() < 0.5
    if roll < 0.84:
        name = rng.choice(("date", "date-time", "email", "uri", "uuid"))
        return {"type": "string", "format": name}, rng.choice(_PLACEHOLDERS[name])
    if roll < 0.87:
        return {"type": "null"}, None
    return {"type": "string"}, key if rng.random() < 0.3 else rng.choice(_PLACEHOLDERS["string"])


def _object_schema(rng: random.Random, depth: int) -> tuple[dict[str, Any], dict[str, Any]]:
    keys = list(dict.fromkeys(rng.sample(KEYS, rng.randint(1, 4)) + [_word(rng) for _ in range(rng.randint(0, 1))]))
    properties, instance = {}, {}
    for key in keys:
        properties[key], instance[key] = _schema_and_instance(rng, depth, key)
    required = [key for key in keys if rng.random() < 0.6]
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    if rng.random() < 0.4:
        schema["additionalProperties"] = False
    present = {key: value for key, value in instance.items() if key in required or rng.random() < 0.7}
    return schema, present


def _schema_drill(rng: random.Random) -> tuple[str, str, str]:
    schema, instance = _object_schema(rng, 0)
    if rng.random() < 0.3:
        schema = {"title": _word(rng).title()} | schema
    name = f"{_word(rng)} {rng.choice(_OBJECTS)}"
    system = format_instructions({"type": "json_schema", "json_schema": {"schema": schema}}, None)
    return system, rng.choice(_ASK_EXAMPLE).format(name), json.dumps(instance)


DRILLS: tuple[Callable[[random.Random], tuple[str, str, str]], ...] = (
    _json_drill,
    _lookup_drill,
    _tool_drill,
    _repeat_drill,
    _schema_drill,
)


def iter_copy_drills(seed: int) -> Iterator[tuple[list[dict[str, str]], str]]:
    """(messages, answer) pairs, the drills in turn, forever, reproducible from ``seed``."""
    rng = random.Random(f"drills:{seed}")
    for i in itertools.count():
        system, user, answer = DRILLS[i % len(DRILLS)](rng)
        yield [{"role": "system", "content": _SYSTEM.get(system, system)}, {"role": "user", "content": user}], answer
