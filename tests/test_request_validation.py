"""Bad input raises InvalidRequestError naming the field; good input is accepted as OpenAI sends it."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from backends import GenerationRequest, InvalidRequestError, ModelLoadError
from backends.autoregressive import AutoregressiveBackend
from backends.loading import prompt_ids


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "messages"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "top_k": -1}, "top_k"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "stop": ["a", ""]}, "stop"),
        ({"prompt": "x", "stop": ""}, "stop"),
        ({"messages": [{"role": "wizard", "content": "y"}]}, "messages.0.role"),
        ({"prompt": "x", "nonsense": 1}, "nonsense"),
    ],
)
def test_bad_fields_raise_typed_error_naming_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as err:
        GenerationRequest(**fields)
    assert err.value.param == param
    assert err.value.to_openai()["error"]["param"] == param
    assert err.value.to_openai()["error"]["type"] == "invalid_request_error"


def test_openai_shaped_request_is_accepted():
    request = GenerationRequest(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=16,
        temperature=0.7,
        top_p=0.9,
        seed=1,
        stop="\n\n",
    )
    assert request.stop == ["\n\n"]
    assert not request.greedy


def test_missing_model_path_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        AutoregressiveBackend.from_pretrained(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match="holds no model"):
        AutoregressiveBackend.from_pretrained(tmp_path)


def test_prompt_longer_than_context_is_refused(tiny_model_paths):
    backend = AutoregressiveBackend.from_pretrained(tiny_model_paths["gpt2"])
    with pytest.raises(InvalidRequestError) as err:
        backend.complete(GenerationRequest(prompt="x", max_tokens=10_000, temperature=0.0))
    assert err.value.param == "max_tokens"
    assert backend.complete(GenerationRequest(prompt="x", max_tokens=2, temperature=0.0)).usage.completion_tokens == 2


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Porto"}'}}
TOOL_TURN = [
    {"role": "user", "content": "Weather in Porto?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_an_earlier_tool_call_reaches_the_model_as_the_json_it_wrote(tiny_model_paths):
    """Chat templates of small models read only role and content: an assistant turn that is all tool call would
    be undefined content to them (a template crash before this was fixed)."""
    backend = AutoregressiveBackend.from_pretrained(tiny_model_paths["llama"])
    request = GenerationRequest(messages=TOOL_TURN, max_tokens=2, temperature=0.0)
    prompt = backend.loaded.tokenizer.decode(prompt_ids(backend.loaded, request))
    assert '{"name": "get_weather", "arguments": {"city": "Porto"}}' in prompt and "sunny" in prompt
    assert backend.complete(request).usage.completion_tokens == 2


def test_a_template_that_refuses_the_messages_is_a_request_error(tiny_model_paths):
    backend = AutoregressiveBackend.from_pretrained(tiny_model_paths["llama"])
    loaded = dataclasses.replace(backend.loaded, tokenizer=copy.copy(backend.loaded.tokenizer))
    loaded.tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(InvalidRequestError, match="roles must alternate") as err:
        prompt_ids(loaded, GenerationRequest(messages=TOOL_TURN, temperature=0.0))
    assert err.value.param == "messages"
