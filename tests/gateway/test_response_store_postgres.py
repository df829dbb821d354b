"""Stored responses on a real PostgreSQL server (tests/support/postgres.py): the SQLite store's semantics
(tenant isolation, LRU drop, TTL), a server that cannot be reached (warnings, 404s, a 503 delete, never an
error), and two gateways sharing it: `previous_response_id` created on one, continued on the other."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest

from gateway.errors import APIError
from gateway.response_store import Stored, open_store
from gateway import response_store_postgres
from gateway.response_store_postgres import PostgresResponseStore
from tests.support.gateway_helpers import served
from tests.support.postgres import postgres_server

DAY_S = 86400


@pytest.fixture(scope="module")
def pg_url():
    with postgres_server() as url:
        yield url


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def clock():
    return Clock()


@pytest.fixture
async def store(pg_url, clock):
    maker = PostgresResponseStore(pg_url, 2)  # the table made and emptied before the store under test counts it
    async with (await maker._connect()).acquire() as db:
        await db.execute("TRUNCATE prefixgate_responses")
    await maker.aclose()
    store = PostgresResponseStore(pg_url, 2, ttl_days=1, clock=clock)
    yield store
    await store.aclose()


def test_a_missing_postgres_fails_under_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setattr("tests.support.postgres._bindir", lambda: None)
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="PostgreSQL is not installed"), postgres_server():
        pass
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception), postgres_server():
        pass


def test_a_postgres_url_without_asyncpg_is_a_configuration_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # the postgres extra not installed
    with pytest.raises(ValueError, match=r"pip install 'prefixgate\[postgres\]'"):
        open_store(10, "postgresql://localhost/prefixgate", ttl_days=30)


def stored(response_id: str, tenant: str = "alice") -> Stored:
    return Stored(tenant, {"id": response_id, "object": "response"}, [{"type": "message", "role": "user",
                  "content": "hi"}], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])


async def status_of(call) -> tuple[int, str]:
    with pytest.raises(APIError) as err:
        await call
    return err.value.status, err.value.code


@pytest.mark.server  # a real database server
async def test_the_sqlite_stores_semantics_on_postgres(store, clock):
    await store.aput(stored("resp_a"))
    assert await store.aget("alice", "resp_a") == stored("resp_a")
    assert await status_of(store.aget("bob", "resp_a")) == (404, "response_not_found")  # another tenant's
    assert await status_of(store.adelete("bob", "resp_a")) == (404, "response_not_found")
    clock.now += 1
    await store.aput(stored("resp_b"))
    clock.now += 1
    await store.aget("alice", "resp_a")  # a is now more recent than b
    clock.now += 1
    await store.aput(stored("resp_c"))
    assert await status_of(store.aget("alice", "resp_b")) == (404, "response_not_found")  # dropped beyond 2
    assert (store.num_stored, store.num_dropped) == (2, 1)
    await store.adelete("alice", "resp_c")
    assert await status_of(store.adelete("alice", "resp_c")) == (404, "response_not_found")
    await store.aput(stored("resp_bob", tenant="bob"))
    assert (await store.aerase("alice"), store.num_stored) == (1, 1)  # DELETE /v1/cache: alice's resp_a
    assert await status_of(store.aget("alice", "resp_a")) == (404, "response_not_found")
    assert (await store.aget("bob", "resp_bob")).tenant == "bob"
    clock.now += DAY_S + 1  # resp_bob was put more than a day ago
    assert await status_of(store.aget("bob", "resp_bob")) == (404, "response_not_found")


async def test_a_server_that_cannot_be_reached_costs_warnings_and_503s(tmp_path, caplog):
    store = open_store(10, f"postgresql://postgres@/postgres?host={tmp_path}", ttl_days=30)  # no server there
    with caplog.at_level(logging.WARNING, logger="gateway.response_store_postgres"):
        assert await store.aput(stored("resp_1")) is False  # (gateway/response_store_pending.py tries it again)
        assert await status_of(store.aget("alice", "resp_1")) == (503, "responses_store_busy")
        assert await status_of(store.adelete("alice", "resp_1")) == (503, "responses_store_busy")
        assert await status_of(store.aerase("alice")) == (503, "responses_store_busy")
    assert "resp_1 not stored in postgresql://" in caplog.text and "cannot read postgresql://" in caplog.text
    await store.aclose()


async def test_calls_rest_after_a_failed_connect_instead_of_storming_the_server(tmp_path, monkeypatch):
    monkeypatch.setattr(response_store_postgres, "REST_S", 0.2)
    store = PostgresResponseStore(f"postgresql://postgres@/postgres?host={tmp_path}", 10)  # no server there
    connects = []
    real_connect = store._connect

    async def counted_connect():
        connects.append(1)
        return await real_connect()
    monkeypatch.setattr(store, "_connect", counted_connect)
    assert await store.aput(stored("resp_1"), warn=False) is False
    assert len(connects) == 1
    for _ in range(20):  # a burst of requests in the rest: each answered at once, none connects
        assert await status_of(store.aget("alice", "resp_1")) == (503, "responses_store_busy")
    assert await store.aput(stored("resp_2"), warn=False) is False
    assert len(connects) == 1
    await asyncio.sleep(0.3)  # past the rest, the next call tries the server again
    assert await status_of(store.aget("alice", "resp_1")) == (503, "responses_store_busy")
    assert len(connects) == 2
    await store.aclose()


@pytest.mark.server  # a real database server
async def test_two_gateways_share_their_stored_responses(tiny_llama_dir, pg_url):
    args = ("--model", str(tiny_llama_dir), "--num-kv-blocks", "128", "--responses-db", pg_url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        with served(*args) as one, served(*args) as two:
            model = (await (await session.get(f"{one.base_url}/models")).json())["data"][0]["id"]
            resp = await session.post(f"{one.base_url}/responses", json={
                "model": model, "input": "Remember the word tangerine.", "max_output_tokens": 4, "temperature": 0})
            assert resp.status == 200, await resp.text()
            first = await resp.json()
            again = await (await session.get(f"{two.base_url}/responses/{first['id']}")).json()
            assert again == first
            resp = await session.post(f"{two.base_url}/responses", json={
                "model": model, "input": "Which word?", "previous_response_id": first["id"], "max_output_tokens": 4,
                "temperature": 0})
            assert resp.status == 200, await resp.text()
            second = await resp.json()
            gone = await session.delete(f"{one.base_url}/responses/{second['id']}")  # made on two, erased on one
            assert gone.status == 200
            assert (await session.get(f"{two.base_url}/responses/{second['id']}")).status == 404
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]  # the first turn is in its prompt
    import asyncpg  # imported here, not when the file is collected: only this test talks to the server itself

    db = await asyncpg.connect(pg_url)  # the rows are the server's, not some file's
    try:
        assert await db.fetchval("SELECT tenant FROM prefixgate_responses WHERE id = $1", first["id"]) == "anonymous"
    finally:
        await db.close()


@contextlib.contextmanager
def frozen(url: str):
    """The server's processes stopped (SIGSTOP), as a hung host or a paused VM leaves them: connections stay
    open and nothing answers. Continued afterwards."""
    data = Path(parse_qs(urlsplit(url).query)["host"][0]) / "data"
    postmaster = int((data / "postmaster.pid").read_text().split()[0])
    pids = [postmaster] + [int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")
                           if _parent(stat) == postmaster]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _parent(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):  # (a process that ended meanwhile)
        return None


@pytest.mark.server  # a real database server
async def test_a_frozen_server_costs_each_call_its_timeout_and_never_hangs_the_gateway(pg_url, monkeypatch, caplog):
    monkeypatch.setattr(response_store_postgres, "CALL_TIMEOUT_S", 0.5)
    store = PostgresResponseStore(pg_url, 10)
    assert await store.aput(stored("resp_frozen_1")) is True
    # the server ends this gateway's statements past the bound too: a session given up on holds no connection
    assert await store._call(lambda db: db.fetchval("SHOW lock_timeout")) == "500ms"
    with frozen(pg_url), caplog.at_level(logging.WARNING, logger="gateway.response_store_postgres"):
        # each call gives up within its timeout (bounded here by 10 s: before, a cancelled query waited for a
        # ROLLBACK the frozen server never sends), and so does closing the pool
        assert await asyncio.wait_for(store.aput(stored("resp_frozen_2")), 10) is False
        assert await asyncio.wait_for(status_of(store.aget("alice", "resp_frozen_1")), 10) == \
            (503, "responses_store_busy")
        assert await asyncio.wait_for(status_of(store.adelete("alice", "resp_frozen_1")), 10) == \
            (503, "responses_store_busy")
        await asyncio.wait_for(store.aclose(), 10)
    assert "resp_frozen_2 not stored" in caplog.text and "TimeoutError" in caplog.text


@pytest.mark.server  # a real database server
async def test_gateways_putting_at_once_keep_a_tenant_within_its_max(pg_url):
    """400 puts of one tenant through two stores at once: without the tenant's lock, concurrent transactions each
    trimmed their own view (5 rows of 3 kept) or deadlocked on each other's drops (a put refused)."""
    first, second = PostgresResponseStore(pg_url, 3), PostgresResponseStore(pg_url, 3)
    await first.aerase("carol")
    puts = [store.aput(stored(f"resp_carol_{n}", tenant="carol")) for n in range(200) for store in (first, second)
            if n % 2 == (store is second)]
    assert all(await asyncio.gather(*puts))
    async with (await first._connect()).acquire() as db:
        assert await db.fetchval("SELECT COUNT(*) FROM prefixgate_responses WHERE tenant = 'carol'") == 3
    await first.aclose()
    await second.aclose()


