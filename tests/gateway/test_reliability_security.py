"""Security: keys compared in constant time, no key / prompt / output in INFO logs, and tenant cache
isolation, as a property of salts and block hashes and end to end under concurrency."""
from __future__ import annotations

import asyncio
import logging
import types

from hypothesis import given, settings
from hypothesis import strategies as st

import gateway.auth
from bench.engine_faults import set_step_hook
from engine.kv.hashing import hash_full_blocks
from gateway.app import create_app
from gateway.auth import Authenticator
from gateway.settings import ApiKey, GatewaySettings, key_tenant, load_settings
from gateway.state import STATE
from tests.support.gateway_helpers import tiny_settings
from tests.gateway.test_gateway_http import BLOCK, chat, model_of, sse_events, wait_released

# ---- constant-time key comparison


def test_key_lookup_compares_every_key_in_constant_time(monkeypatch):
    keys = tuple(ApiKey(f"sk-key-{i}", f"tenant{i}") for i in range(5))
    auth = Authenticator(GatewaySettings(api_keys=keys, salt_secret="s"))
    calls = []

    def counting(a, b):
        calls.append((len(a), len(b)))
        return original(a, b)

    original = gateway.auth.hmac.compare_digest
    monkeypatch.setattr(gateway.auth.hmac, "compare_digest", counting)
    for key in ("sk-key-0", "sk-key-4", "nope", "x" * 10_000, ""):
        calls.clear()
        request = types.SimpleNamespace(headers={"Authorization": f"Bearer {key}"})
        try:
            auth.authenticate(request)
        except gateway.auth.APIError:
            pass
        # every configured key is compared, always over fixed-size digests: neither which key matched
        # nor the length of the one sent changes the work done
        assert calls == [(32, 32)] * len(keys)


# ---- nothing secret in the logs at INFO

SECRET_KEY = "sk-zz-9f4e2c1b7a-secret"
SECRET_PROMPT = "quokka-zebra-7731 tells the capital of France"
SECRET_USER = "user-handle-55aa"
SECRET_SALT = "body-salt-c0ffee"


async def test_no_key_prompt_or_output_in_info_logs(aiohttp_client, tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO)  # every logger: gateway, engine, aiohttp
    client = await aiohttp_client(create_app(tiny_settings(tiny_llama_dir, keys=(ApiKey(SECRET_KEY, "t"),))))
    engine = client.app[STATE].engine
    auth = {"Authorization": f"Bearer {SECRET_KEY}"}
    outputs = []
    extra = {"user": SECRET_USER, "cache_salt": SECRET_SALT, "max_tokens": 12, "ignore_eos": True,
             "temperature": 0}
    for stream in (False, True):
        resp = await client.post("/v1/chat/completions", headers=auth, json=chat(client, SECRET_PROMPT, stream=stream,
                                                                                  **extra))
        assert resp.status == 200
        if stream:
            outputs.append("".join(e["choices"][0]["delta"].get("content", "") for e in (await sse_events(resp))[:-1]
                                   if e["choices"]))
        else:
            outputs.append((await resp.json())["choices"][0]["message"]["content"])
        body = {"model": model_of(client), "prompt": SECRET_PROMPT, "stream": stream, **extra}
        resp = await client.post("/v1/completions", headers=auth, json=body)
        assert resp.status == 200
        if not stream:
            outputs.append((await resp.json())["choices"][0]["text"])
    # failures log too: a wrong key, a rejected body, a failing engine step
    await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {SECRET_KEY}x"},
                      json=chat(client, SECRET_PROMPT))
    await client.post("/v1/chat/completions", headers=auth, json={**chat(client, SECRET_PROMPT), "n": 0})
    def failing_step() -> None:
        raise RuntimeError("injected")

    set_step_hook(engine, failing_step)
    resp = await client.post("/v1/chat/completions", headers=auth, json=chat(client, SECRET_PROMPT))
    assert resp.status == 500
    set_step_hook(engine, None)
    await wait_released(engine)
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert "done: tenant=t" in logged and "POST /v1/chat/completions 200" in logged  # logging was on
    for secret in (SECRET_KEY, SECRET_PROMPT, "quokka", SECRET_USER, SECRET_SALT):
        assert secret not in logged
    for text in outputs:
        assert len(text) < 6 or text not in logged


# ---- tenant isolation: salts and block hashes

tenant_names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
body_salts = st.none() | st.text(max_size=12)


def _tenant(auth: Authenticator, key: str):
    return auth.authenticate(types.SimpleNamespace(headers={"Authorization": f"Bearer {key}"}))


@settings(max_examples=200, deadline=None)
@given(a=tenant_names, b=tenant_names, salt_a=body_salts, salt_b=body_salts, secret=st.text(max_size=8),
       tokens=st.lists(st.integers(0, 50_000), min_size=BLOCK, max_size=4 * BLOCK))
