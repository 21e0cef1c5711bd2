"""schemathesis over the gateway's own /openapi.json, every endpoint: no 5xx, and every response, refusals
included, matches the schema it documents (status, content type, body).

Bounded and repeatable: a few derandomized examples per endpoint, bodies that fit the schema and bodies that do
not, and ``max_tokens`` kept to a handful, since the point is the contract, not generating text. Generated bodies
mostly break some rule of the SDK and must come back as documented 4xx; the ones that do not are real completions
on the tiny models. (schemathesis' own pytest plugin, ``from_fixture``, does not run on this pytest, so the
operations are walked here.)
"""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.test_gateway_support import decision_log, gateway, gateway_router, router_models  # noqa: F401

MAX_TOKENS = 4
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
BOUNDED = settings(
    max_examples=6,
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


def bounded(case) -> None:
    """Ask for a handful of tokens at most: any valid body is still a real completion, just a short one."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(name), int) and case.body[name] > MAX_TOKENS:
                case.body[name] = MAX_TOKENS


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_endpoint_keeps_its_documented_contract(gateway, subtests, mode):
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "POST /v1/completions", "GET /readyz"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not operation.body:
            continue  # only a body can be made to break its schema here: these take no parameters worth negating

        @BOUNDED
        @given(case=operation.as_strategy(mode))
        def check(case) -> None:
            bounded(case)
            case.call_and_validate(base_url=gateway.url, checks=CHECKS, timeout=30)

        with subtests.test(operation=operation.label):
            check()
