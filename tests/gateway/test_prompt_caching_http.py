"""Prompt caching through HTTP and the openai SDK: `cache_control` breakpoints (on a message, a content part,
or in `extra_body`), the 400s of a wrong one, the accounting in usage, quotas from the keys file, the cache
endpoints (GET /v1/cache, POST /v1/cache/warm, DELETE /v1/cache) with tenants kept apart, expiry and its
metrics, and pins that survive a restart. The engine process's path: tests/engine/test_engine_process.py."""
from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from gateway.settings import ApiKey
from tests.support.gateway_helpers import LiveServer, tiny_settings

BS = 16
KEYS = (ApiKey("sk-alice", "alice"), ApiKey("sk-bob", "bob"), ApiKey("sk-small", "small", max_pinned_blocks=2))


def client(server: LiveServer, key: str = "none") -> openai.OpenAI:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    c.served_model = server.state.model_name
    return c


def system_prompt() -> str:
    """Long enough for several blocks, unique so no other test's cache hits it."""
    return f"[{uuid.uuid4().hex}] You are a careful assistant who answers briefly. " * 4


def chat(c: openai.OpenAI, messages: list[dict], **extra):
    return c.chat.completions.create(model=c.served_model, messages=messages, max_tokens=2, temperature=0, **extra)


def details(response) -> dict:
    return response.usage.prompt_tokens_details.model_dump()


def prefix_tokens(server: LiveServer, messages: list[dict]) -> int:
    """Tokens of the conversation rendered alone (no generation prompt): what a breakpoint at its end covers."""
    tok = server.engine.tokenizer
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False)))


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir, keys=KEYS)) as live:
        yield live


def get(server: LiveServer, path: str, key: str) -> dict:
    return httpx.get(server.url + path, headers={"Authorization": f"Bearer {key}"}).json()


def test_a_message_breakpoint_pins_its_prefix_and_a_hit_renews_it(server):
    c = client(server, "sk-alice")
    system = {"role": "system", "content": system_prompt(), "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    first = chat(c, [system, {"role": "user", "content": "hi"}])
    expected = prefix_tokens(server, [{"role": "system", "content": system["content"]}]) // BS * BS
    assert details(first)["pinned_tokens"] == expected > 0
    assert abs(details(first)["pinned_until"] - (time.time() + 3600)) < 60
    second = chat(c, [{"role": "system", "content": system["content"]}, {"role": "user", "content": "bye"}])
    assert details(second)["cached_tokens"] >= expected
    assert details(second)["pinned_tokens"] == expected  # the hit renewed the pin (no cache_control needed)
    [pin] = [p for p in get(server, "/v1/cache", "sk-alice")["data"] if p["tokens"] == expected]
    assert pin["ttl"] == "1h" and pin["hits"] == 1 and pin["object"] == "cache.pin"


def test_a_content_part_breakpoint_pins_only_up_to_that_part(server):
    c = client(server, "sk-alice")
    head, tail = system_prompt(), system_prompt()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": head, "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": tail}]}]
    pinned = details(chat(c, messages))["pinned_tokens"]
    whole = prefix_tokens(server, [{"role": "user", "content": head + "\n" + tail}])
    assert 0 < pinned <= prefix_tokens(server, [{"role": "user", "content": head}]) < whole


def test_extra_body_breakpoints_for_clients_that_drop_message_fields(server):
    c = client(server, "sk-alice")
    messages = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": "hello"}]
    response = chat(c, messages, extra_body={"cache_control": [{"type": "ephemeral", "message": 0}]})
    assert details(response)["pinned_tokens"] == prefix_tokens(server, messages[:1]) // BS * BS


def test_completions_pin_a_prompt_prefix_by_token_count(server):
    c = client(server, "sk-alice")
    prompt = list(range(300, 400))
    response = c.completions.create(model=c.served_model, prompt=prompt, max_tokens=1,
                                    extra_body={"cache_control": {"type": "ephemeral", "tokens": 40}})
    assert details(response)["pinned_tokens"] == 32  # full blocks only
    whole = c.completions.create(model=c.served_model, prompt=list(range(400, 450)), max_tokens=1,
                                 extra_body={"cache_control": {"type": "ephemeral"}})
    assert details(whole)["pinned_tokens"] == 48


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a",
                                                 "cache_control": {"type": "ephemeral"}}] * 5}]},
     "messages[0].content[4].cache_control"),
    ({"messages": [{"role": "user", "content": "a", "cache_control": {"type": "ephemeral", "ttl": "10m"}}]},
     "messages[0].cache_control.ttl"),
    ({"messages": [{"role": "user", "content": "a", "cache_control": {"type": "persistent"}}]},
     "messages[0].cache_control.type"),
    ({"messages": [{"role": "user", "content": "a"}], "cache_control": {"type": "ephemeral", "message": 3}},
     "cache_control.message"),
    ({"messages": [{"role": "user", "content": "a"}], "cache_control": "yes"}, "cache_control"),
])
def test_a_wrong_breakpoint_is_a_400_naming_its_field(server, body, param):
    c = client(server, "sk-alice")
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=c.served_model, max_tokens=1, messages=body["messages"],
                                  extra_body={k: v for k, v in body.items() if k != "messages"})
    assert err.value.body["param"] == param


