"""Records what the real OpenAI clients send to prefixgate and what they read back, as the fixtures of
tests/gateway/test_replay.py (one JSON file per client flow in tests/gateway/replay/).

prefixgate serves a tiny random-weight model (bench.tiny_models, with a tools chat template) behind a small
recording proxy; each client flow runs against the proxy, which keeps every request (method, path, headers,
JSON body) and the server's answer (a JSON body, or the SSE events of a stream). Each fixture names the client
and its version, what the client parsed, and per exchange the answer fields that client reads (lists taken from
its source) which our answer carried: the replay checks that they are still there, of the same JSON type.
Open WebUI is recorded by scripts/record_openwebui.py, with this recording proxy, from a running Open WebUI.

    .venv/bin/python scripts/record_client_traffic.py [--llm PATH_TO_LLM_CLI] [--only FLOW ...]

The `llm` CLI is no dependency of the project: it runs from a venv of its own (python -m venv /tmp/llm-venv &&
/tmp/llm-venv/bin/pip install llm==0.36). A flow whose client is missing stops the script.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from aiohttp import ClientSession, web
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.tiny_models import build_tiny_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.settings import GatewaySettings, Settings  # noqa: E402
from gateway.state import STATE  # noqa: E402
from tests.gateway.replay.traffic import events_by_kind, json_type, lookup, sse_events, types_at  # noqa: E402

FIXTURES = REPO / "tests" / "gateway" / "replay"
# the server's default max_tokens while recording and replaying: the random model's text never ends, and the
# requests that set no limit (Open WebUI's tags task, its chat) must end at the cap all the same
DEFAULT_MAX_TOKENS = 16
API_KEY = "sk-replay"
HOP_BY_HOP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


# --- the recording proxy ------------------------------------------------------------------------------------

class Recorder:
    """Forwards every request to `upstream` as it came and keeps the exchange."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: list[dict] = []
        self.session: ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | {"accept-encoding"}}
        async with self.session.request(request.method, self.upstream + request.path_qs, data=body,
                                        headers=headers) as upstream:
            content_type = upstream.headers.get("Content-Type", "")
            response = web.StreamResponse(status=upstream.status, headers={"Content-Type": content_type})
            await response.prepare(request)
            raw = bytearray()
            async for chunk in upstream.content.iter_any():
                raw += chunk
                await response.write(chunk)
            await response.write_eof()
        self.exchanges.append(exchange(request, body, upstream.status, content_type, bytes(raw)))
        return response


def exchange(request: web.Request, body: bytes, status: int, content_type: str, raw: bytes) -> dict:
    sent = {"method": request.method, "path": request.path_qs,
            "headers": {k.lower(): v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP},
            "body": json.loads(body) if body else None}
    answer: dict[str, Any] = {"status": status, "content_type": content_type.split(";")[0]}
    if answer["content_type"] == "text/event-stream":
        answer["events"] = sse_events(raw)
    else:
        answer["body"] = json.loads(raw)
    return {"request": sent, "response": answer}


# --- what each client reads from an answer (from the client's own source) ------------------------------------

CHAT_USAGE = ["usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens",
              "usage.prompt_tokens_details.cached_tokens", "usage.completion_tokens_details.reasoning_tokens"]
CHAT_READS = ["id", "object", "created", "model", "system_fingerprint", "choices.0.index",
              "choices.0.finish_reason", "choices.0.message.role", "choices.0.message.content",
              "choices.0.message.tool_calls.0.id", "choices.0.message.tool_calls.0.type",
              "choices.0.message.tool_calls.0.function.name", "choices.0.message.tool_calls.0.function.arguments",
              *CHAT_USAGE]
CHUNK_READS = ["id", "object", "created", "model", "system_fingerprint", "choices.0.index",
               "choices.0.delta.role", "choices.0.delta.content", "choices.0.finish_reason",
               "choices.0.delta.tool_calls.0.index", "choices.0.delta.tool_calls.0.id",
               "choices.0.delta.tool_calls.0.function.name", "choices.0.delta.tool_calls.0.function.arguments",
               *CHAT_USAGE]