@pytest.mark.server
async def test_gateways_creating_the_table_at_once_all_store(pg_url):
    """Six gateways' first calls on a database without the table: CREATE ... IF NOT EXISTS run at once failed on
    each other's catalog rows (16 first puts of 40 refused in a review's runs); they now take turns."""
    first = PostgresResponseStore(pg_url, 10)
    async with (await first._connect()).acquire() as db:
        await db.execute("DROP TABLE prefixgate_responses")
    await first.aclose()
    stores = [PostgresResponseStore(pg_url, 10) for _ in range(6)]
    assert all(await asyncio.gather(*(s.aput(stored(f"resp_first_{i}", "dave")) for i, s in enumerate(stores))))
    assert all([await s.aget("dave", f"resp_first_{i}") for i, s in enumerate(stores)])
    for s in stores:
        await s.aclose()


@pytest.mark.server
async def test_a_gateway_whose_clock_is_behind_keeps_what_it_was_told_is_stored(pg_url):
    """Two gateways 30 s apart, a tenant at its limit of 3: the put of the one behind was dropped at once as the
    oldest (a 200 for a response then a 404); the row just put is now kept, and a read on that gateway never moves
    a row's use back in time."""
    ahead, behind = Clock(), Clock()
    behind.now -= 30
    fast, slow = PostgresResponseStore(pg_url, 3, clock=ahead), PostgresResponseStore(pg_url, 3, clock=behind)
    await fast.aerase("erin")
    for n in range(3):
        ahead.now += 1
        assert await fast.aput(stored(f"resp_erin_{n}", "erin"))
    assert await slow.aput(stored("resp_erin_late", "erin"))
    assert (await fast.aget("erin", "resp_erin_late")).tenant == "erin"
    await slow.aget("erin", "resp_erin_2")  # read where the clock is behind
    async with (await fast._connect()).acquire() as db:
        used = await db.fetchval("SELECT used_at FROM prefixgate_responses WHERE id = 'resp_erin_2'")
    assert used == ahead.now  # (not pulled back to the slow gateway's time)
    await fast.aclose()
    await slow.aclose()


