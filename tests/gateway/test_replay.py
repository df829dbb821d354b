"""The requests real clients send, replayed against the server: each fixture in tests/gateway/replay/ holds one
client flow (recorded from the installed client by scripts/record_client_traffic.py, or from a running Open WebUI
through a proxy by scripts/record_openwebui.py), and each of its requests is sent again as it was, headers and
body. The answer must carry every field that client reads, with the JSON type it had when recorded; a stream must
keep its recorded shape (which events, in which order); and what clients rely on must hold: usage that adds up,
answers that end within the request's limit or else the server's default cap, streams that end in [DONE] or
response.completed, streamed deltas that add up to the final text, tool calls whose arguments are JSON."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx
import pytest

from tests.gateway.replay.traffic import events_by_kind, json_type, lookup, sse_events, types_at
from tests.support.gateway_helpers import LiveServer, tiny_settings

pytestmark = pytest.mark.server

REPLAY = Path(__file__).parent / "replay"
FIXTURES = {path.stem: json.loads(path.read_text()) for path in sorted(REPLAY.glob("*.json"))}
DEFAULT_MAX_TOKENS = 16  # the server's default cap, as when recorded (scripts/record_client_traffic.py)
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# for requests that set no temperature (Open WebUI's): sampled, the random model's answer may open with its end or
# with a <tool_call> tag that is held back (one stream in 150 or so), and lose the recorded shape
GREEDY = '{"temperature": 0}'


@pytest.fixture(scope="module")
def server(tiny_tools_dir):
    """The model the recorders served (the same tiny Qwen2 with a tools template) with their default cap, and
    their context: Open WebUI's turns carry its 36 tools, about 20k tokens in the tiny tokenizer."""
    settings = tiny_settings(tiny_tools_dir, engine={"num_kv_blocks": 2048, "max_model_len": 32768},
                             default_max_tokens=DEFAULT_MAX_TOKENS, override_generation_config=GREEDY)
    with LiveServer(settings) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def test_every_fixture_names_its_client_version_and_source():
    assert {f["client"] for f in FIXTURES.values()} == {
        "openai", "openai-agents", "llm", "langchain-openai", "litellm", "open-webui"}
    for name, fixture in FIXTURES.items():
        assert fixture["flow"] == name and fixture["version"] and fixture["exchanges"] and fixture["client_parsed"]
        assert fixture["source"].startswith("recorded")
        assert all("body" in e["response"] or "events" in e["response"] for e in fixture["exchanges"])


def test_open_webui_sends_its_own_tools_and_background_tasks():
    """What the recording showed of Open WebUI 0.12.4 with a model's default capabilities: each chat turn carries
    its 36 builtin tools and no max_tokens; the title task asks for 1,000 tokens, tags and follow-ups for none."""
    chat = [e["request"]["body"] for e in FIXTURES["openwebui-chat"]["exchanges"] if e["request"]["body"]]
    assert [len(body["tools"]) for body in chat] == [36, 36]
    assert chat[0]["tools"] == chat[1]["tools"] and not any("max_tokens" in body for body in chat)
    tasks = {flow: [e["request"]["body"].get("max_tokens") for e in FIXTURES[flow]["exchanges"]]
             for flow in ("openwebui-title", "openwebui-tags", "openwebui-follow-ups")}
    assert tasks == {"openwebui-title": [1000], "openwebui-tags": [None], "openwebui-follow-ups": [None, None]}


def as_recorded(body: dict, exchange: dict, tokenizer) -> dict:
    """Where tools sit beside a JSON format with tool_choice auto, the model picks a call or text in the format (as
    OpenAI lets it); a random model's pick is no client's doing, so its first token is pushed (logit_bias, which
    cannot lift the grammar's mask) to the branch the recording took."""
    fmt = (body.get("response_format") or (body.get("text") or {}).get("format") or {}).get("type", "")
    if not body.get("tools") or body.get("tool_choice") not in (None, "auto") or not fmt.startswith("json"):
        return body
    texts = any("output_text" in read or "content" in read for read in exchange["reads"])
    [first] = tokenizer.encode("{" if texts else "<tool_call>")
    return {**body, "logit_bias": {str(first): 100}}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_replay(name, server, http):
    fixture = FIXTURES[name]
    earlier: tuple[list, int] | None = None  # the last chat turn's messages and prompt tokens
    for exchange in fixture["exchanges"]:
        sent = exchange["request"]
        body = dict(sent["body"] or {})
        if body.get("model") == fixture["model"]:
            body["model"] = server.state.model_name
        body = as_recorded(body, exchange, server.state.engine.tokenizer)
        resp = http.request(sent["method"], sent["path"], headers=sent["headers"],
                            content=json.dumps(body).encode() if sent["body"] is not None else None)
        recorded = exchange["response"]
        assert resp.status_code == recorded["status"], resp.text
        assert resp.headers["content-type"].split(";")[0] == recorded["content_type"]
        if recorded["content_type"] == "text/event-stream":
            events = sse_events(resp.content)
            assert_stream_reads(events, exchange["reads"])
            if "events" in recorded:
                assert stream_shape(events) == stream_shape(recorded["events"])
            check_stream(body, events)
            usage = next((e["data"].get("usage") for e in reversed(events) if e["data"] != "[DONE]"), None)
        else:
            answer = resp.json()
            for path, kind in exchange["reads"].items():
                found, value = lookup(answer, path)
                assert found and json_type(value) == kind, (path, value)
            check_answer(sent["path"], body, answer, server.state.model_name)
            usage = answer.get("usage")
        if "messages" in body and usage and "prompt_tokens" in usage:
            check_next_turn_hits_the_cache(earlier, body["messages"], usage)
            earlier = body["messages"], usage["prompt_tokens"]
    server.wait_idle()


