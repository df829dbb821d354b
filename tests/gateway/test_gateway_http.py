"""The gateway app through pytest-aiohttp's client, one app (and tiny engine) per test:
error objects, auth, admission, engine failures, disconnects, metrics, request ids."""
from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from bench.engine_faults import assert_blocks_released, set_step_hook
from engine.config import EngineConfig
from gateway.app import IN_FLIGHT, create_app
from gateway.settings import ApiKey, GatewaySettings, Settings
from gateway.state import STATE

BLOCK = 16
SYSTEM = ("You are a helpful assistant. Answer the question about the capital of France and the "
          "prefix cache with great care, one block at a time, and say hello to the world. ") * 3


@pytest.fixture
def make_client(aiohttp_client, tiny_llama_dir):
    async def make(keys: tuple[ApiKey, ...] = (), engine: dict | None = None, **gateway):
        # 320 blocks hold the tiny model's whole 4,096-token context
        config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK, num_kv_blocks=320, **(engine or {}))
        gateway = {"engine_process": False, **gateway}  # faults are injected into the engine (in process)
        settings = Settings(config, GatewaySettings(api_keys=keys, salt_secret="test", **gateway))
        return await aiohttp_client(create_app(settings))
    return make


@pytest.fixture
async def client(make_client):
    return await make_client()


def engine_of(client):
    return client.app[STATE].engine


def model_of(client) -> str:
    return client.app[STATE].model_name


