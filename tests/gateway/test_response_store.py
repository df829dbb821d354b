"""Stored responses in SQLite: the store's semantics (tenant isolation, LRU drop, TTL), a file that survives its
store and is shared by two, and `previous_response_id` continued by a new server after kill -9 of the first."""
from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import signal
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from gateway.errors import APIError
from gateway.response_store import IN_MEMORY, ResponseStore, Stored, open_store
from gateway.settings import GatewaySettings
from tests.support.gateway_helpers import served

DAY_S = 86400


def stored(response_id: str, tenant: str = "alice", text: str = "hi") -> Stored:
    return Stored(tenant, {"id": response_id, "object": "response", "output_text": text},
                  [{"type": "message", "role": "user", "content": text}],
                  [{"role": "user", "content": text}, {"role": "assistant", "content": "hello"}])


def assert_not_found(store: ResponseStore, tenant: str, response_id: str) -> None:
    with pytest.raises(APIError) as err:
        store.get(tenant, response_id)
    assert (err.value.status, err.value.code, err.value.param) == (404, "response_not_found", "response_id")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_put_get_and_delete():
    store = ResponseStore(10)
    store.put(stored("resp_1"))
    assert store.get("alice", "resp_1") == stored("resp_1")
    assert len(store) == 1
    store.delete("alice", "resp_1")
    assert len(store) == 0
    assert_not_found(store, "alice", "resp_1")
    with pytest.raises(APIError) as err:
        store.delete("alice", "resp_1")
    assert err.value.status == 404


def test_another_tenants_id_is_a_404_like_an_unknown_one():
    store = ResponseStore(10)
    store.put(stored("resp_a"))
    with pytest.raises(APIError) as theirs:
        store.get("bob", "resp_a")
    with pytest.raises(APIError) as unknown:
        store.get("bob", "resp_b")
    assert str(theirs.value).replace("resp_a", "X") == str(unknown.value).replace("resp_b", "X")
    assert (theirs.value.status, theirs.value.code) == (unknown.value.status, unknown.value.code) == (
        404, "response_not_found")
    with pytest.raises(APIError):
        store.delete("bob", "resp_a")
    assert store.get("alice", "resp_a").tenant == "alice"  # bob's delete took nothing


def test_the_least_recently_used_is_dropped_beyond_the_max():
    clock = Clock()
    store = ResponseStore(2, clock=clock)
    for name in ("resp_a", "resp_b"):
        store.put(stored(name))
        clock.now += 1
    store.get("alice", "resp_a")  # a is now more recent than b
    clock.now += 1
    store.put(stored("resp_c"))
    assert_not_found(store, "alice", "resp_b")
    assert [store.get("alice", n).response["id"] for n in ("resp_a", "resp_c")] == ["resp_a", "resp_c"]
    assert (len(store), store.num_dropped) == (2, 1)
    clock.now += 1
    store.put(stored("resp_d"))
    assert (len(store), store.num_dropped) == (2, 2)
    assert_not_found(store, "alice", "resp_a")
    for n in range(5):  # another tenant's traffic drops its own, never alice's
        clock.now += 1
        store.put(stored(f"resp_bob_{n}", tenant="bob"))
    assert [store.get("alice", n).response["id"] for n in ("resp_c", "resp_d")] == ["resp_c", "resp_d"]
    assert (len(store), store.num_dropped) == (4, 5)


def test_a_response_older_than_the_ttl_is_gone(tmp_path):
    clock = Clock()
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(10, path, ttl_days=1, clock=clock)
    store.put(stored("resp_old"))
    clock.now += DAY_S - 1
    assert store.get("alice", "resp_old").response["id"] == "resp_old"  # a get does not extend its life
    store.put(stored("resp_new"))
    clock.now += 2
    assert_not_found(store, "alice", "resp_old")
    assert len(store) == 1
    with pytest.raises(APIError):
        store.delete("alice", "resp_old")
    store.put(stored("resp_newer"))  # a put drops the expired rows from the file
    with sqlite3.connect(path) as db:
        assert sorted(r for (r,) in db.execute("SELECT id FROM responses")) == ["resp_new", "resp_newer"]
    db.close()
    assert store.num_dropped == 0  # expiry is not an LRU drop
    store.close()


