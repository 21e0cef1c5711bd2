"""Agent frameworks reach the router by their base URL alone: the OpenAI Agents SDK, LangChain and litellm.

The tiny models write nonsense, so every flow that needs a particular shape gets it from a constraint, as a
real agent would: a required tool choice makes the first turn a grammar-constrained call to the one tool, and a
JSON schema makes structured output parse. The rest (the framework's requests, its parsing of our answers, the
tool loop) is the frameworks' own code against a real server.
"""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from router import Router
from tests.test_gateway_support import (  # noqa: F401
    WEATHER,
    base_url,
    decision_log,
    gateway,
    gateway_router,
    router_models,
    serve,
)
from tests.test_router_support import MESSAGES


class Person(BaseModel):
    name: Annotated[str, Field(max_length=10)]
    age: Annotated[int, Field(ge=0, le=120)]


def forecaster(base_url: str, get_weather, instructions: str, tool_choice: str | None, max_tokens: int):
    """An Agents SDK agent with one weather tool, greedy, through the gateway at ``base_url``."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    return Agent(
        name="forecaster",
        instructions=instructions,
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="dspark-router/auto", openai_client=client),
        model_settings=ModelSettings(tool_choice=tool_choice, temperature=0, max_tokens=max_tokens),
    )


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_openai_agent_calls_its_tool_and_answers(base_url, decision_log, streamed):
    from agents import Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=6)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    # A call is required on the first turn only: the SDK resets tool_choice once a tool has run, so the second
    # turn may answer in text, which ends the run.
    agent = forecaster(base_url, get_weather, "Look the weather up, then answer.", "required", max_tokens=48)
    if streamed:
        run = Runner.run_streamed(agent, "Weather in Porto?", max_turns=3)
        async for _ in run.stream_events():
            pass
    else:
        run = await Runner.run(agent, "Weather in Porto?", max_turns=3)
    assert [type(item) for item in run.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert len(cities) == 1 and len(cities[0]) <= 6
    assert isinstance(run.final_output, str) and run.final_output
    records = [json.loads(line) for line in decision_log.read_text().splitlines()]
    replies = [m for r in records for m in r["request"]["messages"] if m["role"] == "tool"]
    assert {"role": "tool", "content": f"sunny in {cities[0]}"}.items() <= replies[-1].items()


@pytest.fixture(scope="module")
def default_url() -> Iterator[str]:
    """The embedded default (SmolLM2-135M-Instruct and its drafters) behind a real gateway."""
    with Router.from_config() as router:
        router.warmup()
        with serve(router) as server:
            yield f"{server.url}/v1"


@pytest.mark.parametrize("tool_choice", [None, "required"])
async def test_an_openai_agent_runs_to_its_answer_on_the_default_model(default_url, tool_choice):
    """The run of the issue that looped to MaxTurnsExceeded: calls came back with the id of an earlier call, which
    the SDK takes for one already run, and a second turn holding the call crashed the model's chat template."""
    from agents import Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 C in {city}."

    instructions = "Use the tool to look the weather up, then answer in one sentence."
    agent = forecaster(default_url, get_weather, instructions, tool_choice, max_tokens=64)
    run = await Runner.run(agent, "What is the weather in Porto?", max_turns=4)
    assert isinstance(run.final_output, str) and run.final_output
    kinds = [type(item) for item in run.new_items]
    assert kinds[-1] is MessageOutputItem
    assert kinds.count(ToolCallItem) == kinds.count(ToolCallOutputItem) == len(cities)
    if tool_choice == "required":
        assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem] and cities == ["Porto"]


def test_langchain_binds_tools_and_structures_output(base_url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="dspark-router/auto", base_url=base_url, api_key="unused", temperature=0, max_tokens=96, max_retries=0
    )
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Porto?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"} and call["id"].startswith("call_")
    assert message.response_metadata["finish_reason"] == "tool_calls"
    person = llm.with_structured_output(Person).invoke("Who is it? Elena, 31.")
    assert isinstance(person, Person)


def test_litellm_through_the_gateway(base_url, gateway_router):
    import litellm

    expected = gateway_router.complete(messages=MESSAGES, max_tokens=6, temperature=0)
    args = {"model": "openai/dspark-router/auto", "api_base": base_url, "api_key": "unused", "messages": MESSAGES}
    response = litellm.completion(**args, max_tokens=6, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.usage.completion_tokens == 6
    chunks = list(litellm.completion(**args, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
