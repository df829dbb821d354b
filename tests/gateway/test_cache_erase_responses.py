"""DELETE /v1/cache erases the caller's stored responses with its cached blocks (their conversations hold the
same prompts), and only the caller's; a database that cannot be written makes it a 503 to retry that erased nothing,
never a silent half erasure."""
from __future__ import annotations

import sqlite3

import pytest

from gateway.app import create_app
from gateway.response_store import ResponseStore
from gateway.responses import RESPONSE_STORE
from gateway.settings import ApiKey
from gateway.state import STATE
from tests.support.gateway_helpers import tiny_settings

ALICE, BOB = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, tmp_path):
    db = tmp_path / "responses.sqlite3"
    settings = tiny_settings(tiny_llama_dir, keys=(ApiKey("sk-alice", "alice"), ApiKey("sk-bob", "bob")),
                             responses_db=str(db))
    client = await aiohttp_client(create_app(settings))
    client.db = db
    return client


async def respond(client, headers) -> str:
    resp = await client.post("/v1/responses", headers=headers, json={
        "model": client.app[STATE].model_name, "input": "hello", "max_output_tokens": 1})
    assert resp.status == 200, await resp.text()
    return (await resp.json())["id"]


async def test_delete_cache_erases_the_callers_stored_responses_only(client):
    alice = [await respond(client, ALICE) for _ in range(2)]
    bob = await respond(client, BOB)
    erased = await (await client.delete("/v1/cache", headers=ALICE)).json()
    assert erased["responses"] == 2
    for response_id in alice:
        assert (await client.get(f"/v1/responses/{response_id}", headers=ALICE)).status == 404
    assert (await client.get(f"/v1/responses/{bob}", headers=BOB)).status == 200
    assert client.app[RESPONSE_STORE].num_stored == 1


async def cached_tokens(client, headers) -> int:
    resp = await client.post("/v1/completions", headers=headers, json={
        "model": client.app[STATE].model_name, "prompt": list(range(10, 60)), "max_tokens": 1})
    return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_an_erase_the_database_refuses_is_a_503_to_retry_and_erases_nothing(client):
    await respond(client, ALICE)
    await cached_tokens(client, ALICE)
    store: ResponseStore = client.app[RESPONSE_STORE].backend
    store._busy_timeout_ms = 10  # the test holds the lock 10 ms, not 2 s
    other = sqlite3.connect(client.db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    refused = await client.delete("/v1/cache", headers=ALICE)
    other.execute("ROLLBACK")
    other.close()
    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
    assert (await refused.json())["error"]["code"] == "responses_store_busy"
    assert await cached_tokens(client, ALICE) == 48  # the blocks are still there: nothing was erased
    erased = await (await client.delete("/v1/cache", headers=ALICE)).json()
    assert erased["responses"] == 1 and erased["blocks"] > 0
    assert await cached_tokens(client, ALICE) == 0


async def test_a_refused_erase_keeps_the_responses_waiting_for_the_database_too(client):
    store: ResponseStore = client.app[RESPONSE_STORE].backend
    store._busy_timeout_ms = 10
    other = sqlite3.connect(client.db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        waiting = await respond(client, ALICE)  # the database locked: it waits in memory
        assert client.app[RESPONSE_STORE].num_pending == 1
        refused = await client.delete("/v1/cache", headers=ALICE)
        assert refused.status == 503
        assert (await client.get(f"/v1/responses/{waiting}", headers=ALICE)).status == 200  # erased nothing
    finally:
        other.execute("ROLLBACK")
        other.close()
    erased = await (await client.delete("/v1/cache", headers=ALICE)).json()
    assert erased["responses"] == 1
    assert (await client.get(f"/v1/responses/{waiting}", headers=ALICE)).status == 404
