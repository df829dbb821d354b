"""Stored responses on a PostgreSQL server that several gateways share (`--responses-db postgresql://...`), for
deployments of more than one host: any gateway continues any `previous_response_id` of the tenant. Postgres and
not Redis because a multi-gateway deployment of an OpenAI-compatible proxy already runs one (LiteLLM keeps its
keys, spend and logs there), and a stored conversation is a row to keep for 30 days, not a cache entry: durable
commits, one transaction for a put with its LRU drop (its expiry right after), an index on the order of use.

The same semantics as the SQLite store (gateway/response_store.py): a row per response with its conversation,
none older than `ttl_days`, a tenant's least recently used dropped beyond `max_responses`, another tenant's id a
404. The pool connects on first use, so a server that is down costs warnings, never a failed start. Each call
gives up after CALL_TIMEOUT_S (a locked table, a frozen server: one request waits that long, never the gateway):
a put that fails says so (gateway/response_store_pending.py keeps it and tries again); a read, a delete or an
erasure that fails is a 503 `responses_store_busy` with Retry-After. A server or role that may only read (a hot
standby, a SELECT-only role) still serves reads: a read's mark of use is best effort. Needs the `postgres` extra
(asyncpg).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from gateway.response_store import Stored, not_found, unavailable

log = logging.getLogger(__name__)

SCHEMES = ("postgresql://", "postgres://")
CONNECT_TIMEOUT_S = 5
CALL_TIMEOUT_S = 5  # a call's whole time, a first connection included
REST_S = 1.0  # after a call that could not connect or timed out, calls fail at once this long (no connection storm)
# expired rows a put deletes at most: a backlog (a TTL lowered over millions of rows) goes over many puts, where one
# delete of all of it could outlast CALL_TIMEOUT_S, roll back, and do so again at every retry, no put ever written
EXPIRED_PER_PUT = 1000
# the stored gauge: kept from this gateway's own changes, and counted again (other gateways' rows too) at most this
# often, in the background: a count at every put grew with the table, inside the put's time bound
RECOUNT_S = 60.0
SCHEMA_LOCK = 0x7072_6667  # the advisory lock gateways creating the table at once take turns on ("prfg")
T = TypeVar("T")
SCHEMA = """
CREATE TABLE IF NOT EXISTS prefixgate_responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    messages TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    used_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS prefixgate_responses_tenant_used_at ON prefixgate_responses (tenant, used_at);
CREATE INDEX IF NOT EXISTS prefixgate_responses_created_at ON prefixgate_responses (created_at);
DROP INDEX IF EXISTS prefixgate_responses_used_at;
"""


def is_postgres_url(path: str | None) -> bool:
    return path is not None and path.startswith(SCHEMES)


class PostgresResponseStore:
    """The gateway's side of the SQLite store (aput / aget / adelete / num_stored / num_dropped / aclose) on a
    shared server."""

    def __init__(self, url: str, max_responses: int, ttl_days: float = 30,
                 clock: Callable[[], float] = time.time) -> None:
        try:
            import asyncpg  # the postgres extra; checked here, at start, not at the first request
        except ImportError:
            raise ValueError("--responses-db postgresql://... needs asyncpg: pip install 'prefixgate[postgres]'") \
                from None
        self._asyncpg = asyncpg
        # what a call that cannot complete raises: the server's errors, a connection lost or cut mid-call (asyncpg's
        # interface errors), the network's, and the call's timeout
        self._failures = (OSError, asyncio.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError,
                          asyncpg.InternalClientError)
        self.url = url
        self.path = _without_password(url)  # what warnings name
        self.max_responses = max_responses
        self.ttl_s = ttl_days * 86400
        self.num_stored = 0  # as of the last call that counted
        self.num_dropped = 0  # dropped by this gateway to stay within max_responses
        self._clock = clock
        self._pool = None
        self._opening: asyncio.Lock | None = None
        self._cleaning: set[asyncio.Task] = set()  # calls given up on, ending in the background, and recounts
        self._resting_until = 0.0  # monotonic time: calls fail at once until then (the database was unreachable)
        self._recount_at = 0.0  # monotonic time: the next put counts the table again in the background
        self._marks_refused = False  # a read's mark of use was refused (a read-only server or role): said once

    async def aput(self, stored: Stored, warn: bool = True) -> bool:
        """True once the server holds it; False when it cannot be written now (with a warning, if `warn`)."""
        now = self._clock()
        row = (stored.response["id"], stored.tenant, json.dumps(stored.response), json.dumps(stored.input_items),
               json.dumps(stored.messages), now, now)

        async def put(db) -> tuple[bool, int, int]:
            async with db.transaction():
                # one tenant's puts in turn, whichever gateway makes them: each drop then sees the rows before it
                # (two concurrent transactions would each keep max_responses of their own view)
                await db.execute("SELECT pg_advisory_xact_lock(hashtext($1))", stored.tenant)
                # (xmax is 0 in a row version that an insert made, not an update: a put again of one id, say a
                # retry of a put that timed out but was committed, adds no row)
                inserted = await db.fetchval(
                    "INSERT INTO prefixgate_responses VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (id) DO UPDATE "
                    "SET tenant = $2, response = $3, input_items = $4, messages = $5, created_at = $6, used_at = $7 "
                    "RETURNING xmax = 0", *row)
                # the row just put is kept, whatever the order says: gateways' clocks differ, and one seconds
                # behind the others saw the response it had just been told was stored dropped as the oldest
                dropped = await db.execute(
                    "DELETE FROM prefixgate_responses WHERE id IN (SELECT id FROM prefixgate_responses "
                    "WHERE tenant = $1 AND id <> $3 ORDER BY used_at DESC, id DESC OFFSET $2)", stored.tenant,
                    self.max_responses - 1, row[0])
            # every tenant's expired rows, after the put's own transaction (which touches its tenant's rows alone)
            # and skipping rows anyone holds, so it never waits: inside it, a put deleting another tenant's
            # expired rows and that tenant's put dropping its own deadlocked
            expired = await db.execute(
                "DELETE FROM prefixgate_responses WHERE id IN (SELECT id FROM prefixgate_responses WHERE created_at < "
                "$1 LIMIT $2 FOR UPDATE SKIP LOCKED)", now - self.ttl_s, EXPIRED_PER_PUT)
            return inserted, _rows(dropped), _rows(expired)
        try:
            inserted, dropped, expired = await self._call(put)
        except self._failures as exc:
            if warn:
                log.warning("stored responses: %s not stored in %s (%s)", row[0], self.path, _named(exc))
            return False
        self.num_dropped += dropped
        self.num_stored = max(0, self.num_stored + inserted - dropped - expired)
        if time.monotonic() >= self._recount_at:
            self._recount_at = time.monotonic() + RECOUNT_S
            recount = asyncio.ensure_future(self._recount())
            self._cleaning.add(recount)
            recount.add_done_callback(self._cleaned)
        return True

    async def _recount(self) -> None:
        try:
            self.num_stored = await self._call(lambda db: db.fetchval("SELECT COUNT(*) FROM prefixgate_responses"))
        except self._failures as exc:  # (the gauge keeps its own count until the next try)
            log.debug("stored responses: cannot count %s (%s)", self.path, _named(exc))

    async def aget(self, tenant: str, response_id: str) -> Stored:
        now = self._clock()

        async def read(db):
            row = await db.fetchrow(
                "SELECT response, input_items, messages, current_setting('transaction_read_only') = 'off' AND "
                "has_table_privilege('prefixgate_responses', 'UPDATE') FROM prefixgate_responses WHERE id = $1 AND "
                "tenant = $2 AND created_at >= $3", response_id, tenant, now - self.ttl_s)
            if row is not None:
                await self._mark_used(db, response_id, now, writable=row[3])
            return row
        try:
            row = await self._call(read)
        except self._failures as exc:
            log.warning("stored responses: cannot read %s (%s) for %r", self.path, _named(exc), response_id)
            raise unavailable("response_id") from None
        if row is None:
            raise not_found(response_id)
        return Stored(tenant, *map(json.loads, row[:3]))

    async def _mark_used(self, db, response_id: str, now: float, writable: bool) -> None:
        """Best effort, in a statement of its own (no transaction left open when it fails): a standby, or a role
        or session that is read-only, still serves reads, its order of use then counting puts alone."""
        try:
            if writable:  # (else the update would fail, and the server log each failure)
                # (a gateway whose clock is behind never moves a use back)
                await db.execute("UPDATE prefixgate_responses SET used_at = GREATEST(used_at, $1) WHERE id = $2",
                                 now, response_id)
                return
            reason = "read-only"
        except self._asyncpg.PostgresError as exc:
            reason = _named(exc)
        if not self._marks_refused:
            self._marks_refused = True
            log.warning("stored responses: %s takes no reads' marks of use (%s); reads go on, and the least "
                        "recently used are dropped by their last put", self.path, reason)

    async def adelete(self, tenant: str, response_id: str) -> None:
        try:
            status = await self._call(lambda db: db.execute(
                "DELETE FROM prefixgate_responses WHERE id = $1 AND tenant = $2 AND created_at >= $3",
                response_id, tenant, self._clock() - self.ttl_s))
        except self._failures as exc:
            log.warning("stored responses: cannot delete %r in %s (%s)", response_id, self.path, _named(exc))
            raise unavailable("response_id") from None
        if status == "DELETE 0":
            raise not_found(response_id)
        self.num_stored = max(0, self.num_stored - 1)

    async def aerase(self, tenant: str) -> int:
        """Deletes every stored response of `tenant` (DELETE /v1/cache); 503 when the server cannot be reached."""
        try:
            status = await self._call(lambda db: db.execute(
                "DELETE FROM prefixgate_responses WHERE tenant = $1", tenant))
        except self._failures as exc:
            log.warning("stored responses: cannot erase tenant %s's in %s (%s)", tenant, self.path, _named(exc))
            raise unavailable() from None
        erased = _rows(status)
        self.num_stored = max(0, self.num_stored - erased)
        return erased

    async def aclose(self) -> None:
        if self._pool is None:
            return
        try:
            await asyncio.wait_for(self._pool.close(), CALL_TIMEOUT_S)
        except asyncio.TimeoutError:  # a server that answers nothing: its connections are cut
            self._pool.terminate()

    async def _call(self, work: Callable[[Any], Awaitable[T]]) -> T:
        """`work(db)` on a pooled connection, in CALL_TIMEOUT_S at most, the first connection included. Past it the
        connection is terminated and the call raises TimeoutError: a cancelled query would wait for a ROLLBACK or a
        cancel request that a frozen server never answers, so the call's own clean-up goes on in the background."""
        if time.monotonic() < self._resting_until:
            raise ConnectionError("the database could not be reached a moment ago")
        held = []

        async def run() -> T:
            async with (await self._connect()).acquire(timeout=CALL_TIMEOUT_S) as db:
                held.append(db)
                return await work(db)
        task = asyncio.ensure_future(run())
        try:
            done, _ = await asyncio.wait({task}, timeout=CALL_TIMEOUT_S)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if done:
            try:
                return task.result()
            except (OSError, asyncio.TimeoutError, self._asyncpg.TooManyConnectionsError,
                    self._asyncpg.CannotConnectNowError):
                self._resting_until = time.monotonic() + REST_S
                raise
        for db in held:
            db.terminate()
        task.cancel()
        self._resting_until = time.monotonic() + REST_S
        self._cleaning.add(task)
        task.add_done_callback(self._cleaned)
        raise asyncio.TimeoutError(f"no answer in {CALL_TIMEOUT_S} s")

    def _cleaned(self, task: asyncio.Task) -> None:
        self._cleaning.discard(task)
        if not task.cancelled() and task.exception() is not None:  # (retrieved: the call already failed)
            log.debug("stored responses: a call given up on ended with %s", _named(task.exception()))

    async def _connect(self):
        """The pool, made (with the table) on first use; one that fails is tried again by the next call."""
        if self._pool is not None:  # every call after the first: no lock to take
            return self._pool
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._pool is None:
                # the server ends our statements and idle transactions itself past the call's bound: a session this
                # gateway gave up on (terminated on its side) would otherwise wait on a lock and hold a connection
                limit = str(int(CALL_TIMEOUT_S * 1000))
                pool = await self._asyncpg.create_pool(
                    self.url, min_size=1, max_size=4, timeout=CONNECT_TIMEOUT_S, server_settings={
                        "statement_timeout": limit, "lock_timeout": limit,
                        "idle_in_transaction_session_timeout": limit})
                try:
                    async with pool.acquire() as db:
                        await self._create_table(db)
                        self.num_stored = await db.fetchval("SELECT COUNT(*) FROM prefixgate_responses")
                        self._recount_at = time.monotonic() + RECOUNT_S
                except BaseException:
                    pool.terminate()
                    raise
                self._pool = pool
        return self._pool

    async def _create_table(self, db) -> None:
        """The table made, or brought up to date; where the server or the role may only read (a standby, a
        SELECT-only role), an existing table is used as it is."""
        try:
            async with db.transaction():
                # gateways starting together on a fresh database: CREATE ... IF NOT EXISTS at once failed on each
                # other's catalog rows (a first put refused, a first read a 503)
                await db.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK)
                await db.execute(SCHEMA)
        except (self._asyncpg.ReadOnlySQLTransactionError, self._asyncpg.InsufficientPrivilegeError) as exc:
            if not await db.fetchval("SELECT to_regclass('prefixgate_responses') IS NOT NULL"):
                raise
            log.warning("stored responses: %s may not create or change the table (%s); using it as it is",
                        self.path, _named(exc))


def _rows(status: str) -> int:
    return int(status.split()[-1])  # "DELETE <rows>"


def _named(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__  # (a timeout has no message)


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)
