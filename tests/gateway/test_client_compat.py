"""The client frameworks people point at an OpenAI-compatible server, driven against a live one: the openai
SDK (Responses API and embeddings), openai-agents, langchain-openai and pydantic-ai on the Responses API,
instructor and litellm on chat completions. Each case checks what the client parsed. The frameworks come
from the compat extra (pinned in pyproject.toml); instructor from its own venv (tests/compat/instructor.txt),
because its jiter pin cannot share the main venv's openai. The tiny model has random weights: its free
text never ends, so whatever must complete is grammar-forced (enums, json_schema, forced tool calls)."""
from __future__ import annotations

import base64
import importlib
import json
import math
import struct
import subprocess
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.support.gateway_helpers import REPO, LiveServer, sdk_client, tiny_settings
from tests.support.machine import IN_CI

# coverage paused in the calls: their CPU is the frameworks' (importing them, building and parsing their
# requests), half again as much under the line tracer, and the gateway lines they reach, other tests reach too
# (no line of engine/ or gateway/ is theirs alone, checked with --cov-context=test over the whole suite)
pytestmark = [pytest.mark.compat, pytest.mark.no_cover]

INSTRUCTOR_PYTHON = REPO / ".venv" / "compat-instructor" / "bin" / "python"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


class City(BaseModel):  # enums: the tiny random model closes them at once (a free string it never ends)
    name: Literal["Paris", "Rome"]
    country: Literal["France", "Italy"]


class Report(BaseModel):
    city: Literal["Paris", "Rome"]
    sky: Literal["sunny", "rainy"]


def framework(module: str):
    """The framework's module: fails under CI when it is missing (make test installs the compat extra),
    skips the test elsewhere."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if IN_CI:
            raise
        pytest.skip(f"{module} is not installed (make test installs the compat extra)")


@pytest.fixture(scope="module")
def server(tiny_tools_dir):
    with LiveServer(tiny_settings(tiny_tools_dir)) as live:
        yield live


@pytest.fixture(autouse=True)
def idle(server):
    yield
    server.wait_idle()  # every request finished and its KV blocks back, whatever the client did


@pytest.fixture
def sdk(server):
    with sdk_client(server) as client:  # closed: a socket left to the garbage collector is a ResourceWarning
        yield client


@pytest.fixture(scope="module")
def text_first(server) -> dict:
    """extra_body that starts an answer with "{": where tools sit beside a JSON format the model may call a tool
    or answer in the format (as OpenAI lets it), and a random model could call on and on; this one answers."""
    [brace] = server.state.engine.tokenizer.encode("{")
    return {"logit_bias": {str(brace): 100}}


@pytest.fixture
def base_url(server) -> str:
    return server.url + "/v1"


@pytest.fixture
def model(server) -> str:
    return server.state.model_name


# --- the openai SDK ---------------------------------------------------------------------------------------

def test_openai_responses_create(sdk, model):
    resp = sdk.responses.create(model=model, input="hello world", max_output_tokens=6, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in resp.output] == ["message"] and resp.output[0].content[0].type == "output_text"
    assert resp.output_text == resp.output[0].content[0].text != ""
    assert resp.usage.output_tokens == 6 and resp.usage.input_tokens_details.cached_tokens >= 0


def test_openai_responses_streamed(sdk, model):
    events = list(sdk.responses.create(model=model, input="count to ten", max_output_tokens=8, temperature=0,
                                       stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.incomplete"  # cut by max_output_tokens, as OpenAI ends such a stream
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text != "" and events[-1].response.usage.output_tokens == 8


def test_openai_responses_stream_helper_parses(sdk, model):
    """The SDK's stream helper (it wants response.completed): a streamed json_schema answer, parsed."""
    with sdk.responses.stream(model=model, input="A city, as JSON", text_format=City, max_output_tokens=200,
                              temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, City)
    assert City.model_validate_json(deltas) == final.output_parsed


def test_openai_responses_previous_response_id(sdk, model):
    instructions = "You answer questions about the capitals of Europe. " * 4
    first = sdk.responses.create(model=model, instructions=instructions, input="The capital of France?",
                                 max_output_tokens=8, temperature=0)
    second = sdk.responses.create(model=model, instructions=instructions, input="And of Italy?",
                                  previous_response_id=first.id, max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id and second.output_text
    turn_one = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > turn_one  # the server brought the first turn
    assert second.usage.input_tokens_details.cached_tokens >= (turn_one - 1) // 16 * 16 - 16  # from the cache
    assert [i.content[0].text for i in sdk.responses.input_items.list(second.id).data][-1] == "And of Italy?"


def test_openai_responses_function_tool_round_trip(sdk, model, text_first):
    call_resp = sdk.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     max_output_tokens=200, temperature=0)
    assert call_resp.status == "completed" and [o.type for o in call_resp.output] == ["function_call"]
    call = call_resp.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id
    final = sdk.responses.parse(model=model, previous_response_id=call_resp.id, tools=[WEATHER],
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": '{"sky": "sunny"}'}],
                                text_format=Report, max_output_tokens=200, temperature=0, extra_body=text_first)
    assert final.status == "completed" and [o.type for o in final.output] == ["message"]
    assert isinstance(final.output_parsed, Report) and final.usage.input_tokens_details.cached_tokens > 0