@pytest.mark.server
async def test_a_put_deletes_a_bounded_share_of_the_expired_rows(pg_url, monkeypatch):
    """A backlog of expired rows (a TTL lowered over millions) went in one delete inside each put's time bound:
    past it the put rolled back, and so did every retry. Each put now deletes at most EXPIRED_PER_PUT of them."""
    monkeypatch.setattr(response_store_postgres, "EXPIRED_PER_PUT", 2)
    clock = Clock()
    store = PostgresResponseStore(pg_url, 100, ttl_days=1, clock=clock)
    await store.aerase("fred")
    for n in range(5):
        assert await store.aput(stored(f"resp_fred_old_{n}", "fred"))
    clock.now += DAY_S + 1  # all five expired
    async with (await store._connect()).acquire() as db:
        async def expired() -> int:  # (every tenant's: earlier tests' rows are expired at this clock too)
            return await db.fetchval("SELECT COUNT(*) FROM prefixgate_responses WHERE created_at < $1",
                                     clock.now - DAY_S)
        before = await expired()
        for n in range(3):
            assert await store.aput(stored(f"resp_fred_new_{n}", "fred"))
            assert await expired() == max(0, before - 2 * (n + 1))
    await store.aclose()


@pytest.mark.server
@pytest.mark.parametrize("role, grants", [
    ("reader", "GRANT SELECT ON prefixgate_responses TO reader"),
    ("standby_like", "GRANT ALL ON prefixgate_responses TO standby_like; "
                     "ALTER ROLE standby_like SET default_transaction_read_only = on")])