RESPONSE_USAGE = ["usage.input_tokens", "usage.output_tokens", "usage.total_tokens",
                  "usage.input_tokens_details.cached_tokens", "usage.output_tokens_details.reasoning_tokens"]
RESPONSE_READS = ["id", "object", "status", "model", "output.0.type", "output.0.id", "output.0.call_id",
                  "output.0.name", "output.0.arguments", "output.0.role", "output.0.content.0.type",
                  "output.0.content.0.text", "incomplete_details", *RESPONSE_USAGE]
# openai-agents' Runner.run_streamed: the raw events it forwards, and the final response it builds the turn from
AGENTS_EVENT_READS = {
    "response.created": ["type", "sequence_number", "response.id"],
    "response.output_item.added": ["type", "output_index", "item.type", "item.id"],
    "response.output_text.delta": ["type", "delta", "item_id", "output_index", "content_index"],
    "response.function_call_arguments.delta": ["type", "delta", "item_id", "output_index"],
    "response.output_item.done": ["type", "output_index", "item.type"],
    "response.completed": ["type", *(f"response.{path}" for path in RESPONSE_READS)],
}


def reads_of(answer: dict, paths: list[str], event_reads: dict[str, list[str]] | None = None) -> dict:
    """The paths this client reads that the recorded answer carries, each with its JSON type: of a JSON body,
    {path: type}; of a stream, per event kind (a Responses event's type, a chat chunk's object), the paths found
    in at least one such event with the types seen (finish_reason: null in content chunks, a string at the end)."""
    if "body" in answer:
        return {p: json_type(v) for p in paths for found, v in [lookup(answer["body"], p)] if found}
    by_kind = events_by_kind(answer["events"])
    wanted = event_reads or {"chat.completion.chunk": paths}
    return {kind: {p: types for p in want if (types := types_at(by_kind[kind], p))}
            for kind, want in wanted.items() if kind in by_kind}


# --- the client flows -----------------------------------------------------------------------------------------

class Report(BaseModel):  # enums: the tiny random model closes them at once under the grammar
    city: Literal["Paris", "Rome"]
    sky: Literal["sunny", "rainy"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}


def openai_client(base_url: str):
    import openai
    return openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)


def flow_openai_chat(base_url: str, model: str) -> dict:
    with openai_client(base_url) as client:
        resp = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
    return {"content": resp.choices[0].message.content, "finish_reason": resp.choices[0].finish_reason,
            "usage": resp.usage.model_dump(exclude_none=True)}


def flow_openai_chat_stream(base_url: str, model: str) -> dict:
    with openai_client(base_url) as client:
        chunks = list(client.chat.completions.create(
            model=model, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to ten."}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return {"content": text, "finish_reason": finish[-1], "usage": chunks[-1].usage.model_dump(exclude_none=True)}


def flow_openai_chat_tools(base_url: str, model: str) -> dict:
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    with openai_client(base_url) as client:
        first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL],
                                               tool_choice="required", max_tokens=64, temperature=0)
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        second = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL],
                                                max_tokens=8, temperature=0)
    return {"tool_call": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
            "finish_reasons": [first.choices[0].finish_reason, second.choices[0].finish_reason],
            "answer": second.choices[0].message.content}


def weather_agent(model_class: str, base_url: str, model: str, calls: list[str], **agent_kwargs):
    import agents
    import openai
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)
    settings = agents.ModelSettings(tool_choice="required", max_tokens=48, temperature=0)
    return agents, client, agents.Agent(
        name="weather", instructions="Answer with the weather.", tools=[get_weather],
        model=getattr(agents, model_class)(model=model, openai_client=client), model_settings=settings,
        **agent_kwargs)


