"""Puts the database cannot take are kept in memory, served from there, written once it takes them again, and
never cancelled by their client; and a Responses stream's response is stored before the client hears
`response.completed`, so a client that leaves (or continues) at that event finds it."""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from gateway.errors import APIError
from gateway.response_store import Stored, not_found
from gateway.response_store_pending import PendingPuts
from gateway.responses import RESPONSE_STORE
from tests.support.gateway_helpers import LiveServer, tiny_settings


def stored(response_id: str, tenant: str = "alice") -> Stored:
    return Stored(tenant, {"id": response_id, "object": "response"}, [], [{"role": "user", "content": "hi"}])


class Database:
    """A store backend that takes puts only while `up`, and can hold each put `delay` seconds first."""

    path = "test-db"
    num_dropped = 0

    def __init__(self) -> None:
        self.up = True
        self.delay = 0.0
        self.calls = 0
        self.rows: dict[str, Stored] = {}
        self.closed = False

    @property
    def num_stored(self) -> int:
        return len(self.rows)

    async def aput(self, item: Stored, warn: bool = True) -> bool:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.up:
            self.rows[item.response["id"]] = item
        return self.up

    async def aget(self, tenant: str, response_id: str) -> Stored:
        item = self.rows.get(response_id)
        if item is None or item.tenant != tenant:
            raise not_found(response_id)
        return item

    async def adelete(self, tenant: str, response_id: str) -> None:
        await self.aget(tenant, response_id)
        del self.rows[response_id]

    async def aerase(self, tenant: str) -> int:
        mine = [r for r, item in self.rows.items() if item.tenant == tenant]
        for response_id in mine:
            del self.rows[response_id]
        return len(mine)

    async def aclose(self) -> None:
        self.closed = True


async def code_of(call) -> tuple[int, str]:
    with pytest.raises(APIError) as err:
        await call
    return err.value.status, err.value.code


async def until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_puts_the_database_refuses_are_served_from_memory_and_written_once_it_is_back(caplog):
    db = Database()
    store = PendingPuts(db, retry_s=0.01)
    await store.aput(stored("resp_1"))
    db.up = False
    with caplog.at_level(logging.WARNING, logger="gateway.response_store_pending"):
        await store.aput(stored("resp_2"))
        await store.aput(stored("resp_3", tenant="bob"))
        await asyncio.sleep(0.05)  # retried, still refused
        assert (store.num_pending, store.num_stored, set(db.rows)) == (2, 3, {"resp_1"})
        assert (await store.aget("alice", "resp_2")).response["id"] == "resp_2"  # from memory
        assert await code_of(store.aget("alice", "resp_3")) == (404, "response_not_found")  # bob's
        assert await code_of(store.adelete("alice", "resp_3")) == (404, "response_not_found")
        db.up = True
        await until(lambda: store.num_pending == 0)
    assert set(db.rows) == {"resp_1", "resp_2", "resp_3"} and store.num_stored == 3
    assert "test-db cannot take puts now; keeping them in memory and trying again" in caplog.text
    assert "test-db took every put kept in memory" in caplog.text
    await store.aclose()
    assert db.closed and store.num_lost == 0


async def test_puts_sent_at_once_to_a_refusing_database_wait_for_one_refusal_not_one_each():
    db = Database()
    db.up, db.delay = False, 0.05  # (SQLite waiting out another writer's lock, a timed-out Postgres)
    store = PendingPuts(db, retry_s=60)
    await asyncio.gather(*(store.aput(stored(f"resp_{n}")) for n in range(8)))
    assert (db.calls, store.num_pending) == (1, 8)  # the first was refused; the other seven joined it at once
    await store.aclose()


async def test_a_tenant_over_the_bound_drops_its_own_oldest_not_anothers():
    db = Database()
    db.up = False
    size = sum(len(json.dumps(part)) for part in (stored("resp_0").response, [], stored("resp_0").messages))
    store = PendingPuts(db, max_pending_bytes=4 * size, retry_s=60)
    await store.aput(stored("resp_0"))  # alice's, the oldest
    for n in range(1, 6):
        await store.aput(stored(f"resp_{n}", tenant="bob"))
    assert (await store.aget("alice", "resp_0")).tenant == "alice"
    assert await code_of(store.aget("bob", "resp_1")) == (404, "response_not_found")  # bob's own oldest went
    assert (store.num_pending, store.num_lost) == (4, 2)
    await store.aclose()