def test_different_tenants_never_share_a_block_hash(a, b, salt_a, salt_b, secret, tokens):
    if a == b:
        b = a + "'"
    auth = Authenticator(GatewaySettings(api_keys=(ApiKey("ka", a), ApiKey("kb", b)), salt_secret=secret or None))
    tenant_a, tenant_b = _tenant(auth, "ka"), _tenant(auth, "kb")
    cache_a, cache_b = tenant_a.cache_salt(salt_a), tenant_b.cache_salt(salt_b)
    assert cache_a and cache_b and cache_a != cache_b  # whatever salt the bodies send
    hashes_a = hash_full_blocks(tokens, BLOCK, cache_salt=cache_a)
    hashes_b = hash_full_blocks(tokens, BLOCK, cache_salt=cache_b)
    assert len(hashes_a) == len(tokens) // BLOCK and not set(hashes_a) & set(hashes_b)
    # a body salt only narrows: it never lands back on the tenant's own (or the other's) plain salt
    if salt_a:
        assert cache_a not in (tenant_a.cache_salt(None), tenant_b.cache_salt(None))
    # and the same tenant with the same body salt always gets the same cache
    assert tenant_a.cache_salt(salt_a) == _tenant(auth, "ka").cache_salt(salt_a)


# ---- tenant isolation end to end, under concurrency

async def test_concurrent_tenants_only_hit_their_own_cache(aiohttp_client, tiny_llama_dir):
    keys = (ApiKey("ka", "alice"), ApiKey("kb", "bob"))
    client = await aiohttp_client(create_app(tiny_settings(tiny_llama_dir, keys=keys, engine={"num_kv_blocks": 1024})))
    engine = client.app[STATE].engine
    tok = engine.tokenizer
    alice, bob = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    # distinct first blocks: a hit can only come from the same prompt
    prompts = [tok.encode(f"prompt {i} " * 3)[:4] + tok.encode("the capital of France is Paris and " * 8)
               for i in range(8)]
    assert len({tuple(p[:BLOCK]) for p in prompts}) == len(prompts)

    async def cached(headers: dict, prompt: list[int], **fields) -> int:
        body = {"model": model_of(client), "prompt": prompt, "max_tokens": 3, "temperature": 0, **fields}
        resp = await client.post("/v1/completions", headers=headers, json=body)
        assert resp.status == 200
        return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def probe(prompt: list[int]) -> None:
        full = (len(prompt) - 1) // BLOCK * BLOCK
        assert await cached(alice, prompt) == 0
        # alice's blocks are cached now; bob's first request runs while alice keeps hitting them
        alice_again, bob_first, bob_salted, alice_salted = await asyncio.gather(
            asyncio.gather(*(cached(alice, prompt) for _ in range(3))), cached(bob, prompt),
            cached(bob, prompt, cache_salt="shared-word"), cached(alice, prompt, cache_salt="shared-word"))
        assert alice_again == [full] * 3
        assert bob_first == 0 and bob_salted == 0 and alice_salted == 0
        assert await cached(bob, prompt) == full  # bob's own earlier request
        assert await cached(bob, prompt, cache_salt="shared-word") == full

    await asyncio.gather(*(probe(p) for p in prompts))
    await wait_released(engine)


async def test_public_salt_tenants_share_on_purpose(aiohttp_client, tiny_llama_dir):
    keys = (ApiKey("ka", "alice"), ApiKey("kb", "bob"), ApiKey("kc", "carol"))
    settings = tiny_settings(tiny_llama_dir, keys=keys, public_salt_tenants=("alice", "bob"))
    client = await aiohttp_client(create_app(settings))
    prompt = client.app[STATE].engine.tokenizer.encode("the capital of France is Paris and " * 6)
    full = (len(prompt) - 1) // BLOCK * BLOCK

    async def cached(key: str) -> int:
        body = {"model": model_of(client), "prompt": prompt, "max_tokens": 2}
        resp = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body)
        return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached("ka") == 0
    assert await cached("kb") == full  # alice and bob share a salt by configuration
    assert await cached("kc") == 0  # carol does not


async def test_bare_api_keys_never_share_a_cache(aiohttp_client, tiny_llama_dir):
    """`--api-key K1 --api-key K2` (no tenants): two customers, two tenants, two caches."""
    keys = load_settings(None, {}, {}, ["sk-customer-one", "sk-customer-two", "sk-one-ci:" + key_tenant("sk-customer-one")])
    client = await aiohttp_client(create_app(tiny_settings(tiny_llama_dir, keys=keys.gateway.api_keys)))
    prompt = client.app[STATE].engine.tokenizer.encode("the capital of France is Paris and " * 6)
    full = (len(prompt) - 1) // BLOCK * BLOCK

    async def cached(key: str) -> int:
        body = {"model": model_of(client), "prompt": prompt, "max_tokens": 2}
        resp = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body)
        assert resp.status == 200
        return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached("sk-customer-one") == 0
    assert await cached("sk-customer-two") == 0  # was `default` for both: a hit, and a probe
    assert await cached("sk-one-ci") == full  # a key that names the first key's tenant on purpose
    metrics = await (await client.get("/metrics")).text()
    assert key_tenant("sk-customer-two") in metrics and "sk-customer" not in metrics  # names, never keys


async def test_the_request_log_keeps_the_path_as_sent(aiohttp_client, tiny_llama_dir, caplog):
    """A %0A or %00 in a path stays encoded in the log: decoded, it would forge a line or make the file binary."""
    caplog.set_level(logging.INFO, logger="gateway")
    client = await aiohttp_client(create_app(tiny_settings(tiny_llama_dir)))
    assert (await client.get("/v1/responses/resp_y%0AFORGED%00")).status == 404
    logged = [r.getMessage() for r in caplog.records]
    assert "GET /v1/responses/resp_y%0AFORGED%00 404" in " ".join(logged)
    assert not any("\n" in line or "\x00" in line for line in logged)