def flow_agents_chat_completions(base_url: str, model: str) -> dict:
    calls: list[str] = []

    async def run():  # no output_type: chat completions refuse it beside a forced tool_choice (docs/clients.md)
        agents, client, agent = weather_agent("OpenAIChatCompletionsModel", base_url, model, calls)
        async with client:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    result = asyncio.run(run())
    return {"tool_calls": calls, "final_output": result.final_output,
            "requests": result.context_wrapper.usage.requests}


def flow_agents_responses_streamed(base_url: str, model: str) -> dict:
    calls: list[str] = []

    async def run():
        # the answer after the tool is a Report: the grammar ends it, where free text would be cut at max_tokens
        # and the SDK takes an incomplete response for a ModelBehaviorError
        agents, client, agent = weather_agent("OpenAIResponsesModel", base_url, model, calls, output_type=Report)
        async with client:
            result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
            kinds = [event.type async for event in result.stream_events()]
            return result, kinds
    result, kinds = asyncio.run(run())
    return {"tool_calls": calls, "final_output": result.final_output.model_dump(),
            "stream_event_kinds": sorted(set(kinds)), "requests": len(result.raw_responses)}


def flow_llm_cli_conversation(base_url: str, model: str, llm_cli: str) -> dict:
    with tempfile.TemporaryDirectory() as home:
        (Path(home) / "extra-openai-models.yaml").write_text(
            f"- model_id: prefixgate\n  model_name: {model}\n  api_base: {base_url}\n")
        env = {**os.environ, "LLM_USER_PATH": home}

        def llm(*args: str) -> str:
            return subprocess.run([llm_cli, *args], env=env, check=True, capture_output=True, text=True,
                                  timeout=120).stdout
        llm("-m", "prefixgate", "-o", "max_tokens", "8", "-o", "temperature", "0", "What is the capital of France?")
        llm("-c", "-o", "max_tokens", "8", "-o", "temperature", "0", "And of Italy?")
        logs = json.loads(llm("logs", "--json", "-n", "2"))
    return {"turns": [{"response": row["response"], "input_tokens": row["input_tokens"],
                       "output_tokens": row["output_tokens"], "token_details": row["token_details"]}
                      for row in logs],
            "one_conversation": len({row["conversation_id"] for row in logs}) == 1}


def flow_langchain_chat(base_url: str, model: str) -> dict:
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=model, base_url=base_url, api_key=API_KEY, max_tokens=8, temperature=0, max_retries=0,
                     timeout=60, stream_usage=True)
    message = llm.invoke("What is the capital of France?")
    chunks = list(llm.stream("Count to ten."))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    return {"invoke": {"text": message.text, "usage_metadata": message.usage_metadata,
                       "finish_reason": message.response_metadata["finish_reason"]},
            "stream": {"text": streamed.text, "usage_metadata": streamed.usage_metadata}}


def flow_langchain_tools(base_url: str, model: str) -> dict:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model=model, base_url=base_url, api_key=API_KEY, max_tokens=64, temperature=0, max_retries=0,
                     timeout=60)
    message = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?")
    return {"tool_calls": [{"name": c["name"], "args": c["args"]} for c in message.tool_calls]}


