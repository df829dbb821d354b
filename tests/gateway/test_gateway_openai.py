"""A real server on 127.0.0.1 (uvloop, its own thread) driven by the real `openai` SDK, sync and async.

One server for the module, with four API keys: alice, bob, and pub1/pub2 (public-salt tenants).
The engine is wrapped to record each request's prompt, output token ids and cache salt, so the
expected `cached_tokens` of every request can be derived exactly from what was computed before it.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import openai
import pytest
import uvloop
from aiohttp import web

from bench.engine_faults import assert_blocks_released
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.settings import ApiKey, GatewaySettings, Settings

BLOCK = 16
KEYS = {"alice": "sk-alice", "bob": "sk-bob", "pub1": "sk-pub1", "pub2": "sk-pub2"}
WORDS = ("the capital of France is Paris and the cache holds every block of the prefix so that a "
         "question about the world gets its answer fast").split()


@dataclass
class Recorded:
    prompt: list[int]
    cache_salt: str | None
    output: list[int] = field(default_factory=list)


class RecordingEngine:
    """The real AsyncEngine, plus a log of what each request computed."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.log: list[Recorded] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, request_id, prompt_token_ids, params, **kwargs):
        record = Recorded(list(prompt_token_ids), kwargs.get("cache_salt"))
        self.log.append(record)
        async with contextlib.aclosing(self._engine.generate(request_id, prompt_token_ids, params, **kwargs)) as gen:
            async for out in gen:
                record.output += out.new_token_ids
                yield out

    def expected_cached(self, index: int) -> int:
        """Full blocks of request `index`'s prompt that an earlier request with the same salt computed
        (its prompt and all but its last output token), capped so the last prompt token is computed."""
        request = self.log[index]
        best = 0
        for earlier in self.log[:index]:
            if earlier.cache_salt == request.cache_salt:
                best = max(best, _common_prefix(earlier.prompt + earlier.output[:-1], request.prompt))
        return min(best // BLOCK, (len(request.prompt) - 1) // BLOCK) * BLOCK


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ServerThread:
    """An AppRunner + TCPSite on port 0, on a uvloop loop in a background thread."""

    def __init__(self, app: web.Application) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        self._call(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self._call(site.start())
        self.port = self.runner.addresses[0][1]
        return self

    def __exit__(self, *exc) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK, num_kv_blocks=2048)
    keys = tuple(ApiKey(key, tenant) for tenant, key in KEYS.items())
    settings = Settings(config, GatewaySettings(api_keys=keys, public_salt_tenants=("pub1", "pub2")))
    engine = RecordingEngine(AsyncEngine.from_config(config))
    with ServerThread(create_app(settings, engine)) as running:
        running.engine = engine
        running.base_url = f"http://127.0.0.1:{running.port}/v1"
        yield running


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.engine.model_name


def sdk(server, tenant: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEYS[tenant], max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def alice(server):
    with sdk(server, "alice") as client:
        yield client


def unique_text(n_words: int) -> str:
    """Fresh text (so no earlier test's cache applies), made of words the tiny tokenizer knows."""
    rng = random.Random(uuid.uuid4().int)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def system_prompt() -> str:
    """70+ words, unique from its first tokens on (so no earlier test's block 0 can match)."""
    return f"[{uuid.uuid4().hex}] You are a careful assistant. " + unique_text(70)


def wait_released(engine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert engine.num_unfinished() == 0
            assert_blocks_released(engine)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


# ---- chat and completions

def test_chat(alice, model):
    resp = alice.chat.completions.create(model=model, messages=[{"role": "user", "content": unique_text(5)}],
                                         max_tokens=6, temperature=0)
    assert resp.object == "chat.completion" and resp.model == model
    assert resp.choices[0].message.role == "assistant" and isinstance(resp.choices[0].message.content, str)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_matches_non_stream(alice, model):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": unique_text(6)}]}]
    kwargs = dict(model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = alice.chat.completions.create(**kwargs)
    chunks = list(alice.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


async def test_completions_async_prompt_forms(server, model):
    tok = server.engine.tokenizer
    text = unique_text(6)
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key=KEYS["alice"], max_retries=0) as client:
        kwargs = dict(model=model, max_tokens=5, temperature=0)
        from_text, from_ids, many, many_ids = await asyncio.gather(
            client.completions.create(prompt=text, **kwargs),
            client.completions.create(prompt=tok.encode(text), **kwargs),
            client.completions.create(prompt=[text, "the world"], **kwargs),
            client.completions.create(prompt=[tok.encode(text), tok.encode("the world")], **kwargs))
        assert from_text.object == "text_completion"
        assert from_text.choices[0].text == from_ids.choices[0].text == many.choices[0].text
        assert [c.text for c in many.choices] == [c.text for c in many_ids.choices]
        assert many.usage.prompt_tokens == len(tok.encode(text)) + len(tok.encode("the world"))
        stream = await client.completions.create(prompt=text, stream=True, **kwargs)
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        assert streamed == from_text.choices[0].text


def test_stop_strings_are_cut_and_not_in_output(alice, model):
    messages = [{"role": "user", "content": "the capital of France is"}]  # fixed: greedy output is too
    kwargs = dict(model=model, messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = alice.chat.completions.create(**kwargs).choices[0].message.content
    start = next(i for i in range(1, len(full) - 2) if full[i:i + 2].isascii() and full[i:i + 2].isalnum())
    stop = full[start:start + 2]
    expected = full[:full.index(stop)]
    cut = alice.chat.completions.create(**kwargs, stop=stop).choices[0]
    assert cut.message.content == expected and cut.finish_reason == "stop"
    cut = alice.chat.completions.create(**kwargs, stop=["\x00never", stop]).choices[0]
    assert cut.message.content == expected
    streamed = alice.chat.completions.create(**kwargs, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_and_seed_reproducibility(alice, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": unique_text(6)}], max_tokens=8,
                  temperature=1.0, extra_body={"ignore_eos": True})
    first = alice.chat.completions.create(**kwargs, n=3, seed=123)
    again = alice.chat.completions.create(**kwargs, n=3, seed=123)
    other = alice.chat.completions.create(**kwargs, n=3, seed=999)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]  # same seed: same choices
    assert len(set(texts)) > 1  # choice i samples with seed + i
    assert texts != [c.message.content for c in other.choices]
    assert first.usage.completion_tokens == 3 * 8
    single = [alice.chat.completions.create(**kwargs, seed=123).choices[0].message.content for _ in range(2)]
    assert single[0] == single[1] == texts[0]


def test_logprobs(alice, model):
    resp = alice.chat.completions.create(model=model, messages=[{"role": "user", "content": unique_text(4)}],
                                         max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy picks the top token
        data = bytes(item.bytes)  # the token's own bytes; a piece of a character is spelled "bytes:\\x.."
        assert item.token == (data.decode() if item.token == data.decode("utf-8", "replace")
                              else "bytes:" + "".join("\\x%02x" % b for b in data))
    completion = alice.completions.create(model=model, prompt=unique_text(4), max_tokens=4, temperature=0,
                                          logprobs=2, extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


# ---- the prefix cache through the API

def test_shared_system_prompt_is_cached(server, alice, model):
    engine, system = server.engine, system_prompt()

    def ask(question: str, **extra) -> int:
        resp = alice.chat.completions.create(
            model=model, max_tokens=3, temperature=0, extra_body=extra,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
        cached = resp.usage.prompt_tokens_details.cached_tokens
        assert cached == engine.expected_cached(len(engine.log) - 1)
        return cached

    first_log = len(engine.log)
    assert ask("What is the capital of France?") == 0
    assert len(engine.log[first_log].prompt) >= 64
    assert ask("What is the prefix cache?") >= 64
    assert ask("What is the prefix cache?", cache_salt="project-x") == 0
    assert ask("What is the capital of France?", cache_salt="project-x") >= 64


def test_five_turn_conversation_hits_every_earlier_turn(server, alice, model):
    engine = server.engine
    messages = [{"role": "system", "content": system_prompt()}]
    previous = None
    for turn in range(5):
        messages.append({"role": "user", "content": f"Turn {turn}: " + unique_text(6)})
        resp = alice.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
        cached = resp.usage.prompt_tokens_details.cached_tokens
        record = engine.log[-1]
        assert cached == engine.expected_cached(len(engine.log) - 1)
        if previous is None:
            assert cached == 0
        else:
            # everything up to the previous turn's prompt is a cached prefix of this one
            assert record.prompt[:len(previous.prompt)] == previous.prompt
            assert cached >= len(previous.prompt) // BLOCK * BLOCK
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
        previous = record


def test_generated_blocks_are_cached_too(server, alice, model):
    engine = server.engine
    prompt = engine.tokenizer.encode(system_prompt())
    alice.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0,
                             extra_body={"ignore_eos": True})
    output = engine.log[-1].output
    follow_up = prompt + output + engine.tokenizer.encode(" and the world")
    resp = alice.completions.create(model=model, prompt=follow_up, max_tokens=2, temperature=0)
    # every full block of prompt + answer whose K/V was computed (all but the last sampled token)
    assert resp.usage.prompt_tokens_details.cached_tokens == (len(prompt) + len(output) - 1) // BLOCK * BLOCK


# ---- tenants

def _cached(server, client, model, system: str, **extra) -> int:
    resp = client.chat.completions.create(model=model, max_tokens=2, temperature=0, extra_body=extra,
                                          messages=[{"role": "system", "content": system},
                                                    {"role": "user", "content": "hello"}])
    cached = resp.usage.prompt_tokens_details.cached_tokens
    assert cached == server.engine.expected_cached(len(server.engine.log) - 1)
    return cached


def test_tenants_do_not_share_cache(server, model):
    system = system_prompt()
    with sdk(server, "alice") as alice, sdk(server, "bob") as bob:
        assert _cached(server, alice, model, system) == 0
        assert _cached(server, bob, model, system) == 0  # same prompt, other tenant: nothing
        assert _cached(server, bob, model, system) >= 64  # within a tenant: hit
        assert _cached(server, alice, model, system) >= 64


def test_copying_another_tenants_cache_salt_gets_nothing(server, model):
    system = system_prompt()
    with sdk(server, "alice") as alice, sdk(server, "bob") as bob:
        assert _cached(server, alice, model, system, cache_salt="team-secret") == 0
        assert _cached(server, bob, model, system, cache_salt="team-secret") == 0
        assert _cached(server, alice, model, system, cache_salt="team-secret") >= 64


def test_public_salt_tenants_share_on_purpose(server, model):
    system = system_prompt()
    with sdk(server, "pub1") as pub1, sdk(server, "pub2") as pub2, sdk(server, "alice") as alice:
        assert _cached(server, pub1, model, system) == 0
        assert _cached(server, pub2, model, system) >= 64
        assert _cached(server, alice, model, system) == 0


# ---- errors through the SDK, and a disconnect

def test_sdk_errors(server, alice, model):
    with pytest.raises(openai.NotFoundError) as err:
        alice.chat.completions.create(model="gpt-0", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        alice.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        alice.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=7)
    assert err.value.param == "temperature"
    with openai.OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    assert [m.id for m in alice.models.list()] == [model]


def test_disconnect_mid_stream_releases_blocks(server, alice, model):
    stream = alice.chat.completions.create(model=model, messages=[{"role": "user", "content": system_prompt()}],
                                           max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert server.engine.num_unfinished() == 1
    stream.close()
    wait_released(server.engine)
    assert len(server.engine.log[-1].output) < 3000  # aborted, not run to the end
