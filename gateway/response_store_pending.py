"""Nothing a client was answered is lost to a database that cannot take it for a while. A put the store refuses
(SQLite locked or full, Postgres down, a call timed out) is kept in this process and written again every
RETRY_S until the database takes it; meanwhile this gateway serves it from memory (a get, a continuation, a
delete). While puts wait, new ones join them at once instead of each waiting out the database's timeout; the
first that the database takes again empties the queue in order.

Puts reach the database one at a time: a put waits for the one before it, and joins the waiting ones at once if
that one was refused (else every put sent at once would wait out the database's timeout in turn).

Puts are shielded from their request's cancellation: a client that goes away the moment it has its answer (the
openai SDK leaving a stream at `response.completed`) does not cancel the write of what it was told is stored.

Bounded: beyond `max_pending_bytes` of waiting conversations, the oldest of the tenant that holds the most is
dropped with a warning (one tenant's traffic never drops another's while it holds less); what still waits when
the gateway stops is tried once more, then named in a warning (a kill -9 loses it unsaid). Other gateways see a
waiting put only once it is written (their `previous_response_id` to it is a 400 until then).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Protocol

from gateway.errors import APIError
from gateway.response_store import Stored, not_found

log = logging.getLogger(__name__)

RETRY_S = 1.0
MAX_PENDING_BYTES = 256 * 2**20  # of the waiting conversations' JSON (a long chat is a megabyte or more)


class Backend(Protocol):  # gateway/response_store.py (SQLite) and gateway/response_store_postgres.py
    path: str
    num_stored: int
    num_dropped: int

    async def aput(self, stored: Stored, warn: bool = True) -> bool: ...
    async def aget(self, tenant: str, response_id: str) -> Stored: ...
    async def adelete(self, tenant: str, response_id: str) -> None: ...
    async def aerase(self, tenant: str) -> int: ...
    async def aclose(self) -> None: ...


class PendingPuts:
    """A store (`backend`) with the puts it refused kept and tried again; the same calls as the store."""

    def __init__(self, backend: Backend, max_pending_bytes: int = MAX_PENDING_BYTES, retry_s: float = RETRY_S) -> None:
        self.backend = backend
        self.max_pending_bytes = max_pending_bytes
        self.retry_s = retry_s
        self.num_lost = 0  # dropped beyond max_pending_bytes, or still waiting at close
        self._pending: dict[str, Stored] = {}  # response id -> its put, oldest first
        self._sizes: dict[str, int] = {}  # response id -> its JSON's bytes
        self._pending_bytes = 0
        self._writing = asyncio.Lock()  # a waiting put being written: a delete of it waits for the outcome
        self._putting = asyncio.Lock()  # one put at a time to the database
        self._retrying: asyncio.Task | None = None
        self._puts: set[asyncio.Task] = set()  # (referenced until done: the loop keeps only weak references)

    @property
    def path(self) -> str:
        return self.backend.path

    @property
    def num_stored(self) -> int:
        return self.backend.num_stored + len(self._pending)

    @property
    def num_dropped(self) -> int:
        return self.backend.num_dropped

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def aput(self, stored: Stored) -> None:
        task = asyncio.ensure_future(self._put(stored))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)
        await asyncio.shield(task)

    async def _put(self, stored: Stored) -> None:
        async with self._putting:
            if self._pending or not await self.backend.aput(stored):
                self._keep(stored)

    def _keep(self, stored: Stored) -> None:
        response_id = stored.response["id"]
        self._forget(response_id)
        if not self._pending and not self._retrying:
            log.warning("stored responses: %s cannot take puts now; keeping them in memory and trying again every "
                        "%g s", self.path, self.retry_s)
        self._pending[response_id] = stored
        self._sizes[response_id] = sum(len(json.dumps(part)) for part in
                                       (stored.response, stored.input_items, stored.messages))
        self._pending_bytes += self._sizes[response_id]
        while self._pending_bytes > self.max_pending_bytes and len(self._pending) > 1:
            lost = self._oldest_of_the_largest_tenant()
            self._forget(lost)
            self.num_lost += 1
            log.warning("stored responses: more than %d MiB of puts wait for %s; dropped the oldest, %s",
                        self.max_pending_bytes >> 20, self.path, lost)
        if self._retrying is None:
            self._retrying = asyncio.create_task(self._retry())

    def _oldest_of_the_largest_tenant(self) -> str:
        held: dict[str, int] = {}
        for response_id, stored in self._pending.items():
            held[stored.tenant] = held.get(stored.tenant, 0) + self._sizes[response_id]
        largest = max(held, key=held.__getitem__)
        return next(r for r, stored in self._pending.items() if stored.tenant == largest)

    def _forget(self, response_id: str) -> None:
        if self._pending.pop(response_id, None) is not None:
            self._pending_bytes -= self._sizes.pop(response_id)

    async def _retry(self) -> None:
        try:
            while self._pending:
                await asyncio.sleep(self.retry_s)
                try:
                    await self._write_pending()
                except Exception:  # noqa: BLE001 - a backend's own bug: said, and tried again at the next tick
                    log.exception("stored responses: writing the puts kept in memory to %s failed", self.path)
            log.warning("stored responses: %s took every put kept in memory", self.path)
        finally:
            self._retrying = None

    async def _write_pending(self) -> None:
        """In order, until the first the database refuses (not said again: _keep said it once)."""
        while self._pending:
            response_id, stored = next(iter(self._pending.items()))
            async with self._writing:
                if self._pending.get(response_id) is not stored:  # deleted or put again meanwhile
                    continue
                if not await self.backend.aput(stored, warn=False):
                    return
                if self._pending.get(response_id) is stored:
                    self._forget(response_id)

    async def aget(self, tenant: str, response_id: str) -> Stored:
        if "\x00" in response_id:  # no id holds one (and Postgres refuses it in a query: a 503 forever)
            raise not_found(response_id)
        stored = self._pending.get(response_id)
        if stored is not None:
            if stored.tenant != tenant:
                raise not_found(response_id)
            return stored
        return await self.backend.aget(tenant, response_id)

    async def adelete(self, tenant: str, response_id: str) -> None:
        if "\x00" in response_id:
            raise not_found(response_id)
        if (stored := self._pending.get(response_id)) is None or stored.tenant != tenant:
            await self.backend.adelete(tenant, response_id)  # (not waiting: written, or never put)
            return
        async with self._writing:  # a retry writing it finishes first
            if response_id not in self._pending:  # written meanwhile
                await self.backend.adelete(tenant, response_id)
                return
            self._forget(response_id)
        # never written, unless a put that timed out was committed all the same: that row is deleted now where the
        # database answers, else it stays (the delete is not tried again)
        try:
            await self.backend.adelete(tenant, response_id)
        except APIError as exc:
            log.debug("stored responses: %s deleted from memory; the database answered %s", response_id, exc.code)

    async def aerase(self, tenant: str) -> int:
        """The database's first: where it cannot be written (a 503), the ones waiting here stay too."""
        async with self._writing:  # (no retry writes one of the waiting ones meanwhile)
            erased = await self.backend.aerase(tenant)
            mine = [r for r, stored in self._pending.items() if stored.tenant == tenant]
            for response_id in mine:
                self._forget(response_id)
        return len(mine) + erased

    async def aclose(self) -> None:
        if self._puts:
            await asyncio.gather(*self._puts, return_exceptions=True)
        if self._retrying is not None:
            self._retrying.cancel()
            await asyncio.gather(self._retrying, return_exceptions=True)
        await self._write_pending()
        if self._pending:
            self.num_lost += len(self._pending)
            log.warning("stored responses: %s still cannot take %d puts; lost at exit: %s", self.path,
                        len(self._pending), ", ".join(self._pending))
        await self.backend.aclose()