def flow_litellm_chat(base_url: str, model: str) -> dict:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # before the import: no download of the cost map
    import litellm
    ask = {"model": f"openai/{model}", "api_base": base_url, "api_key": API_KEY, "max_tokens": 8,
           "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    resp = litellm.completion(**ask)
    chunks = list(litellm.completion(**ask, stream=True, stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    return {"completion": {"content": resp.choices[0].message.content, "finish_reason": resp.choices[0].finish_reason,
                           "usage": {k: getattr(resp.usage, k) for k in ("prompt_tokens", "completion_tokens",
                                                                        "total_tokens")},
                           "cached_tokens": resp.usage.prompt_tokens_details.cached_tokens},
            "stream": {"content": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                       "usage": {k: getattr(usage[-1], k) for k in ("prompt_tokens", "completion_tokens",
                                                                    "total_tokens")}}}


# name -> (client distribution, API, the flow, reads: chat / Responses JSON paths, stream event reads)
FLOWS: dict[str, tuple[str, str, Callable, list[str], dict | None]] = {
    "openai-chat": ("openai", "chat completions", flow_openai_chat, CHAT_READS, None),
    "openai-chat-stream": ("openai", "chat completions", flow_openai_chat_stream, CHUNK_READS, None),
    "openai-chat-tools": ("openai", "chat completions", flow_openai_chat_tools, CHAT_READS, None),
    "openai-agents-chat-completions": ("openai-agents", "chat completions", flow_agents_chat_completions,
                                       CHAT_READS, None),
    "openai-agents-responses-streamed": ("openai-agents", "Responses", flow_agents_responses_streamed,
                                         RESPONSE_READS, AGENTS_EVENT_READS),
    "llm-cli-conversation": ("llm", "chat completions", flow_llm_cli_conversation, CHUNK_READS, None),
    "langchain-chat": ("langchain-openai", "chat completions", flow_langchain_chat, CHAT_READS + CHUNK_READS, None),
    "langchain-tools": ("langchain-openai", "chat completions", flow_langchain_tools, CHAT_READS, None),
    "litellm-chat": ("litellm", "chat completions", flow_litellm_chat, CHAT_READS + CHUNK_READS, None),
}


def client_version(dist: str, llm_cli: str) -> str:
    if dist == "llm":  # from its own venv
        return subprocess.run([llm_cli, "--version"], check=True, capture_output=True, text=True).stdout.split()[-1]
    return metadata.version(dist)


# --- running it -------------------------------------------------------------------------------------------------

async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def record(model_dir: Path, names: list[str], llm_cli: str) -> None:
    settings = Settings(EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=256),
                        GatewaySettings(salt_secret="replay", engine_process=False, responses_db=":memory:",
                                        default_max_tokens=DEFAULT_MAX_TOKENS))
    gateway = create_app(settings)
    gateway_runner, gateway_url = await serve(gateway)
    recorder = Recorder(gateway_url)
    proxy = web.Application()
    proxy.router.add_route("*", "/{tail:.*}", recorder.handle)
    proxy_runner, proxy_url = await serve(proxy)
    model = gateway[STATE].model_name
    try:
        async with ClientSession(auto_decompress=False) as recorder.session:
            for name in names:
                dist, api, flow, paths, event_reads = FLOWS[name]
                recorder.exchanges = []
                args = (proxy_url + "/v1", model) + ((llm_cli,) if dist == "llm" else ())
                parsed = await asyncio.to_thread(flow, *args)
                write_fixture(name, {
                    "flow": name, "client": dist, "version": client_version(dist, llm_cli), "api": api,
                    "source": f"recorded by scripts/record_client_traffic.py against prefixgate on a tiny "
                              f"random-weight model (default max_tokens {DEFAULT_MAX_TOKENS})",
                    "model": model, "client_parsed": parsed,
                    "exchanges": [{**ex, "reads": reads_of(ex["response"], paths, event_reads)}
                                  for ex in recorder.exchanges]})
    finally:
        await proxy_runner.cleanup()
        await gateway_runner.cleanup()


def write_fixture(name: str, fixture: dict) -> None:
    path = FIXTURES / f"{name}.json"
    path.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"{path.relative_to(REPO)}: {len(fixture['exchanges'])} exchanges, {fixture['client']} "
          f"{fixture['version']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm", default="llm", help="the llm CLI (from a venv of its own)")
    parser.add_argument("--only", nargs="+", choices=sorted(FLOWS), help="record these flows only")
    args = parser.parse_args()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny-tools", "qwen2", tools=True)
        asyncio.run(record(model_dir, args.only or list(FLOWS), args.llm))


if __name__ == "__main__":
    main()