def test_openai_responses_text_format_json_schema(sdk, model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "sky": {"type": "string", "enum": ["sunny", "rainy"]}},
              "required": ["city", "sky"], "additionalProperties": False}
    resp = sdk.responses.create(
        model=model, input="The weather, as JSON", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "report", "schema": schema, "strict": True}})
    assert resp.status == "completed" and resp.text.format.type == "json_schema"
    answer = json.loads(resp.output_text)
    assert set(answer) == {"city", "sky"} and answer["city"] in ("Paris", "Rome")


def test_openai_responses_parse(sdk, model):
    resp = sdk.responses.parse(model=model, input="A city", text_format=City, max_output_tokens=200,
                               temperature=0)
    assert isinstance(resp.output_parsed, City)
    assert resp.output_parsed == City.model_validate_json(resp.output_text)


def test_openai_embeddings_float_and_base64(sdk, model):
    texts = ["the capital of France", "a block of the prefix cache"]
    floats = sdk.embeddings.create(model=model, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and floats.model == model
    for item in floats.data:
        assert all(isinstance(v, float) for v in item.embedding)
        assert math.isclose(math.fsum(v * v for v in item.embedding), 1.0, rel_tol=1e-4)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    raw = sdk.embeddings.create(model=model, input=texts, encoding_format="base64")  # handed over as sent
    for as_float, as_base64 in zip(floats.data, raw.data):
        packed = base64.b64decode(as_base64.embedding)
        unpacked = struct.unpack(f"<{len(packed) // 4}f", packed)
        assert unpacked == pytest.approx(as_float.embedding, rel=1e-5, abs=1e-6)
    decoded = sdk.embeddings.create(model=model, input=texts)  # the SDK's default: asks base64, decodes it
    assert decoded.data[1].embedding == pytest.approx(floats.data[1].embedding, rel=1e-5, abs=1e-6)


# --- openai-agents (the Responses API by default) -----------------------------------------------------------

def weather_agent(base_url: str, model: str, calls: list[str], extra_body: dict | None = None, **agent_kwargs):
    """An Agent with one function tool on the SDK's Responses model, its client pointed at the server
    (`extra_body`: sent on every turn, the text_first fixture's where an output type follows the tool)."""
    agents = framework("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=30)
    # tool_choice "required" forces the first call; the SDK resets it once the tool has run
    settings = agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0, extra_body=extra_body)
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model=model, openai_client=client),
                         model_settings=settings, **agent_kwargs)
    return agents, agent, client


async def test_agents_runner_runs_the_tool(base_url, model):
    calls: list[str] = []
    agents, agent, client = weather_agent(base_url, model, calls, tool_use_behavior="stop_on_first_tool")
    async with client:
        result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2)
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0]}"
    call = result.raw_responses[0].output[0]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": calls[0]}


async def test_agents_runner_tool_then_structured_output(base_url, model, text_first):
    """The whole loop: the forced call, the tool's output sent back, the final answer as the output_type (the tool
    still offered beside it: text_first makes the random model answer rather than call again)."""
    calls: list[str] = []
    agents, agent, client = weather_agent(base_url, model, calls, text_first, output_type=Report)
    async with client:
        result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    assert len(calls) == 1 and len(result.raw_responses) == 2
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs == [f"sunny in {calls[0]}"]  # sent back as a function_call_output
    assert [o.type for o in result.raw_responses[1].output] == ["message"]
    assert isinstance(result.final_output, Report)


# --- langchain-openai with use_responses_api=True ------------------------------------------------------------

def chat_openai(base_url: str, model: str, max_tokens: int):
    langchain_openai = framework("langchain_openai")
    return langchain_openai.ChatOpenAI(model=model, base_url=base_url, api_key="none", use_responses_api=True,
                                       max_tokens=max_tokens, temperature=0, max_retries=0, timeout=30)


def test_langchain_invoke(base_url, model):
    message = chat_openai(base_url, model, 6).invoke("hello")
    assert message.text and message.id.startswith("resp_")
    assert message.usage_metadata["output_tokens"] == 6
    assert message.response_metadata["status"] == "incomplete"
    assert message.response_metadata["incomplete_details"] == {"reason": "max_output_tokens"}


def test_langchain_stream(sdk, base_url, model):
    chunks = list(chat_openai(base_url, model, 8).stream("count to ten"))
    assert len(chunks) > 2
    message = chunks[0]
    for chunk in chunks[1:]:
        message += chunk
    assert message.usage_metadata["output_tokens"] == 8
    stored = sdk.responses.retrieve(message.response_metadata["id"])
    assert message.text == stored.output_text != ""