async def test_a_read_only_role_or_session_still_reads(pg_url, caplog, role, grants):
    """A SELECT-only role, or sessions that are read-only (as on a hot standby): every read was a 503, the table's
    creation and each read's mark of use refused. Reads now answer; the mark is skipped, said once."""
    writer = PostgresResponseStore(pg_url, 10)
    assert await writer.aput(stored("resp_ro", "ivan"))
    async with (await writer._connect()).acquire() as db:
        await db.execute(f"CREATE ROLE {role} LOGIN; {grants}")
    reader = PostgresResponseStore(pg_url.replace("postgres@", f"{role}@"), 10)
    with caplog.at_level(logging.WARNING, logger="gateway.response_store_postgres"):
        for _ in range(3):
            assert await reader.aget("ivan", "resp_ro") == stored("resp_ro", "ivan")
        assert await status_of(reader.aget("ivan", "resp_unknown")) == (404, "response_not_found")
        assert await reader.aput(stored("resp_ro_2", "ivan"), warn=False) is False  # (kept in memory, as any)
    assert caplog.text.count("takes no reads' marks of use (read-only)") == 1
    assert "may not create or change the table" in caplog.text
    await reader.aclose()
    await writer.aclose()


@pytest.mark.server
async def test_a_mark_of_use_that_fails_leaves_the_read_answered(pg_url, caplog):
    """The update of used_at failing where the role may write (a trigger refuses it here) made the read a 503; it
    is now a statement of its own, its failure said once, and the connection serves the next read."""
    store = PostgresResponseStore(pg_url, 10)
    assert await store.aput(stored("resp_marked", "judy"))
    async with (await store._connect()).acquire() as db:
        await db.execute("CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                         "RAISE EXCEPTION 'no update'; END $$; CREATE TRIGGER refuse BEFORE UPDATE ON "
                         "prefixgate_responses FOR EACH ROW EXECUTE FUNCTION refuse()")
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.response_store_postgres"):
            for _ in range(3):
                assert (await store.aget("judy", "resp_marked")).tenant == "judy"
        assert caplog.text.count("takes no reads' marks of use (RaiseError: no update)") == 1
    finally:
        async with (await store._connect()).acquire() as db:
            await db.execute("DROP TRIGGER refuse ON prefixgate_responses; DROP FUNCTION refuse()")
        await store.aclose()