def check_next_turn_hits_the_cache(earlier: tuple[list, int] | None, messages: list, usage: dict) -> None:
    """A turn that resends the previous turn's messages (a conversation, a tool's round trip) finds that turn's
    prompt in the prefix cache: all its full blocks but the last one, where the answer's first tokens may merge
    differently."""
    if earlier is not None and messages[:len(earlier[0])] == earlier[0]:
        assert usage["prompt_tokens_details"]["cached_tokens"] >= (earlier[1] - 1) // 16 * 16 - 16


def assert_stream_reads(events: list[dict], reads: dict[str, dict[str, list[str]]]) -> None:
    by_kind = events_by_kind(events)
    for kind, paths in reads.items():
        assert kind in by_kind, f"no {kind} event"
        for path, kinds in paths.items():
            assert types_at(by_kind[kind], path) == kinds, (kind, path)


def stream_shape(events: list[dict]) -> list[str]:
    """The events in order, runs of one kind as one: a Responses event by its type, a chat chunk by what it
    carries (role, content, tool_calls, finish, usage), and the closing [DONE]."""
    def shape(data) -> str:
        if data == "[DONE]" or "type" in data:
            return data if data == "[DONE]" else data["type"]
        if not data["choices"]:
            return "usage"
        choice = data["choices"][0]
        parts = [key for key in ("role", "content", "tool_calls") if choice["delta"].get(key)]
        return "+".join(parts + (["finish"] if choice["finish_reason"] else []))
    return [kind for kind, _ in itertools.groupby(shape(e["data"]) for e in events)]


def token_limit(body: dict) -> int:
    """The request's own limit, else the server's default cap: what every answer must end within."""
    return next((body[field] for field in LIMIT_FIELDS if body.get(field) is not None), DEFAULT_MAX_TOKENS)


def check_answer(path: str, body: dict, answer: dict, model: str) -> None:
    if path == "/v1/models":
        assert model in [m["id"] for m in answer["data"]]
        return
    assert len(answer["choices"]) == 1  # Open WebUI's tasks take the answer only then
    choice, usage = answer["choices"][0], answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= token_limit(body)
    calls = choice["message"].get("tool_calls") or []
    assert (choice["finish_reason"] == "tool_calls") == bool(calls)
    if body.get("tool_choice") == "required":
        assert calls
    for call in calls:
        assert call["id"] and isinstance(json.loads(call["function"]["arguments"]), dict)


def check_stream(body: dict, events: list[dict]) -> None:
    data = [e["data"] for e in events]
    if "input" in body:  # the Responses API
        check_responses_stream(body, data)
        return
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    chunks = data[:-1]
    assert len({c["id"] for c in chunks}) == 1
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    if (body.get("stream_options") or {}).get("include_usage"):
        assert chunks[-1]["choices"] == [] and 0 < chunks[-1]["usage"]["completion_tokens"] <= token_limit(body)
        if finishes == ["length"]:
            assert chunks[-1]["usage"]["completion_tokens"] == token_limit(body)
    else:
        assert all(c["choices"] for c in chunks)  # no usage chunk unless asked for
        assert len(content) <= token_limit(body)  # one chunk a token at most: the answer ended within the cap


def check_responses_stream(body: dict, data: list[dict]) -> None:
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert data[0]["type"] == "response.created" and data[-1]["type"] == "response.completed"
    final = data[-1]["response"]
    text = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    arguments = "".join(d["delta"] for d in data if d["type"] == "response.function_call_arguments.delta")
    outputs = final["output"]
    assert text == "".join(c["text"] for o in outputs if o["type"] == "message" for c in o["content"])
    assert arguments == "".join(o["arguments"] for o in outputs if o["type"] == "function_call")
    if body.get("tool_choice") == "required":
        assert [o["type"] for o in outputs] == ["function_call"] and isinstance(json.loads(arguments), dict)
    assert 0 < final["usage"]["output_tokens"] <= token_limit(body)