@pytest.mark.parametrize("tool_choice", ["get_weather", "any"])
def test_langchain_bind_tools(base_url, model, tool_choice):
    tools = framework("langchain_core.tools")

    @tools.tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return "sunny"

    llm = chat_openai(base_url, model, 200).bind_tools([get_weather], tool_choice=tool_choice)
    message = llm.invoke("What is the weather in Paris?")
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome") and call["id"]
    assert get_weather.invoke(call["args"]) == "sunny"


# --- pydantic-ai's OpenAIResponsesModel -------------------------------------------------------------------

def pydantic_ai_agent(client: openai.AsyncOpenAI, model: str, max_tokens: int, **agent_kwargs):
    pydantic_ai = framework("pydantic_ai")
    openai_models = framework("pydantic_ai.models.openai")
    providers = framework("pydantic_ai.providers.openai")
    responses_model = openai_models.OpenAIResponsesModel(model, provider=providers.OpenAIProvider(openai_client=client))
    return pydantic_ai.Agent(responses_model, model_settings={"max_tokens": max_tokens, "temperature": 0},
                             **agent_kwargs)


async def test_pydantic_ai_plain_run(base_url, model):
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=30) as client:
        result = await pydantic_ai_agent(client, model, 6).run("hello")
    assert isinstance(result.output, str) and result.output
    assert result.usage.output_tokens == 6 and result.usage.requests == 1
    response = result.all_messages()[-1]
    assert response.finish_reason == "length" and response.provider_response_id.startswith("resp_")


@pytest.mark.parametrize("native", [False, True], ids=["tool-output", "native-output"])
async def test_pydantic_ai_structured_output(base_url, model, native):
    """output_type a Pydantic model: through pydantic-ai's output tool (its default), or text.format."""
    output_type = framework("pydantic_ai").NativeOutput(City) if native else City
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=30) as client:
        result = await pydantic_ai_agent(client, model, 200, output_type=output_type).run("A city in Europe")
    assert isinstance(result.output, City) and result.usage.requests == 1


# --- instructor on chat completions (its own venv) ----------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(base_url, model, mode):
    if not INSTRUCTOR_PYTHON.exists():
        message = f"{INSTRUCTOR_PYTHON} is missing (make test makes it from tests/compat/instructor.txt)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    script = REPO / "tests" / "compat" / "instructor_cases.py"
    done = subprocess.run([str(INSTRUCTOR_PYTHON), "-W", "error", str(script), base_url, model, mode],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["type"] == "City" and City.model_validate(out["parsed"])
    if mode == "TOOLS":
        # (instructor names its function in tool_choice: "stop", as OpenAI answers a named call)
        assert out["finish_reason"] == "stop" and [c["name"] for c in out["tool_calls"]] == ["City"]
        assert json.loads(out["tool_calls"][0]["arguments"]) == out["parsed"]
    else:
        assert out["finish_reason"] == "stop" and json.loads(out["content"]) == out["parsed"]


# --- litellm on chat completions ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def litellm():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the model-cost map at import
        # (litellm's telemetry is opt-in: LITELLM_TELEMETRY_GROUPS, unset here)
        module = framework("litellm")
    module.suppress_debug_info = True  # no "Give Feedback" banner per error
    yield module
    # litellm keeps each OpenAI client it builds in a process-wide cache, its connections open until exit
    cache = module.in_memory_llm_clients_cache
    for client in list(cache.cache_dict.values()):
        if isinstance(client, openai.OpenAI):
            client.close()
    cache.flush_cache()


def test_litellm_completion(litellm, base_url, model):
    resp = litellm.completion(model=f"openai/{model}", api_base=base_url, api_key="none", max_tokens=5,
                              temperature=0, messages=[{"role": "user", "content": "hello"}])
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str) and choice.message.content
    assert choice.message.role == "assistant" and choice.message.tool_calls is None
    assert resp.usage.completion_tokens == 5 and resp.usage.total_tokens == resp.usage.prompt_tokens + 5
    assert resp.id.startswith("chatcmpl-")


def test_litellm_maps_errors(litellm, base_url, model):
    ask = {"api_base": base_url, "api_key": "none", "max_tokens": 5, "num_retries": 0,
           "messages": [{"role": "user", "content": "hello"}]}
    with pytest.raises(litellm.BadRequestError, match=r"temperature must be in \[0\.0, 2\.0\]") as bad:
        litellm.completion(model=f"openai/{model}", temperature=7, **ask)
    assert bad.value.status_code == 400
    with pytest.raises(litellm.NotFoundError, match="does not exist") as missing:
        litellm.completion(model="openai/no-such-model", **ask)
    assert missing.value.status_code == 404