def test_a_pin_beyond_the_keys_quota_is_refused_and_the_request_still_answers(server):
    c = client(server, "sk-small")
    system = {"role": "system", "content": system_prompt(), "cache_control": {"type": "ephemeral"}}
    response = chat(c, [system, {"role": "user", "content": "hi"}])
    assert response.choices[0].message.content is not None
    assert details(response)["pinned_tokens"] == 0 and details(response)["pin_refused"] == "tenant_quota"
    listed = get(server, "/v1/cache", "sk-small")
    assert listed["data"] == [] and listed["max_pinned_blocks"] == 2
    metrics = httpx.get(server.url + "/metrics").text
    model = server.state.model_name
    assert f'prefixgate_tenant_pins_refused_total{{model_name="{model}",reason="tenant_quota",tenant="small"}} 1.0' \
        in metrics


def test_warm_computes_and_pins_a_prefix_that_later_chats_hit(server):
    system = [{"role": "system", "content": system_prompt()}]
    warmed = httpx.post(server.url + "/v1/cache/warm", headers={"Authorization": "Bearer sk-bob"},
                        json={"messages": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}).json()
    usage = warmed["usage"]
    assert warmed["object"] == "cache.warm" and usage["prompt_tokens"] == prefix_tokens(server, system)
    assert usage["prompt_tokens_details"]["pinned_tokens"] == usage["prompt_tokens"] // BS * BS
    response = chat(client(server, "sk-bob"), system + [{"role": "user", "content": "hi"}])
    assert details(response)["cached_tokens"] == usage["prompt_tokens"] // BS * BS
    assert details(response)["cache_write_tokens"] < usage["prompt_tokens"]


def test_warm_needs_messages_or_prompt(server):
    response = httpx.post(server.url + "/v1/cache/warm", headers={"Authorization": "Bearer sk-bob"}, json={})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_delete_erases_the_callers_cache_only(server):
    messages = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": "same for both"}]
    alice, bob = client(server, "sk-alice"), client(server, "sk-bob")
    for c in (alice, bob):
        chat(c, messages, extra_body={"cache_control": {"type": "ephemeral"}})
        assert details(chat(c, messages))["cached_tokens"] > 0
    erased = httpx.delete(server.url + "/v1/cache", headers={"Authorization": "Bearer sk-alice"}).json()
    assert erased["object"] == "cache.deleted" and erased["blocks"] > 0 and erased["pins"] >= 1
    assert get(server, "/v1/cache", "sk-alice")["data"] == []
    assert details(chat(alice, messages))["cached_tokens"] == 0
    assert details(chat(bob, messages))["cached_tokens"] > 0
    assert get(server, "/v1/cache", "sk-bob")["data"]
    server.wait_idle()


