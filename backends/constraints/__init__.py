"""Grammar-constrained decoding shared by every backend: JSON schemas, regexes, Lark grammars and tool calls."""

from backends.constraints.engine import ConstraintError, GrammarConstraint
from backends.constraints.formats import request_grammar
from backends.constraints.tools import cut_tool_call, parse_tool_calls, resolve_tool_choice

__all__ = [
    "ConstraintError",
    "GrammarConstraint",
    "cut_tool_call",
    "parse_tool_calls",
    "request_grammar",
    "resolve_tool_choice",
]
