"""Rewrite a JSON schema into one llguidance can compile, without changing which documents it accepts.

llguidance refuses ``not``, ``dependencies``, ``oneOf`` and a few other keywords, and the request is then
refused too (see ``formats.py``): a grammar that ignored them would let invalid output through. Many real
schemas use them in shapes with an exact equivalent in keywords llguidance does enforce, so each rule here
rewrites one such shape and leaves every other one alone, for llguidance to compile or refuse:

- **Finite values.** A subschema whose values are listed (``enum``/``const``, itself or in an ``allOf``
  branch) becomes the list of those values that ``jsonschema`` finds valid against the whole subschema, so any
  keyword beside it (``not`` included) is decided value by value.
- **Negation.** ``not`` of ``required``, of ``type``, of ``not``, and of ``anyOf``/``allOf`` of those (De
  Morgan) has a positive form: "object without property p" is ``{"type": "object", "properties": {p: false}}``.
- **Dependencies.** ``dependencies``/``dependentRequired``/``dependentSchemas`` for property p is "p absent, or
  the dependency holds": an ``anyOf`` of ``{"properties": {p: false}}`` and the dependency with p required.
  Since draft 2019-09 ``dependencies`` is no longer a keyword (validators of those dialects skip it), but
  schemas without ``$schema`` still use it as earlier drafts define it; it is enforced that way, which is what
  its author meant and can only narrow what is accepted, never let through a document the validator rejects.
- **Exclusive choice.** ``oneOf`` whose branches no document can match twice is ``anyOf``. Disjointness is
  proven only from types, listed values, a required property whose listed values differ, or a property one
  branch requires and the other forbids; anything less stays ``oneOf`` (and is refused).

Only ``format`` values llguidance does not know are dropped outright: JSON Schema's default vocabulary treats
``format`` as an annotation, validators (``jsonschema`` included) do not assert it unless asked to, so this
keeps validity as it is; formats llguidance knows (date-time, email, uuid, ipv4...) stay enforced.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from jsonschema import Draft202012Validator, validators
from llguidance import LLMatcher

Schema = dict[str, Any] | bool

JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string"})
# Keywords that hold a schema, a list of schemas or a name -> schema map: the only places the walk descends,
# so data (enum, const, default, examples) and property names are never mistaken for schemas.
ONE_SCHEMA = (
    "not",
    "items",
    "additionalItems",
    "additionalProperties",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# (dependencies and dependentSchemas hold schemas too, rewritten as they are replaced: see _dependency.)
SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs")
# Keywords that neither constrain a value nor hold one the rewrite needs; identity keywords stay on a
# rewritten node so references into it still resolve.
ANNOTATIONS = frozenset({"title", "description", "$comment", "comment", "default", "examples", "deprecated"})
KEPT_ON_REWRITE = ("$schema", "$id", "id", "$anchor", "definitions", "$defs")


def equivalent_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every rewritable shape rewritten (see the module docstring)."""
    validator_class = validators.validator_for(schema, default=Draft202012Validator)
    root_validator = validator_class(schema)

    def is_valid(value: Any, node: dict[str, Any]) -> bool:
        return next(root_validator.descend(value, node), None) is None

    rewritten = _rewrite(schema, _Context(root=schema, is_valid=is_valid))
    assert isinstance(rewritten, dict)
    return rewritten


