"""bench trace's llama.cpp peer: each request reaches ``llama-lookup`` under the JSON schema our pools enforce on it,
and its report is read into tokens decoded, accepted and timed."""

from __future__ import annotations

import pytest

from backends.types import GenerationRequest
from benchmarks.llama_lookup import output_schema, read_report
from benchmarks.trace_jobs import CONTACT_SCHEMA, EVENT_TOOL, JOBS, requests

# What llama-lookup (vendor/llama.cpp of the pinned llama-cpp-python) printed here for a request it had seen before.
REPORT = """
0.00.750.411 I encoded   21 tokens in    0.083 seconds, speed:  746.080 t/s
0.00.750.502 I decoded   41 tokens in    0.312 seconds, speed:  131.417 t/s
0.00.750.657 I n_draft      = 3
0.00.750.745 I n_predict    = 41
0.00.750.818 I n_drafted    = 14
0.00.750.889 I t_draft_flat = 0.19 ms
0.00.750.960 I t_draft      = 0.50 ms, 35.93 us per token, 27833.00 tokens per second
0.00.751.033 I n_accept     = 9
0.00.751.107 I accept       = 64.286%
"""


def _request(job: str) -> GenerationRequest:
    return GenerationRequest(**requests(next(j for j in JOBS if j.name == job), 1)[0])


def test_each_request_is_held_to_the_schema_our_pools_enforce():
    assert output_schema(_request("extraction")) == CONTACT_SCHEMA
    call = output_schema(_request("tool_arguments"))
    assert call["properties"]["name"] == {"const": "create_event"}
    assert call["properties"]["arguments"]["properties"] == EVENT_TOOL["function"]["parameters"]["properties"]
    assert output_schema(_request("triage")) == {"type": "object"}  # response_format json_object
    assert output_schema(_request("docstrings")) is None
    optional = GenerationRequest(messages=[{"role": "user", "content": "hi"}], tools=[EVENT_TOOL], max_tokens=8)
    assert output_schema(optional) is None  # a call the model may skip: free text is allowed too


def test_a_report_is_read_into_forwards_and_time():
    run = read_report(REPORT)
    assert (run.prompt_tokens, run.decoded, run.accepted, run.seconds) == (21, 41, 9, 0.312)
    assert run.forwards == 32


def test_a_report_missing_a_figure_names_it():
    with pytest.raises(RuntimeError, match="accepted"):
        read_report(REPORT.replace("n_accept", "n_taken"))