def test_stored_responses_survive_reopening_the_file(tmp_path):
    path = tmp_path / "sub" / "responses.sqlite3"  # its folder is made
    first = ResponseStore(10, path)
    first.put(stored("resp_1", text="the first turn"))
    first.close()
    again = ResponseStore(10, path)
    assert again.get("alice", "resp_1") == stored("resp_1", text="the first turn")
    assert len(again) == 1
    again.close()


def test_two_stores_on_one_file_share_their_rows_in_wal_mode(tmp_path):
    path = tmp_path / "responses.sqlite3"
    one, two = ResponseStore(10, path), ResponseStore(10, path)
    one.put(stored("resp_1"))
    assert two.get("alice", "resp_1") == stored("resp_1")
    two.put(stored("resp_2", tenant="bob"))
    assert one.get("bob", "resp_2").tenant == "bob" and len(one) == 2
    two.delete("alice", "resp_1")
    assert_not_found(one, "alice", "resp_1")
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    db.close()
    one.close()
    two.close()


@pytest.mark.parametrize("first_call", ["get", "put"])
def test_a_file_replaced_under_the_store_is_what_the_next_call_reads(tmp_path, caplog, first_call):
    """A backup restored over the file (os.replace: another inode): a read went on reading the old one, and the
    first call to open the path again read the new file through the old one's WAL (the old rows, not its own)."""
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(10, path)
    store.put(stored("resp_old"))
    restored = ResponseStore(10, tmp_path / "backup.sqlite3")
    restored.put(stored("resp_restored"))
    restored.close()
    os.replace(tmp_path / "backup.sqlite3", path)
    with caplog.at_level(logging.WARNING, logger="gateway.response_store"):
        if first_call == "put":
            assert store.put(stored("resp_new"))
        assert store.get("alice", "resp_restored") == stored("resp_restored")
    assert f"{path} was deleted or replaced while serving; opened it again" in caplog.text
    assert_not_found(store, "alice", "resp_old")
    store.close()
    with sqlite3.connect(path) as db:  # (the old file's WAL was not moved into the new one)
        ids = sorted(db.execute("SELECT id FROM responses"))
    db.close()
    assert ids == ([("resp_new",)] if first_call == "put" else []) + [("resp_restored",)]


def test_a_file_deleted_under_the_store_is_a_new_one_at_the_next_read(tmp_path):
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(10, path)
    store.put(stored("resp_old"))
    path.unlink()
    assert_not_found(store, "alice", "resp_old")  # (was read from the deleted file)
    assert path.exists() and len(store) == 0
    store.close()


def a_real_store_file(path) -> bytes:
    """The bytes of a closed store holding 40 responses (its WAL checkpointed into it): 61 pages."""
    store = ResponseStore(100, path)
    for i in range(40):
        store.put(stored(f"resp_{i}", text="a long turn " * 100))
    store.close()
    return path.read_bytes()