def chat(client, content: str = "hello world", **fields) -> dict:
    return {"model": model_of(client), "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, **fields}


def assert_error(resp_status: int, body: dict, status: int, *, param=None, code=None, type_=None):
    assert resp_status == status
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in body["error"]["message"]
    assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    if type_ is not None:
        assert body["error"]["type"] == type_


async def sse_events(resp, limit: int | None = None) -> list:
    """Parsed `data:` events ("[DONE]" kept as a string), up to `limit`."""
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
        if limit is not None and len(events) >= limit:
            break
    return events


async def wait_released(engine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert engine.num_unfinished() == 0
            assert_blocks_released(engine)
            assert engine.scheduler_stats().num_running == 0  # the stats (and /metrics) saw it too
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


def prompt_ids(engine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


# ---- the happy path over plain HTTP

async def test_chat_completion_shape_and_request_ids(client):
    resp = await client.post("/v1/chat/completions", json=chat(client))
    body = await resp.json()
    assert resp.status == 200
    assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["X-Request-Id"])
    assert body["object"] == "chat.completion" and body["model"] == model_of(client)
    assert body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length") and choice["logprobs"] is None
    usage = body["usage"]
    assert usage["completion_tokens"] <= 4 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    block = engine_of(client).core.config.block_size
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "disk_cached_tokens": 0,
                                              "cache_write_tokens": usage["prompt_tokens"] // block * block,
                                              "pinned_tokens": 0, "pinned_until": None}

    resp = await client.post("/v1/chat/completions", json=chat(client), headers={"X-Request-Id": "trace-42"})
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "trace-42"
    resp = await client.get("/nope", headers={"X-Request-Id": "trace-43"})
    assert resp.status == 404 and resp.headers["X-Request-Id"] == "trace-43"


async def test_models_and_health(client):
    resp = await client.get("/v1/models")
    body = await resp.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [model_of(client)]
    resp = await client.get("/health")
    assert resp.status == 200 and (await resp.json()) == {"status": "ok"}


async def test_completions_prompt_forms_and_choice_indexes(client):
    tok = engine_of(client).tokenizer
    a, b = tok.encode("the cat"), tok.encode("a dog and a cat")
    body = {"model": model_of(client), "prompt": [a, b], "max_tokens": 3, "n": 2, "temperature": 0}
    resp = await client.post("/v1/completions", json=body)
    out = await resp.json()
    assert resp.status == 200 and out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["choices"][0]["text"] == out["choices"][1]["text"]  # greedy: the same text for both choices
    assert out["usage"]["prompt_tokens"] == len(a) + len(b)  # each prompt counted once
    resp = await client.post("/v1/completions", json={**body, "prompt": "the cat", "n": 1})
    text_out = await resp.json()
    resp = await client.post("/v1/completions", json={**body, "prompt": a, "n": 1})
    ids_out = await resp.json()
    assert text_out["choices"][0]["text"] == ids_out["choices"][0]["text"] == out["choices"][0]["text"]


async def test_completions_default_max_tokens_is_16(client):
    body = {"model": model_of(client), "prompt": "the cat", "ignore_eos": True}
    out = await (await client.post("/v1/completions", json=body)).json()
    assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"


# ---- errors: status and OpenAI error object

@pytest.mark.parametrize("method, path, payload, status, param, code", [
    ("POST", "/v1/chat/completions", b"{not json", 400, None, None),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400, None, None),
    ("POST", "/v1/chat/completions", {"model": 5}, 400, "model", None),
    ("POST", "/v1/chat/completions", {"temperature": "hot"}, 400, "temperature", None),
    ("POST", "/v1/chat/completions", {"n": 99}, 400, "n", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", None),
    ("POST", "/v1/chat/completions", {"model": "gpt-9"}, 404, "model", "model_not_found"),
    ("POST", "/v1/chat/completions", {"max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    # (the field the client sent, OpenAI's newer name: its 400 named max_tokens until 2026-12-01)
    ("POST", "/v1/chat/completions", {"max_completion_tokens": 5000}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("POST", "/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "prompt", None),
    ("POST", "/v1/completions", {"prompt": 7}, 400, "prompt", None),
    ("GET", "/nope", None, 404, None, "not_found"),
    ("DELETE", "/v1/models", None, 405, None, "method_not_allowed"),
    ("GET", "/v1/chat/completions", None, 405, None, "method_not_allowed"),
])
async def test_error_objects(client, method, path, payload, status, param, code):
    if isinstance(payload, dict):  # fill in a valid request around the field under test
        base = chat(client) if "chat" in path else {"model": model_of(client), "prompt": "x", "max_tokens": 2}
        payload = json.dumps({**base, **payload}).encode()
    resp = await client.request(method, path, data=payload)
    assert_error(resp.status, await resp.json(), status, param=param, code=code)
    assert resp.headers["Content-Type"].startswith("application/json")
    assert resp.headers["X-Request-Id"]


async def test_an_unknown_route_and_a_wrong_method_say_what_the_server_has(client):
    resp = await client.post("/v1/audio/speech", json={"model": model_of(client), "input": "hi"})
    message = (await resp.json())["error"]["message"]
    assert resp.status == 404 and "POST /v1/audio/speech" in message
    assert "POST /v1/chat/completions" in message and "GET /v1/models/{model_id}" in message
    resp = await client.delete("/v1/models")
    body = await resp.json()
    assert resp.status == 405 and resp.headers["Allow"] == "GET,HEAD"
    assert body["error"]["message"] == "DELETE is not allowed on /v1/models; allowed: GET,HEAD"


async def test_prompt_longer_than_max_prompt_tokens(make_client):
    client = await make_client(max_prompt_tokens=8)
    resp = await client.post("/v1/chat/completions", json=chat(client, "a long prompt " * 10))
    assert_error(resp.status, await resp.json(), 400, param="messages", code="context_length_exceeded")
    body = {"model": model_of(client), "prompt": list(range(9)), "max_tokens": 1}
    resp = await client.post("/v1/completions", json=body)
    assert_error(resp.status, await resp.json(), 400, param="prompt", code="context_length_exceeded")


async def test_prompt_filling_the_context(make_client):
    client = await make_client(engine={"max_model_len": 32})
    body = {"model": model_of(client), "prompt": list(range(32)), "max_tokens": 1}
    resp = await client.post("/v1/completions", json=body)
    assert_error(resp.status, await resp.json(), 400, param="prompt", code="context_length_exceeded")
    body = {"model": model_of(client), "prompt": list(range(30)), "max_tokens": 3}
    resp = await client.post("/v1/completions", json=body)
    assert_error(resp.status, await resp.json(), 400, param="max_tokens", code="context_length_exceeded")
    # chat without max_tokens may use the rest of the context
    resp = await client.post("/v1/chat/completions",
                             json={**chat(client, "hi"), "max_tokens": None, "ignore_eos": True})
    body = await resp.json()
    assert resp.status == 200
    assert body["usage"]["total_tokens"] == 32 and body["choices"][0]["finish_reason"] == "length"


async def test_body_too_large_is_413(make_client):
    client = await make_client(max_body_bytes=1024)
    resp = await client.post("/v1/chat/completions", json=chat(client, "x" * 2000))
    assert_error(resp.status, await resp.json(), 413, code="request_too_large")


async def test_max_tokens_limit(make_client):
    client = await make_client(max_tokens_limit=8)
    resp = await client.post("/v1/chat/completions", json=chat(client, max_tokens=9))
    assert_error(resp.status, await resp.json(), 400, param="max_tokens")


# ---- auth

async def test_api_keys(make_client):
    client = await make_client(keys=(ApiKey("sk-alice", "alice"),))
    for headers in ({}, {"Authorization": "Bearer sk-bob"}, {"Authorization": "Basic sk-alice"},
                    {"Authorization": "Bearer "}):
        resp = await client.post("/v1/chat/completions", json=chat(client), headers=headers)
        assert_error(resp.status, await resp.json(), 401, code="invalid_api_key", type_="authentication_error")
    resp = await client.get("/v1/models")
    assert resp.status == 401
    ok = {"Authorization": "Bearer sk-alice"}
    assert (await client.post("/v1/chat/completions", json=chat(client), headers=ok)).status == 200
    assert (await client.get("/v1/models", headers=ok)).status == 200
    assert (await client.get("/health")).status == 200  # probes and scrapes need no key
    assert (await client.get("/metrics")).status == 200


async def test_metrics_api_key_guards_the_tenant_names(make_client):
    client = await make_client(keys=(ApiKey("sk-alice", "alice"),), metrics_api_key="sk-scrape")
    for headers in ({}, {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-scrape2"}):
        resp = await client.get("/metrics", headers=headers)  # a tenant's key is not the metrics key
        assert_error(resp.status, await resp.json(), 401, code="invalid_api_key")
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    resp = await client.get("/metrics", headers={"Authorization": "Bearer sk-scrape"})
    assert resp.status == 200 and 'tenant="alice"' in await resp.text()
    assert (await client.get("/health")).status == 200
    resp = await client.post("/v1/chat/completions", json=chat(client), headers={"Authorization": "Bearer sk-scrape"})
    assert resp.status == 401  # and the metrics key is no API key


# ---- prefix cache through the gateway

async def test_anonymous_body_salt_narrows_the_cache(client):
    engine = engine_of(client)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital?"}]
    ids = prompt_ids(engine, messages)
    assert len(ids) >= 64
    expected = (len(ids) - 1) // BLOCK * BLOCK

    async def cached(**fields) -> int:
        body = {"model": model_of(client), "messages": messages, "max_tokens": 2, "temperature": 0, **fields}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200
        return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached() == 0
    assert await cached() == expected
    assert await cached(cache_salt="mine") == 0
    assert await cached(cache_salt="mine") == expected
    assert await cached(cache_salt="other") == 0


async def test_n_choices_share_the_prompt_blocks(client):
    engine = engine_of(client)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about blocks."}]
    ids = prompt_ids(engine, messages)
    hits_before = engine.scheduler_stats().prefix_cache.hits
    body = {"model": model_of(client), "messages": messages, "max_tokens": 3, "n": 4, "seed": 1}
    resp = await client.post("/v1/chat/completions", json=body)
    out = await resp.json()
    assert resp.status == 200 and len(out["choices"]) == 4
    assert out["usage"]["prompt_tokens"] == len(ids)  # the prompt once, not n times
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the first choice computed it
    # the other three choices hit every full block the first one prefilled (the last token is always computed)
    assert engine.scheduler_stats().prefix_cache.hits - hits_before == 3 * ((len(ids) - 1) // BLOCK * BLOCK)


# ---- streaming over plain HTTP

async def test_stream_chunks(client):
    body = chat(client, stream=True, stream_options={"include_usage": True}, max_tokens=5, ignore_eos=True)
    resp = await client.post("/v1/chat/completions", json=body)
    # (the charset, as vLLM and OpenAI send it: a client decoding text by HTTP's default read ISO-8859-1)
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["X-Request-Id"]
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    first, *content, finish, usage_chunk, _ = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == first["id"] for e in events[:-1])
    assert all(e["choices"][0]["finish_reason"] is None for e in content)
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                                    "stop_reason": None}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    plain = await (await client.post("/v1/chat/completions", json={**body, "stream": False,
                                                                    "stream_options": None})).json()
    assert "".join(e["choices"][0]["delta"]["content"] for e in content) == plain["choices"][0]["message"]["content"]


async def test_disconnect_mid_stream_aborts_and_releases_blocks(client):
    engine = engine_of(client)
    body = chat(client, SYSTEM, stream=True, max_tokens=2000, ignore_eos=True)
    resp = await client.post("/v1/chat/completions", json=body)
    events = await sse_events(resp, limit=3)
    assert len(events) == 3 and engine.num_unfinished() == 1
    resp.close()  # drops the connection: the handler is cancelled, the engine request aborted
    await wait_released(engine)


# ---- engine failures

async def test_engine_failure_is_a_500_and_the_server_keeps_serving(client):
    engine = engine_of(client)
    failures = iter([RuntimeError("injected failure")])

    def hook():
        exc = next(failures, None)
        if exc is not None:
            raise exc

    set_step_hook(engine, hook)
    resp = await client.post("/v1/chat/completions", json=chat(client))
    assert_error(resp.status, await resp.json(), 500, code="engine_error", type_="server_error")
    assert (await client.post("/v1/chat/completions", json=chat(client))).status == 200
    assert (await client.get("/health")).status == 200
    await wait_released(engine)


async def test_engine_failure_mid_stream_sends_an_error_event(client):
    engine = engine_of(client)
    steps = iter(range(100))

    def hook():
        if next(steps) == 3:
            raise RuntimeError("injected failure")

    set_step_hook(engine, hook)
    resp = await client.post("/v1/chat/completions", json=chat(client, stream=True, max_tokens=20, ignore_eos=True))
    assert resp.status == 200
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"  # after the error event, so an SSE reader closes cleanly
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert set(events[-2]) == {"error"} and events[-2]["error"]["code"] == "engine_error"
    await wait_released(engine)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop dies on purpose
async def test_dead_engine_loop_turns_health_red_and_fails_waiting_requests(client):
    engine = engine_of(client)
    set_step_hook(engine, lambda: time.sleep(0.01))
    stream = await client.post("/v1/chat/completions", json=chat(client, stream=True, max_tokens=3000, ignore_eos=True))
    assert len(await sse_events(stream, limit=2)) == 2

    def broken_step():
        raise RuntimeError("a bug in the step's own guard kills the engine loop")

    engine.core.step = broken_step  # the step guards everything inside it; this breaks the loop itself
    events = await asyncio.wait_for(sse_events(stream), timeout=10)  # an error event, then [DONE]
    assert events[-2]["error"]["code"] == "engine_dead" and events[-1] == "[DONE]"
    assert "engine loop died" in events[-2]["error"]["message"]
    assert not engine.is_alive()
    resp = await client.get("/health")
    assert_error(resp.status, await resp.json(), 503, code="engine_dead")
    # new requests: a plain 503 at once (a stream too: no 200 whose events never come), nothing held
    for path, body in (("/v1/chat/completions", chat(client)), ("/v1/chat/completions", chat(client, stream=True)),
                       ("/v1/completions", {"model": model_of(client), "prompt": "x", "stream": True})):
        resp = await client.post(path, json=body)  # engine_unavailable: refused before reaching the engine
        assert_error(resp.status, await resp.json(), 503, code="engine_unavailable")
        assert resp.headers["Retry-After"] == "2"  # the openai SDK's two retries outlast an engine restart
        assert "engine is not running" in (await resp.json())["error"]["message"]
    assert client.app[STATE].admission.in_flight == 0


# ---- admission

async def test_full_server_answers_429_with_retry_after(make_client):
    client = await make_client(engine={"max_num_seqs": 1}, max_waiting_requests=0, retry_after_s=2)
    engine = engine_of(client)
    set_step_hook(engine, lambda: time.sleep(0.002))
    first = await client.post("/v1/chat/completions", json=chat(client, stream=True, max_tokens=2000, ignore_eos=True))
    assert len(await sse_events(first, limit=2)) == 2
    resp = await client.post("/v1/chat/completions", json=chat(client))
    # refused at once, not queued: the first request (2,000 tokens) is still the only one in the engine
    assert engine.num_unfinished() == 1 and not first.content.at_eof()
    assert_error(resp.status, await resp.json(), 429, code="rate_limit_exceeded", type_="rate_limit_error")
    assert resp.headers["Retry-After"] == "2"
    first.close()
    await wait_released(engine)
    assert (await client.post("/v1/chat/completions", json=chat(client))).status == 200


async def test_tenant_concurrency_limit(make_client):
    client = await make_client(keys=(ApiKey("ka", "alice", max_concurrent=1), ApiKey("kb", "bob")))
    engine = engine_of(client)
    set_step_hook(engine, lambda: time.sleep(0.002))
    alice, bob = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    stream = await client.post("/v1/chat/completions", headers=alice,
                               json=chat(client, stream=True, max_tokens=2000, ignore_eos=True))
    assert len(await sse_events(stream, limit=2)) == 2
    resp = await client.post("/v1/chat/completions", headers=alice, json=chat(client))
    assert_error(resp.status, await resp.json(), 429, code="rate_limit_exceeded")
    assert "alice" in (await resp.json())["error"]["message"] and resp.headers["Retry-After"] == "1"
    assert (await client.post("/v1/chat/completions", headers=bob, json=chat(client))).status == 200
    stream.close()
    await wait_released(engine)
    assert (await client.post("/v1/chat/completions", headers=alice, json=chat(client))).status == 200


async def test_max_concurrent_counts_per_key_and_the_tenant_limit_all_keys(make_client):
    keys = (ApiKey("ka", "alice", max_concurrent=1), ApiKey("ka-ci", "alice"))
    client = await make_client(keys=keys, max_concurrent_per_tenant=2)
    engine = engine_of(client)
    set_step_hook(engine, lambda: time.sleep(0.002))
    ka, ka_ci = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer ka-ci"}
    body = chat(client, stream=True, max_tokens=2000, ignore_eos=True)
    first = await client.post("/v1/chat/completions", headers=ka, json=body)
    assert len(await sse_events(first, limit=2)) == 2
    resp = await client.post("/v1/chat/completions", headers=ka, json=chat(client))
    assert_error(resp.status, await resp.json(), 429, code="rate_limit_exceeded")  # ka's own limit (max_concurrent)
    second = await client.post("/v1/chat/completions", headers=ka_ci, json=body)  # alice's other key
    assert len(await sse_events(second, limit=2)) == 2
    resp = await client.post("/v1/chat/completions", headers=ka_ci, json=chat(client))
    assert_error(resp.status, await resp.json(), 429, code="rate_limit_exceeded")  # the tenant's (max_concurrent_per_tenant)
    first.close()
    second.close()
    await wait_released(engine)


# ---- metrics

async def test_metrics_use_route_templates(client):
    await client.post("/v1/chat/completions", json=chat(client))
    await client.get("/no/such/path/123")
    resp = await client.get("/metrics")
    text = await resp.text()
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    assert re.search(r'prefixgate_http_requests_total\{method="POST",route="/v1/chat/completions",'
                     r'status="200"\} 1\.0', text)
    assert 'route="unmatched"' in text and "/no/such/path" not in text
    assert "prefixgate_generation_tokens_total" in text


async def test_metrics_show_what_admission_holds(make_client):
    client = await make_client(engine={"max_num_seqs": 4}, max_waiting_requests=6)
    engine = engine_of(client)
    set_step_hook(engine, lambda: time.sleep(0.002))

    async def admitted() -> float:
        text = await (await client.get("/metrics")).text()
        capacity = re.search(r"prefixgate_admission_capacity_sequences\{[^}]*\} (\S+)", text)
        assert capacity and float(capacity.group(1)) == 10
        return float(re.search(r"prefixgate_admission_sequences\{[^}]*\} (\S+)", text).group(1))

    assert await admitted() == 0
    stream = await client.post("/v1/chat/completions", json=chat(client, stream=True, max_tokens=2000,
                                                                  ignore_eos=True, n=3))
    assert len(await sse_events(stream, limit=2)) == 2
    assert await admitted() == 3  # n = 3: three sequences
    stream.close()
    await wait_released(engine)
    assert await admitted() == 0


# ---- shutdown (the process-level SIGTERM path is in test_gateway_cli.py)

async def test_drain_waits_for_short_requests_and_cancels_long_ones(client):
    engine = engine_of(client)
    long = await client.post("/v1/chat/completions", json=chat(client, stream=True, max_tokens=3000, ignore_eos=True))
    assert len(await sse_events(long, limit=2)) == 2
    short = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat(client, max_tokens=3)))
    await asyncio.sleep(0.05)
    assert await client.app[IN_FLIGHT].drain(timeout=0.5) == 1  # the long stream
    assert (await short).status == 200
    await wait_released(engine)
    resp = await client.post("/v1/chat/completions", json=chat(client))
    assert_error(resp.status, await resp.json(), 503, code="shutting_down")