def test_cache_endpoints_need_a_key_when_keys_are_on(server):
    assert httpx.get(server.url + "/v1/cache").status_code == 401
    assert httpx.delete(server.url + "/v1/cache").status_code == 401


def test_an_expired_pin_is_released_and_counted(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir)) as live:
        c = client(live)
        system = {"role": "system", "content": system_prompt(), "cache_control": {"type": "ephemeral"}}
        assert details(chat(c, [system, {"role": "user", "content": "hi"}]))["pinned_tokens"] > 0
        pins = live.engine.core.kv.pins
        pins.clock = lambda: time.time() + 301  # five minutes on: the idle engine loop expires it
        deadline = time.monotonic() + 10
        while pins.pins and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get(live, "/v1/cache", "none")["data"] == []
        live.wait_idle()
        metrics = httpx.get(live.url + "/metrics").text
        model = live.state.model_name
        assert f'prefixgate_tenant_pin_expiries_total{{model_name="{model}",tenant="anonymous"}} 1.0' in metrics
        assert f'prefixgate_pins_released_total{{model_name="{model}",reason="expired"}} 1.0' in metrics


def test_pins_survive_a_gateway_restart_through_the_disk_tier(tiny_llama_dir, tmp_path):
    settings = tiny_settings(tiny_llama_dir, engine={"kv_disk_dir": str(tmp_path)})
    system = {"role": "system", "content": system_prompt(), "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    with LiveServer(settings) as live:
        before = details(chat(client(live), [system, {"role": "user", "content": "hi"}]))
        listed = get(live, "/v1/cache", "none")["data"]
    with LiveServer(settings) as live:  # a new engine: the pin comes back with its blocks and expiry
        assert get(live, "/v1/cache", "none")["data"] == listed
        plain = {"role": "system", "content": system["content"]}
        after = details(chat(client(live), [plain, {"role": "user", "content": "hello"}]))
        assert after["cached_tokens"] >= before["pinned_tokens"] > 0
        assert after["pinned_until"] >= before["pinned_until"]


def test_the_cache_endpoints_answer_as_the_openapi_document_says(server):
    from tests.gateway.test_openapi_responses import assert_matches, response_schema

    spec = httpx.get(server.url + "/openapi.json").json()
    auth = {"Authorization": "Bearer sk-small"}
    system = [{"role": "system", "content": system_prompt()}]
    for path, method, body in [("/v1/cache/warm", "post", {"messages": system}),  # refused: over the quota
                               ("/v1/cache", "get", None), ("/v1/cache", "delete", None)]:
        response = httpx.request(method, server.url + path, headers=auth, json=body)
        assert response.status_code == 200
        assert_matches(spec, response_schema(spec, path, method), response.json())
    pinned = httpx.post(server.url + "/v1/cache/warm", headers={"Authorization": "Bearer sk-bob"},
                        json={"prompt": list(range(400, 440))})
    assert_matches(spec, response_schema(spec, "/v1/cache/warm"), pinned.json())
    assert_matches(spec, response_schema(spec, "/v1/cache", "get"), get(server, "/v1/cache", "sk-bob"))


def test_responses_take_breakpoints_by_message_index_and_report_the_pin(server):
    c = client(server, "sk-alice")
    instructions = system_prompt()
    first = c.responses.create(model=c.served_model, instructions=instructions, input="hi", max_output_tokens=2,
                               extra_body={"cache_control": {"type": "ephemeral", "message": 0}})
    pinned = first.usage.input_tokens_details.model_dump()["pinned_tokens"]
    assert pinned == prefix_tokens(server, [{"role": "system", "content": instructions}]) // BS * BS > 0
    follow = c.responses.create(model=c.served_model, instructions=instructions, input="more",
                                previous_response_id=first.id, max_output_tokens=2)
    details = follow.usage.input_tokens_details.model_dump()
    assert details["cached_tokens"] >= pinned and details["pinned_tokens"] == pinned  # renewed by the hit