def damaged(kind: str, path) -> bytes:
    """`path` made corrupt three ways: random bytes, a real store cut in half, a real store with one b-tree page
    zeroed (it opens; only `PRAGMA quick_check` finds the damage)."""
    if kind == "random bytes":
        return random.Random(44).randbytes(8192)
    whole = a_real_store_file(path)
    page = 4096
    if kind == "truncated":
        return whole[:len(whole) // 2]
    return whole[:3 * page] + bytes(page) + whole[4 * page:]


@pytest.mark.parametrize("kind, reason", [("random bytes", "file is not a database"),
                                          ("truncated", "database disk image is malformed"),
                                          ("one page zeroed", "quick_check: *** in database main ***")])
def test_a_corrupt_file_at_start_is_moved_aside_and_a_new_store_begins(tmp_path, caplog, kind, reason):
    path = tmp_path / "responses.sqlite3"
    corrupt = damaged(kind, path)
    path.write_bytes(corrupt)
    with caplog.at_level(logging.WARNING, logger="gateway.response_store"):
        store = open_store(10, str(path), ttl_days=30)
    (aside,) = tmp_path.glob("responses.sqlite3.corrupt-*[0-9]Z")  # (its -shm may be beside it)
    assert re.fullmatch(r"responses\.sqlite3\.corrupt-\d{8}T\d{6}Z", aside.name)
    assert aside.read_bytes() == corrupt  # kept as it was, for whoever wants to recover from it
    assert (store.path, len(store)) == (str(path), 0)
    assert f"{path} is corrupt ({reason}" in caplog.text
    assert f"moved it to {aside} and started a new, empty store at {path}" in caplog.text
    store.put(stored("resp_new"))
    assert store.get("alice", "resp_new") == stored("resp_new")
    store.close()
    with sqlite3.connect(path) as db:  # the new file is a sound database, in WAL mode
        assert db.execute("PRAGMA quick_check").fetchall() == [("ok",)]
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    db.close()


def test_gateways_starting_together_on_a_corrupt_file_share_the_new_one(tmp_path):
    """Four gateways open one corrupt file at once: one moves it aside, the others open the new file (each moved it
    on its own before: the later ones' renames failed and they kept their responses in memory, 9 starts in 10)."""
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(damaged("random bytes", path))
    start = threading.Barrier(4)

    def opened(_) -> ResponseStore:
        start.wait()
        return open_store(10, str(path), ttl_days=30)

    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(opened, range(4)))
    assert [store.path for store in stores] == [str(path)] * 4
    assert len(list(tmp_path.glob("responses.sqlite3.corrupt-*[0-9]Z"))) == 1
    stores[0].put(stored("resp_shared"))
    assert all(store.get("alice", "resp_shared") == stored("resp_shared") for store in stores)
    for store in stores:
        store.close()


def test_a_corrupt_files_wal_goes_aside_with_it(tmp_path):
    """A WAL left at the path would be replayed into the new file: it moves with the file it belongs to."""
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(b"this is not an SQLite database, " * 64)
    wal = tmp_path / "responses.sqlite3-wal"
    wal.write_bytes(b"the corrupt file's WAL")
    store = open_store(10, str(path), ttl_days=30)
    (aside,) = tmp_path.glob("responses.sqlite3.corrupt-*[0-9]Z")
    assert (tmp_path / f"{aside.name}-wal").read_bytes() == b"the corrupt file's WAL"
    assert len(store) == 0
    store.close()


def refuse(*_) -> None:
    raise PermissionError("read-only folder")


def test_a_corrupt_file_that_cannot_be_moved_costs_a_store_in_memory(tmp_path, caplog, monkeypatch):
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(b"this is not an SQLite database, " * 64)
    monkeypatch.setattr(Path, "rename", refuse)  # (a read-only folder would do, but not for root, as in CI)
    with caplog.at_level(logging.WARNING, logger="gateway.response_store"):
        store = open_store(10, str(path), ttl_days=30)
    assert store.path == IN_MEMORY
    assert f"cannot open {path} (read-only folder); keeping them in memory" in caplog.text
    assert path.read_bytes() == b"this is not an SQLite database, " * 64
    store.put(stored("resp_1"))
    assert store.get("alice", "resp_1").response["id"] == "resp_1"
    store.close()