async def test_a_waiting_put_deleted_or_erased_is_never_written():
    db = Database()
    db.up = False
    store = PendingPuts(db, retry_s=0.01)
    for name, tenant in (("resp_1", "alice"), ("resp_2", "alice"), ("resp_3", "bob")):
        await store.aput(stored(name, tenant))
    await store.adelete("alice", "resp_1")
    assert await code_of(store.aget("alice", "resp_1")) == (404, "response_not_found")
    assert await store.aerase("bob") == 1
    db.up = True
    await until(lambda: store.num_pending == 0)
    assert set(db.rows) == {"resp_2"}
    await store.aclose()


async def test_waiting_puts_are_bounded_and_what_waits_at_close_is_counted_lost(caplog):
    db = Database()
    db.up = False
    size = sum(len(json.dumps(part)) for part in (stored("resp_0").response, [], stored("resp_0").messages))
    store = PendingPuts(db, max_pending_bytes=2 * size, retry_s=60)  # room for two
    with caplog.at_level(logging.WARNING, logger="gateway.response_store_pending"):
        for n in range(3):
            await store.aput(stored(f"resp_{n}"))
        assert (store.num_pending, store.num_lost) == (2, 1)
        assert await code_of(store.aget("alice", "resp_0")) == (404, "response_not_found")  # the oldest went
        await store.aclose()  # tried once more, still refused
    assert (store.num_lost, db.rows) == (3, {})
    assert "more than 0 MiB of puts wait for test-db; dropped the oldest, resp_0" in caplog.text
    assert "test-db still cannot take 2 puts; lost at exit: resp_1, resp_2" in caplog.text


async def test_a_put_outlives_the_request_that_made_it_and_an_id_with_a_nul_is_not_found():
    db = Database()
    db.delay = 0.2
    store = PendingPuts(db)
    request = asyncio.ensure_future(store.aput(stored("resp_1")))
    await asyncio.sleep(0.05)
    request.cancel()  # the client went away mid-put: its handler is cancelled, not the put
    await until(lambda: "resp_1" in db.rows)
    assert await code_of(store.aget("alice", "resp_\x00")) == (404, "response_not_found")
    assert await code_of(store.adelete("alice", "resp_\x00")) == (404, "response_not_found")
    await store.aclose()


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir)) as live:
        yield live


FINAL = ("response.completed", "response.incomplete")  # (the latter: cut at max_output_tokens)


async def _stream_until_completed(url: str, model: str, **fields) -> str:
    """A Responses stream read until its response.completed (or .incomplete) event, then left at once (as the openai SDK's
    `with client.responses.create(stream=True)` block does on a break); returns the response's id."""
    body = {"model": model, "input": "hello", "max_output_tokens": 3, "stream": True, **fields}
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/responses", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: ") and json.loads(line[6:])["type"] in FINAL:
                return json.loads(line[6:])["response"]["id"]
    raise AssertionError("no final event")


async def _status_of_get(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status


def test_a_client_that_leaves_or_continues_at_response_completed_finds_it_stored(server):
    backend = server.app[RESPONSE_STORE].backend
    put = backend.aput

    async def slow_put(item: Stored) -> bool:  # a database that takes its time
        await asyncio.sleep(0.3)
        return await put(item)

    backend.aput = slow_put
    try:
        model = server.state.model_name
        response_id = server.call(_stream_until_completed(server.url, model))
        continued = server.call(_stream_until_completed(server.url, model, previous_response_id=response_id))
        assert continued.startswith("resp")  # (a 400 previous_response_not_found has no events)
        assert [server.call(_status_of_get(server.url + f"/v1/responses/{r}")) for r in (response_id, continued)] == \
            [200, 200]
    finally:
        backend.aput = put
