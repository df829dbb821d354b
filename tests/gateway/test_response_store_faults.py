"""Stored responses when their SQLite file fails: locked by another writer past the busy timeout, broken while
serving (garbage over the file), or garbage at start (moved aside for a new file). Every call ends in a warning
naming the file and a 404 for the ids it lost (a 503 for a delete that may be retried), never a 500 or a failed
start; and the event loop never waits on SQLite: a write held by another gateway's lock leaves every other
request served."""
from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.errors import APIError
from gateway.response_store import ResponseStore, Stored
from gateway.responses import RESPONSE_STORE
from gateway.state import STATE
from tests.support.gateway_helpers import tiny_settings

LOGGER = "gateway.response_store"


def stored(response_id: str) -> Stored:
    return Stored("alice", {"id": response_id, "object": "response"}, [{"type": "message", "role": "user",
                  "content": "hi"}], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])


def api_error(call) -> APIError:
    with pytest.raises(APIError) as err:
        call()
    return err.value


def break_file(path: Path) -> None:
    """Garbage over the database and its WAL, as a bad disk or a stray writer would leave them."""
    for part in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if part.exists():
            part.write_bytes(b"garbage " * max(512, part.stat().st_size // 8))


@pytest.fixture
def locked(tmp_path):
    """A store on a file whose write lock another connection holds (BEGIN EXCLUSIVE) until the test ends."""
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(10, path, busy_timeout_ms=10)
    store.put(stored("resp_1"))
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    yield store, other
    other.close()
    store.close()


def test_a_delete_and_a_count_on_a_locked_file(locked, caplog):
    store, other = locked
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        err = api_error(lambda: store.delete("alice", "resp_1"))
        assert api_error(lambda: store.erase("alice")).status == 503
        assert len(store) == 1  # readers never wait in WAL mode
    assert (err.status, err.code, err.headers) == (503, "responses_store_busy", {"Retry-After": "1"})
    assert f"cannot delete 'resp_1' in {store.path} (database is locked)" in caplog.text
    other.execute("ROLLBACK")
    store.delete("alice", "resp_1")  # still there, as the 503 said
    assert len(store) == store.num_stored == 0


async def test_calls_queued_on_a_locked_file_each_answer_within_the_busy_timeout(tmp_path):
    """Six deletes and a put at once on a file another writer holds: each waited out the busy timeout in turn on
    the store's thread (the last answered after 7 of them); each is now answered within one, from its request."""
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(10, path, busy_timeout_ms=500)
    for n in range(6):
        store.put(stored(f"resp_{n}"))
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    started = time.monotonic()

    async def answered(call) -> tuple[object, float]:
        try:
            outcome = await call
        except APIError as err:
            outcome = (err.status, err.code)
        return outcome, time.monotonic() - started
    answers = await asyncio.gather(*(answered(store.adelete("alice", f"resp_{n}")) for n in range(6)),
                                   answered(store.aput(stored("resp_6"))))
    other.execute("ROLLBACK")
    other.close()
    assert [outcome for outcome, _ in answers] == [(503, "responses_store_busy")] * 6 + [False]
    assert max(elapsed for _, elapsed in answers) < 1.5  # (in turn: 3.5 s)
    assert len(store) == 6  # none deleted: the 503s were true
    store.close()


def test_every_call_on_a_file_broken_while_serving(tmp_path, caplog):
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(10, path)
    store.put(stored("resp_1"))
    break_file(path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):  # each a 503: the file may be mended, the client may retry
        for call in (lambda: store.get("alice", "resp_1"), lambda: store.delete("alice", "resp_1"),
                     lambda: store.erase("alice")):
            assert (api_error(call).status, api_error(call).code) == (503, "responses_store_busy")
        assert store.put(stored("resp_2")) is False
        assert len(store) == 1  # the last count
    assert f"cannot read {path}" in caplog.text and f"cannot delete 'resp_1' in {path}" in caplog.text
    assert "resp_2 not stored" in caplog.text and f"cannot count {path}" in caplog.text
    assert f"cannot erase tenant alice's in {path}" in caplog.text
    store.close()


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, tmp_path):
    db = tmp_path / "responses.sqlite3"
    client = await aiohttp_client(create_app(tiny_settings(tiny_llama_dir, responses_db=str(db))))
    client.db = db
    return client


async def respond(client, **fields):
    body = {"model": client.app[STATE].model_name, "input": "hello", "max_output_tokens": 2, **fields}
    return await client.post("/v1/responses", json=body)


async def test_a_write_waiting_on_another_gateways_lock_holds_up_no_other_request(client):
    store = client.app[RESPONSE_STORE].backend
    waiting = threading.Event()
    put = store.put

    def put_after_signal(item: Stored, warn: bool = True, deadline: float | None = None) -> bool:
        waiting.set()
        return put(item, warn, deadline)

    store.put = put_after_signal
    other = sqlite3.connect(client.db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    created = asyncio.ensure_future(respond(client))
    assert await asyncio.to_thread(waiting.wait, 60)  # the put has begun, and waits for the lock
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 200
    assert not created.done()  # the loop served both while the put waited
    other.execute("ROLLBACK")
    other.close()
    resp = await created
    assert resp.status == 200
    response_id = (await resp.json())["id"]
    assert (await client.get(f"/v1/responses/{response_id}")).status == 200  # stored once the lock went


async def test_a_broken_file_costs_503s_never_a_500_and_what_it_cannot_take_is_served_from_memory(client, caplog):
    first = await (await respond(client)).json()
    break_file(client.db)
    with caplog.at_level(logging.WARNING):
        for method, path in (("GET", f"/v1/responses/{first['id']}"), ("DELETE", f"/v1/responses/{first['id']}"),
                             ("GET", f"/v1/responses/{first['id']}/input_items")):
            resp = await client.request(method, path)  # a response the file held: not "not found", but "try again"
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "responses_store_busy"
            assert resp.headers["Retry-After"] == "1"
        continued = await respond(client, previous_response_id=first["id"])
        assert continued.status == 503 and (await continued.json())["error"]["code"] == "responses_store_busy"
        fresh = await (await respond(client)).json()  # answered, and kept in memory while the file refuses it
        assert (await client.get(f"/v1/responses/{fresh['id']}")).status == 200
        assert (await respond(client, previous_response_id=fresh["id"])).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert re.search(r"^prefixgate_responses_store_pending\{[^}]*\} 2\.0$", metrics, re.M)
    assert f"cannot read {client.db}" in caplog.text and "not stored" in caplog.text
    assert "keeping them in memory and trying again" in caplog.text


async def test_a_garbage_file_at_start_is_moved_aside_and_a_new_file_serves(aiohttp_client, tiny_llama_dir, tmp_path,
                                                                              caplog):
    db = tmp_path / "responses.sqlite3"
    db.write_bytes(b"not a database " * 1000)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        client = await aiohttp_client(create_app(tiny_settings(tiny_llama_dir, responses_db=str(db))))
    (aside,) = tmp_path.glob("responses.sqlite3.corrupt-*[0-9]Z")
    assert f"{db} is corrupt (file is not a database); moved it to {aside}" in caplog.text
    assert aside.read_bytes() == b"not a database " * 1000
    lost = await respond(client, previous_response_id="resp_from_before")
    assert lost.status == 400 and (await lost.json())["error"]["code"] == "previous_response_not_found"
    first = await (await respond(client)).json()
    assert (await respond(client, previous_response_id=first["id"])).status == 200
    assert client.app[RESPONSE_STORE].path == str(db)  # on the new file, so it outlives this process