def test_a_file_locked_by_another_writer_refuses_a_put_and_a_get_neither_waits_nor_loses_its_use(tmp_path, caplog):
    path = tmp_path / "responses.sqlite3"
    clock = Clock()
    store = ResponseStore(2, path, clock=clock, busy_timeout_ms=600_000)  # a write waits for the lock ...
    another = ResponseStore(2, path, clock=clock, busy_timeout_ms=10)  # ... or gives up soon
    store.put(stored("resp_1"))
    clock.now += 1
    store.put(stored("resp_2"))
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another gateway holding the write lock
    clock.now += 1
    read = ThreadPoolExecutor(1).submit(store.get, "alice", "resp_1")
    assert read.result(timeout=60).response["id"] == "resp_1"  # ... a read does not (WAL), nor does its mark of use
    with caplog.at_level(logging.WARNING, logger="gateway.response_store"):
        assert another.put(stored("resp_3")) is False  # said, for gateway/response_store_pending.py to try again
    assert "resp_3 not stored" in caplog.text
    other.execute("ROLLBACK")
    other.close()
    clock.now += 1
    assert store.put(stored("resp_3")) is True
    # resp_1's use, at a time the file was locked, was written with this put: resp_2 is the least recently used
    assert_not_found(store, "alice", "resp_2")
    assert store.get("alice", "resp_1").response["id"] == "resp_1"
    store.close()
    another.close()


def test_the_settings_default_to_a_file_and_thirty_days():
    assert (GatewaySettings().responses_db, GatewaySettings().responses_ttl_days) == (None, 30.0)
    with pytest.raises(ValueError, match="responses_ttl_days"):
        GatewaySettings(responses_ttl_days=0)


async def _engine_gone(pid: int) -> None:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.05)


@pytest.mark.server
async def test_previous_response_id_continues_after_kill_9_of_the_api_process(tiny_llama_dir, tmp_path):
    db, disk = tmp_path / "responses.sqlite3", tmp_path / "kv"
    args = ("--model", str(tiny_llama_dir), "--num-kv-blocks", "512", "--kv-disk-dir", str(disk),
            "--responses-db", str(db))
    first_turn = "Remember the word tangerine. " * 12
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        with served(*args) as server:
            base = server.base_url
            engine_pid = (await (await session.get(base.removesuffix("/v1") + "/health")).json())["engine_pid"]
            model = (await (await session.get(f"{base}/models")).json())["data"][0]["id"]
            resp = await session.post(f"{base}/responses", json={"model": model, "input": first_turn,
                                                                 "max_output_tokens": 4, "temperature": 0})
            assert resp.status == 200, await resp.text()
            first = await resp.json()
            deadline = time.monotonic() + 30  # the idle engine writes its cached blocks behind to the disk tier
            while not list(disk.rglob("*.kv")):
                assert time.monotonic() < deadline, "no block reached the disk tier"
                await asyncio.sleep(0.05)
            os.kill(server.pid, signal.SIGKILL)
            assert await asyncio.to_thread(server.wait, 10) == -signal.SIGKILL
            await asyncio.wait_for(_engine_gone(engine_pid), 10)  # the engine went with it
        with served(*args) as server:
            base = server.base_url
            items = await (await session.get(f"{base}/responses/{first['id']}/input_items")).json()
            assert [item["content"] for item in items["data"]] == [[{"type": "input_text", "text": first_turn}]]
            resp = await session.post(f"{base}/responses", json={
                "model": model, "input": "Which word?", "previous_response_id": first["id"],
                "max_output_tokens": 4, "temperature": 0})
            assert resp.status == 200, await resp.text()
            second = await resp.json()
    assert second["previous_response_id"] == first["id"]
    # the first turn is in the prompt (more tokens than it alone), and read back warm from the disk tier
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_the_store_path_may_come_from_the_environment(tmp_path, monkeypatch):
    """$PREFIXGATE_RESPONSES_DB (a Kubernetes Secret's URL, kept off the command line) when no --responses-db is
    given; a flag wins over it."""
    from gateway.response_store import RESPONSES_DB_ENV

    monkeypatch.setenv(RESPONSES_DB_ENV, str(tmp_path / "from-env.sqlite3"))
    store = open_store(10, None, ttl_days=30)
    assert store.path == str(tmp_path / "from-env.sqlite3")
    store.close()
    store = open_store(10, str(tmp_path / "from-flag.sqlite3"), ttl_days=30)
    assert store.path == str(tmp_path / "from-flag.sqlite3")
    store.close()