def rows_read(plan: dict) -> int:
    """Rows of the table a plan's scans read (EXPLAIN ANALYZE): those they returned and those filtered out."""
    own = 0
    if plan.get("Relation Name") == "prefixgate_responses" and "Scan" in plan["Node Type"]:
        own = (plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)) * plan["Actual Loops"]
    return own + sum(rows_read(child) for child in plan.get("Plans", []))


@pytest.mark.server
async def test_a_put_reads_its_tenants_rows_not_the_whole_table(pg_url, monkeypatch):
    """Each put counted the whole table (for the stored gauge): a cost that grew with the table, inside the put's
    time bound. A put's statements now read a few rows of 5,000, and the cap still holds with the put kept."""
    clock = Clock()
    store = PostgresResponseStore(pg_url, 3, ttl_days=1, clock=clock)
    async with (await store._connect()).acquire() as db:
        await db.execute("TRUNCATE prefixgate_responses")
        await db.execute("INSERT INTO prefixgate_responses SELECT 'resp_other_' || n, 'tenant_' || n % 100, '{}', "
                         "'[]', '[]', $1, $1 FROM generate_series(1, 5000) AS n", clock.now)
        await db.execute("ANALYZE prefixgate_responses")
    for n in range(4):
        clock.now += 1
        assert await store.aput(stored(f"resp_kate_{n}", "kate"))
    queries = []
    real_call = store._call

    async def traced(work):
        async def logged(db):
            with db.query_logger(queries.append):
                return await work(db)
        return await real_call(logged)
    monkeypatch.setattr(store, "_call", traced)
    clock.now -= 30  # a gateway whose clock is behind: its put is kept all the same
    assert await store.aput(stored("resp_kate_late", "kate"))
    await asyncio.sleep(0)  # (query loggers are called soon after, not at once)
    async with (await store._connect()).acquire() as db:
        kept = {row["id"] for row in await db.fetch("SELECT id FROM prefixgate_responses WHERE tenant = 'kate'")}
        read = 0
        for query in queries:
            if query.query.startswith(("SELECT", "INSERT", "DELETE", "UPDATE")):
                explained = db.transaction()
                await explained.start()
                (plan,) = json.loads(await db.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {query.query}",
                                                       *query.args))
                await explained.rollback()
                read += rows_read(plan["Plan"])
    assert kept == {"resp_kate_late", "resp_kate_3", "resp_kate_2"}
    assert 0 < read < 50
    await store.aclose()


@pytest.mark.server
async def test_the_stored_gauge_counts_other_gateways_rows_again_now_and_then(pg_url, monkeypatch):
    """A put keeps the gauge from its own changes; at most every RECOUNT_S one counts the table again in the
    background, so rows another gateway put show up."""
    maker = PostgresResponseStore(pg_url, 10)
    async with (await maker._connect()).acquire() as db:
        await db.execute("TRUNCATE prefixgate_responses")
    await maker.aclose()
    mine, theirs = PostgresResponseStore(pg_url, 10), PostgresResponseStore(pg_url, 10)
    assert await mine.aput(stored("resp_mine_0", "liam"))
    for n in range(2):
        assert await theirs.aput(stored(f"resp_theirs_{n}", "mia"))
    assert await mine.aput(stored("resp_mine_1", "liam"))
    assert mine.num_stored == 2  # (counted at its first connection, its own puts since)
    monkeypatch.setattr(response_store_postgres, "RECOUNT_S", 0.0)
    mine._recount_at = 0.0
    assert await mine.aput(stored("resp_mine_2", "liam"))
    await asyncio.gather(*mine._cleaning)
    assert (mine.num_stored, theirs.num_stored) == (5, 3)  # (theirs counted resp_mine_0 at its first connection)
    await mine.aclose()
    await theirs.aclose()