class _Context:
    """The root (for local ``$ref``) and a validator bound to it (for filtering listed values)."""

    def __init__(self, root: dict[str, Any], is_valid: Callable[[Any, dict[str, Any]], bool]) -> None:
        self.root = root
        self.is_valid = is_valid

    def resolve(self, node: Schema) -> Schema:
        """A local ``{"$ref": "#/..."}`` followed to its target; anything else as it is."""
        seen = 0
        while isinstance(node, dict) and set(node) - ANNOTATIONS == {"$ref"} and seen < 32:
            ref = node["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                return node
            target: Any = self.root
            for part in ref[1:].split("/")[1:] if ref != "#" else []:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                    target = target[int(part)]
                else:
                    return node
            node, seen = target, seen + 1
        return node


def _rewrite(node: Schema, ctx: _Context) -> Schema:
    if not isinstance(node, dict):
        return node
    if (listed := _filtered_values(node, ctx)) is not None:
        kept = {key: _rewrite_children(key, node[key], ctx) for key in KEPT_ON_REWRITE if key in node}
        return {**kept, "enum": listed}
    rewritten = {key: _rewrite_children(key, value, ctx) for key, value in node.items()}
    rewritten = _drop_unknown_format(rewritten)
    extra: list[Schema] = []
    for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
        if isinstance(node.get(keyword), dict):
            extra += [_dependency(name, dep, ctx) for name, dep in node[keyword].items()]
            del rewritten[keyword]
    if "not" in node and (positive := _negate(node["not"], ctx)) is not None:
        extra.append(_rewrite(positive, ctx))
        del rewritten["not"]
    if isinstance(node.get("oneOf"), list) and _pairwise_disjoint(node["oneOf"], _types(node, ctx), ctx):
        extra.append({"anyOf": rewritten.pop("oneOf")})
    if extra:
        rewritten["allOf"] = [*rewritten.get("allOf", []), *extra]
    return rewritten


def unenforced_keyword(schema: Schema) -> str | None:
    """Why llguidance would compile ``schema`` (an :func:`equivalent_schema` result, so without dependencies
    keywords) yet let an invalid document through, or None.

    One case is known: llguidance does not stop a key matched by ``patternProperties`` or
    ``additionalProperties`` from repeating, and a parser keeps the last of repeated keys, so a
    ``minProperties`` of 2 or more over such keys can be met in the text and missed in the parsed object.
    """
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        minimum = node.get("minProperties")
        open_keys = "patternProperties" in node or node.get("additionalProperties", True) is not False
        if isinstance(minimum, int) and minimum >= 2 and open_keys:
            return (
                f"minProperties {minimum} over keys that patternProperties or additionalProperties admit is not "
                "enforced (repeated keys would count), so the schema is refused"
            )
        for key, value in node.items():
            if key in SCHEMA_LISTS and isinstance(value, list):
                stack.extend(value)
            elif key in ONE_SCHEMA:
                stack.append(value)
            elif key in SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
    return None


def _filtered_values(node: dict[str, Any], ctx: _Context) -> list[Any] | None:
    """The node's listed values that are valid against all of it, when it lists values beside other keywords.

    None when it lists none, has nothing beside them, or ``jsonschema`` cannot decide (a reference it cannot
    resolve, a pattern it cannot compile): the node is then left for llguidance to compile or refuse.
    """
    values = _listed_values(node, ctx)
    if values is None or not set(node) - ANNOTATIONS - set(KEPT_ON_REWRITE) - {"enum", "const"}:
        return None
    try:
        return _unique(value for value in values if ctx.is_valid(value, node))
    except Exception:  # any validator failure means "undecided", never "valid"
        return None


def _rewrite_children(key: str, value: Any, ctx: _Context) -> Any:
    if key in SCHEMA_LISTS and isinstance(value, list):
        return [_rewrite(item, ctx) for item in value]
    if key in ONE_SCHEMA:
        return _rewrite(value, ctx)
    if key in SCHEMA_MAPS and isinstance(value, dict):
        return {name: _rewrite(item, ctx) for name, item in value.items()}
    return value


def _drop_unknown_format(node: dict[str, Any]) -> dict[str, Any]:
    if isinstance(node.get("format"), str) and not _known_format(node["format"]):
        return {key: value for key, value in node.items() if key != "format"}
    return node


@functools.cache
def _known_format(name: str) -> bool:
    grammar = LLMatcher.grammar_from_json_schema(json.dumps({"type": "string", "format": name}))
    return not LLMatcher.validate_grammar(grammar)


def _dependency(name: str, dependency: Any, ctx: _Context) -> dict[str, Any]:
    """``name`` absent, or present with its dependency: a list of properties also required, or a schema."""
    if isinstance(dependency, list):
        holds: Schema = {"required": [name, *dependency]}
    else:
        holds = {"required": [name], "allOf": [_rewrite(dependency, ctx)]}
    return {"anyOf": [{"properties": {name: False}}, holds]}


def _negate(node: Schema, ctx: _Context) -> Schema | None:
    """A schema accepting exactly the documents ``node`` rejects, or None when none is known."""
    node = ctx.resolve(node)
    if node is False:
        return {}
    if not isinstance(node, dict):
        return None
    keys = set(node) - ANNOTATIONS
    if keys == {"required"} and isinstance(node["required"], list) and node["required"]:
        branches = [{"type": "object", "properties": {name: False}} for name in node["required"]]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    if keys == {"type"}:
        named = {node["type"]} if isinstance(node["type"], str) else set(node["type"])
        if "integer" in named and "number" not in named:
            return None
        allowed = sorted(JSON_TYPES - named)
        return {"type": allowed} if allowed else None
    if keys == {"not"}:
        return node["not"]
    if keys in ({"anyOf"}, {"allOf"}) and isinstance(node[next(iter(keys))], list):
        parts = [_negate(part, ctx) for part in node[next(iter(keys))]]
        if any(part is None for part in parts):
            return None
        return {"allOf": parts} if keys == {"anyOf"} else {"anyOf": parts}
    return None


def _listed_values(node: dict[str, Any], ctx: _Context) -> list[Any] | None:
    """The values a node can take when it lists them (``const``, ``enum``, or an ``allOf`` branch's), else None."""
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return node["enum"]
    for branch in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
        branch = ctx.resolve(branch)
        if isinstance(branch, dict) and set(branch) - ANNOTATIONS in ({"enum"}, {"const"}):
            return _listed_values(branch, ctx)
    return None


def _types(node: Schema, ctx: _Context) -> frozenset[str]:
    """JSON types a document matching ``node`` can have, as far as its own keywords tell ("integer" is "number")."""
    node = ctx.resolve(node)
    if node is False:
        return frozenset()
    if not isinstance(node, dict):
        return JSON_TYPES
    types = JSON_TYPES
    if isinstance(node.get("type"), str | list):
        named = {node["type"]} if isinstance(node["type"], str) else set(node["type"])
        types = frozenset("number" if name == "integer" else name for name in named) & JSON_TYPES
    values = _listed_values(node, ctx)
    if values is not None:
        types &= frozenset(_json_type(value) for value in values)
    if _negated_required(node):
        types &= {"object"}
    return types


def _pairwise_disjoint(branches: list[Any], context_types: frozenset[str], ctx: _Context) -> bool:
    resolved = [ctx.resolve(branch) for branch in branches]
    return all(_disjoint(a, b, context_types, ctx) for i, a in enumerate(resolved) for b in resolved[i + 1 :])


def _disjoint(a: Schema, b: Schema, context_types: frozenset[str], ctx: _Context) -> bool:
    """True only when no document of a type in ``context_types`` can match both ``a`` and ``b``."""
    common = _types(a, ctx) & _types(b, ctx) & context_types
    if not common:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    values_a, values_b = _listed_values(a, ctx), _listed_values(b, ctx)
    if values_a is not None and values_b is not None:
        return not _overlap(values_a, values_b)
    if common != {"object"}:
        return False
    required_a, required_b = set(_required(a)), set(_required(b))
    if required_a & _forbidden(b) or required_b & _forbidden(a):
        return True
    for name in required_a & required_b:
        values_a = _property_values(a, name, ctx)
        values_b = _property_values(b, name, ctx)
        if values_a is not None and values_b is not None and not _overlap(values_a, values_b):
            return True
    return False


def _overlap(a: list[Any], b: list[Any]) -> bool:
    return bool({_canonical(v) for v in a} & {_canonical(v) for v in b})


def _required(node: dict[str, Any]) -> list[str]:
    return [name for name in node.get("required", []) if isinstance(name, str)]


def _forbidden(node: dict[str, Any]) -> set[str]:
    """Properties an object matching ``node`` cannot have: ``"properties": {p: false}`` or
    ``"not": {"required": [p]}``."""
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    names = {name for name, schema in properties.items() if schema is False}
    required = _negated_required(node)
    return names | set(required) if len(required) == 1 else names


def _negated_required(node: dict[str, Any]) -> list[str]:
    """The names in ``"not": {"required": [...]}``, which only an object can satisfy (``required`` holds
    vacuously for anything else, so its negation fails)."""
    negated = node.get("not")
    if isinstance(negated, dict) and set(negated) - ANNOTATIONS == {"required"}:
        return [name for name in negated["required"] if isinstance(name, str)]
    return []


def _property_values(node: dict[str, Any], name: str, ctx: _Context) -> list[Any] | None:
    properties = node.get("properties")
    if not isinstance(properties, dict) or name not in properties:
        return None
    schema = ctx.resolve(properties[name])
    return _listed_values(schema, ctx) if isinstance(schema, dict) else None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _canonical(value: Any) -> str:
    """One spelling per JSON value as JSON Schema compares them: 1 and 1.0 equal, true and 1 not."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int | float):
        return f"n:{float(value)!r}"
    if isinstance(value, list):
        return "[" + ",".join(_canonical(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_canonical(v)}" for k, v in sorted(value.items())) + "}"
    return json.dumps(value)


def _unique(values: Any) -> list[Any]:
    seen: set[str] = set()
    unique = []
    for value in values:
        if (key := _canonical(value)) not in seen:
            seen.add(key)
            unique.append(value)
    return unique
