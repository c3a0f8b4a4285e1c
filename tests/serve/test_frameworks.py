"""Agent frameworks as their users run them, against `capsulert serve` (CPU, the default model, whose text is
noise: what is checked is what the server guarantees: complete tool calls under a forced choice, schema-valid
structured output, whole and streamed replies that agree, and the frameworks' loops reaching their end).
openai-agents (on the Responses and the chat completions models), LangChain's ChatOpenAI (chat completions
and use_responses_api) and pydantic-ai. The frameworks send no max_tokens: the server's --max-tokens bounds
every reply. Tool parameters and output fields are bounded, as the model's free strings never end; forced
tool turns make one call (parallel_tool_calls off), else the noise model calls on until max_tokens.
Agent prompts (tool schemas, instructions) are longer than the other modules' max_seq: this server (shared
with test_responses_api.py) has more."""
from __future__ import annotations

from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import KEYS, MODEL


class City(BaseModel):
    """Structured output: every field bounded (a random-weights model's free string never ends)."""
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10_000_000)
    coastal: bool


@pytest.fixture(scope="module")
def server(agent_server):  # --max-tokens bounds the frameworks' replies; their prompts need a longer max_seq
    return agent_server


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS["acme"], max_retries=0, timeout=120)


CALLS: list[str] = []


def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
    """The weather of a city."""
    CALLS.append(city)
    return f"Rain in {city[:12]}"


# ------------------------------------------------------------------------------------------ openai-agents
@pytest.fixture(scope="module")
def agents_sdk():
    import agents

    agents.set_tracing_disabled(True)  # no traces sent anywhere
    return agents


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_openai_agents_forced_tool_loop(agents_sdk, aclient, api):
    """A forced call, its result back, then the answer: on the Responses model a City (an incomplete response,
    cut by max_tokens, is an error to the SDK: the answer must end, and a structured one does), on the chat
    completions one text (a reply cut by max_tokens is taken as it is)."""
    responses = api == "responses"
    model = (agents_sdk.OpenAIResponsesModel if responses else agents_sdk.OpenAIChatCompletionsModel)(MODEL, aclient)
    agent = agents_sdk.Agent(name="weather", instructions="Use the tool.", model=model,
                             tools=[agents_sdk.function_tool(get_weather)], output_type=City if responses else str,
                             model_settings=agents_sdk.ModelSettings(tool_choice="required", temperature=0,
                                                                     parallel_tool_calls=False))
    CALLS.clear()
    result = await agents_sdk.Runner.run(agent, "Weather in Oslo?", max_turns=3)
    assert len(CALLS) == 1 and isinstance(result.final_output, City if responses else str)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]


async def test_openai_agents_streamed_on_responses(agents_sdk, aclient):
    agent = agents_sdk.Agent(name="facts", instructions="Describe the city.", output_type=City,
                             model=agents_sdk.OpenAIResponsesModel(MODEL, aclient),
                             model_settings=agents_sdk.ModelSettings(temperature=0))
    run = agents_sdk.Runner.run_streamed(agent, "Oslo")
    deltas = [e.data.delta async for e in run.stream_events()
              if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
    whole = await agents_sdk.Runner.run(agent, "Oslo")
    assert City.model_validate_json("".join(deltas)) == run.final_output == whole.final_output


async def test_openai_agents_structured_output(agents_sdk, aclient):
    agent = agents_sdk.Agent(name="facts", instructions="Describe the city.", output_type=City,
                             model=agents_sdk.OpenAIChatCompletionsModel(MODEL, aclient),
                             model_settings=agents_sdk.ModelSettings(temperature=0))
    result = await agents_sdk.Runner.run(agent, "Oslo")
    assert isinstance(result.final_output, City)


# ------------------------------------------------------------------------------------------ LangChain
@pytest.fixture
def chat_openai(server):
    from langchain_openai import ChatOpenAI

    def make(**kw):
        return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key=KEYS["acme"], temperature=0,
                          max_retries=0, timeout=120, **kw)
    return make


@pytest.mark.parametrize("responses", [False, True])
def test_langchain_chat_stream_and_tool_loop(chat_openai, responses):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    llm = chat_openai(use_responses_api=responses)
    whole = llm.invoke("Hello")
    streamed = "".join(chunk.text for chunk in llm.stream("Hello"))
    assert whole.text and streamed == whole.text

    weather = tool(get_weather)  # its schema as bind_tools sends it: no additionalProperties
    messages = [HumanMessage("Weather in Oslo?")]
    reply = llm.bind_tools([weather], tool_choice="get_weather").invoke(messages)
    call, = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert not (reply.text or "").strip()  # no call markup left in the content
    messages += [reply, ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([weather]).invoke(messages)
    assert answer.text is not None and answer.response_metadata


def test_langchain_structured_output(chat_openai):
    city = chat_openai().with_structured_output(City, method="json_schema").invoke("Describe Oslo")
    assert isinstance(city, City)
    city = chat_openai().with_structured_output(City, method="function_calling").invoke("Describe Oslo")
    assert isinstance(city, City)


# ------------------------------------------------------------------------------------------ pydantic-ai
@pytest.fixture
def pydantic_model(aclient):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=aclient))


async def test_pydantic_ai_chat_stream_and_structured_output(pydantic_model):
    from pydantic_ai import Agent

    agent = Agent(pydantic_model, instructions="Be brief.", model_settings={"temperature": 0})
    whole = await agent.run("Hello")
    async with agent.run_stream("Hello") as run:
        streamed = [text async for text in run.stream_text(delta=True)]
    assert whole.output and "".join(streamed) == whole.output

    facts = Agent(pydantic_model, output_type=City, model_settings={"temperature": 0})
    result = await facts.run("Describe Oslo")
    assert isinstance(result.output, City)


async def test_pydantic_ai_tool_loop(pydantic_model):
    """The tool forced on the first step, its result back, then the output tool forced (named choices)."""
    from pydantic_ai import Agent

    def settings(ctx) -> dict:
        return {"temperature": 0, "parallel_tool_calls": False,
                "tool_choice": ["get_weather"] if ctx.run_step <= 1 else ["final_result"]}

    agent = Agent(pydantic_model, output_type=City, tools=[get_weather], model_settings=settings)
    CALLS.clear()
    result = await agent.run("Weather in Oslo, then describe it")
    assert isinstance(result.output, City) and len(CALLS) == 1
    calls = [part.tool_name for m in result.all_messages() for part in m.parts if part.part_kind == "tool-call"]
    returns = [part.content for m in result.all_messages() for part in m.parts if part.part_kind == "tool-return"]
    assert calls == ["get_weather", "final_result"] and returns[0] == get_weather(CALLS[0])
