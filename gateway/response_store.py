"""Stored responses of the Responses API in SQLite: a file that outlives the API process (a restart, a kill -9)
and that several gateways on one host share. Two connections per store, each on a thread of its own, so the
event loop never waits on SQLite: the writer's (puts, deletes, erasures; `busy_timeout` so two gateways writing
at once queue instead of failing, counted from the request, so a call queued behind others on the thread waits no
longer) and the reader's (gets and counts: in WAL mode they never wait for a writer,
nor queue behind this store's puts). A locked or broken file never turns into a 500: a put that fails says so
(gateway/response_store_pending.py keeps it and tries again), a read, a delete or an erasure is a 503
`responses_store_busy` with Retry-After, each with a warning naming the file. A file found corrupt at start (not a
database, or failing `PRAGMA quick_check`) is moved aside and a new store begins in its place, as browsers do with
a corrupt profile database; one deleted or replaced while serving is opened again at the next call (a stat of the
path at each call), a read included.

NOTE: a row is one response with its whole conversation (JSON text); "used" is the last put or get, the order
in which a tenant's rows beyond `max_responses` are dropped; rows older than `ttl_days` (from their put) are
dropped lazily: on the next put, and a get of one is a 404. A get marks its row used at once where the file is
free, else at this store's next put (the drop it orders happens there), so a read never waits for a writer.
"""
from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.paths import default_cache_dir
from gateway.errors import APIError

log = logging.getLogger(__name__)

IN_MEMORY = ":memory:"
FileId = tuple[int, int]  # (st_dev, st_ino): a file on a path replaced by another has another
RESPONSES_DB_ENV = "PREFIXGATE_RESPONSES_DB"  # e.g. a postgresql:// URL from a Kubernetes Secret, off the command line
BUSY_TIMEOUT_MS = 2000  # a write waits at most this long for another gateway's (on the store's thread)
RETRY_AFTER_S = 1  # a read, delete or erasure the database could not serve: try again after this long
SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    messages TEXT NOT NULL,
    created_at REAL NOT NULL,
    used_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_tenant_used_at ON responses (tenant, used_at);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
DROP INDEX IF EXISTS responses_used_at;
"""


class CorruptFile(sqlite3.DatabaseError):
    """The file is not an SQLite database, or a damaged one: SQLITE_NOTADB, SQLITE_CORRUPT, a failed quick_check."""


@dataclass(slots=True)
class Stored:
    tenant: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # the whole conversation so far, the answer included, as chat messages


def default_db_path() -> Path:
    return default_cache_dir() / "responses.sqlite3"


class ResponseStore:
    """Stored responses of every tenant, each tenant's least recently used dropped first beyond `max_responses`
    (one tenant's traffic never drops another's conversations), and none older than `ttl_days`."""

    def __init__(self, max_responses: int, path: str | Path = IN_MEMORY, ttl_days: float = 30,
                 clock: Callable[[], float] = time.time, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
        self.max_responses = max_responses
        self.ttl_s = ttl_days * 86400
        self.num_dropped = 0  # dropped by this store to stay within max_responses
        self._clock = clock
        self.path = str(path)
        self._busy_timeout_ms = busy_timeout_ms
        self._lock = threading.Lock()  # the writer's connection: one call at a time, whichever thread makes it
        # the reader's: the same connection and lock in memory (a second connection would be a database of its own)
        self._read_lock = self._lock if self.path == IN_MEMORY else threading.Lock()
        self._db, self._reader, self._files = self._connect()
        self._used: dict[str, float] = {}  # gets whose used_at the file was too busy to take: written at the next put
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="prefixgate-responses")
        self._read_thread = ThreadPoolExecutor(1, thread_name_prefix="prefixgate-responses-read")
        self.num_stored = 0  # as of the last call that counted (a /metrics scrape reads it, never the file)
        len(self)

    def _connect(self) -> tuple[sqlite3.Connection, sqlite3.Connection, tuple[FileId | None, ...] | None]:
        """The writer's connection, the reader's, and the identities of the file, its WAL and its shared memory."""
        db = _open(self.path, self._busy_timeout_ms)
        if self.path == IN_MEMORY:
            return db, db, None
        try:
            files = tuple(_file_id(self.path + suffix) for suffix in ("", "-wal", "-shm"))
            reader = sqlite3.connect(self.path, timeout=self._busy_timeout_ms / 1000, check_same_thread=False)
        except (sqlite3.Error, OSError):
            db.close()
            raise
        return db, reader, files

    # ---- for the event loop: the same calls, on the store's threads, each answered within the busy timeout of
    # its request (not of its turn on the thread: on a locked file, calls queued behind others waited it in turn)

    async def aput(self, stored: Stored, warn: bool = True) -> bool:
        return await self._off_loop(self._thread, self.put, stored, warn)

    async def aget(self, tenant: str, response_id: str) -> Stored:
        return await self._off_loop(self._read_thread, self.get, tenant, response_id)

    async def adelete(self, tenant: str, response_id: str) -> None:
        await self._off_loop(self._thread, self.delete, tenant, response_id)

    async def aerase(self, tenant: str) -> int:
        return await self._off_loop(self._thread, self.erase, tenant)

    async def _off_loop(self, thread: ThreadPoolExecutor, call: Callable, *args: Any) -> Any:
        call = functools.partial(call, *args, deadline=time.monotonic() + self._busy_timeout_ms / 1000)
        return await asyncio.get_running_loop().run_in_executor(thread, call)

    # ---- the calls themselves (blocking)

    def put(self, stored: Stored, warn: bool = True, deadline: float | None = None) -> bool:
        """True once the file holds it; False (with a warning, if `warn`) when it cannot be written: locked past
        `deadline` (time.monotonic(); None: the busy timeout from now), or broken."""
        now = self._clock()
        row = (stored.response["id"], stored.tenant, json.dumps(stored.response), json.dumps(stored.input_items),
               json.dumps(stored.messages), now, now)
        used, self._used = self._used, {}  # (swapped whole: a get's mark made meanwhile goes to the new dict)
        try:
            self._reopen_if_replaced()
            # one transaction: the row, the marks of use, the expired rows, the overflow
            with self._lock, self._waiting(self._db, deadline):
                self._db.executemany("UPDATE responses SET used_at = MAX(used_at, ?) WHERE id = ?",
                                     [(at, response_id) for response_id, at in used.items()])
                self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)", row)
                self._db.execute("DELETE FROM responses WHERE created_at < ?", (now - self.ttl_s,))
                dropped = self._db.execute(
                    "DELETE FROM responses WHERE id IN (SELECT id FROM responses WHERE tenant = ? ORDER BY used_at "
                    "DESC, rowid DESC LIMIT -1 OFFSET ?)", (stored.tenant, self.max_responses)).rowcount
            self.num_dropped += dropped
        except (sqlite3.Error, OSError) as exc:  # locked past the timeout, or broken
            for response_id, at in used.items():  # kept for the next put
                self._used[response_id] = max(at, self._used.get(response_id, at))
            if warn:
                log.warning("stored responses: %s not stored in %s (%s)", row[0], self.path, exc)
            return False
        self._count(deadline)
        return True

    def _waiting(self, db: sqlite3.Connection, deadline: float | None) -> sqlite3.Connection:
        """`db`, waiting for another connection's lock until `deadline` at most (None: the busy timeout)."""
        left_ms = self._busy_timeout_ms if deadline is None else (deadline - time.monotonic()) * 1000
        db.execute(f"PRAGMA busy_timeout = {max(0, int(left_ms))}")
        return db

    def _reopen_if_replaced(self) -> None:
        """The file deleted or replaced under the store (SQLite would go on with the unlinked one, which nothing
        reads again): opened again on the path, with a warning. Each call checks (a stat)."""
        if self._files is None or _file_id(self.path) == self._files[0]:
            return
        with self._lock, self._read_lock:
            if _file_id(self.path) == self._files[0]:  # the other thread opened it meanwhile
                return
            self._reader.close()
            self._db.close()
            # the old file's WAL and shared memory stay on the path (SQLite keeps a moved file's): a new connection
            # would read the new file through them, the old rows in place of its own (a new file's own are kept)
            for suffix, old in zip(("-wal", "-shm"), self._files[1:]):
                if old is not None and _file_id(self.path + suffix) == old:
                    os.unlink(self.path + suffix)
            try:
                fresh = self._connect()
            except CorruptFile as exc:  # as at start: moved aside, a new store begins on the path
                log.warning("stored responses: %s was replaced by a corrupt file (%s); moved it to %s", self.path,
                            exc, _move_aside(self.path))
                fresh = self._connect()
            log.warning("stored responses: %s was deleted or replaced while serving; opened it again (what this "
                        "gateway stored since is lost with the old file)", self.path)
            self._db, self._reader, self._files = fresh

    def get(self, tenant: str, response_id: str, deadline: float | None = None) -> Stored:
        """The tenant's stored response; 404 for an unknown id, an expired one and another tenant's alike; 503
        when the file cannot be read (by `deadline`, where a file not in WAL mode is locked)."""
        now = self._clock()
        try:
            self._reopen_if_replaced()
            with self._read_lock:
                row = self._waiting(self._reader, deadline).execute(
                    "SELECT response, input_items, messages FROM responses WHERE id = ? AND tenant = ? "
                    "AND created_at >= ?", (response_id, tenant, now - self.ttl_s)).fetchone()
                if row is not None:
                    self._mark_used(response_id, now)
        except (sqlite3.Error, OSError) as exc:
            log.warning("stored responses: cannot read %s (%s) for %r", self.path, exc, response_id)
            raise unavailable("response_id") from None
        if row is None:
            raise not_found(response_id)
        return Stored(tenant, *map(json.loads, row))

    def _mark_used(self, response_id: str, now: float) -> None:
        """At once where no other writer holds the file (no wait), else at the next put."""
        try:
            with self._waiting(self._reader, deadline=0):  # (long past: no wait)
                self._reader.execute("UPDATE responses SET used_at = ? WHERE id = ?", (now, response_id))
        except sqlite3.Error:
            self._used[response_id] = now

    def delete(self, tenant: str, response_id: str, deadline: float | None = None) -> None:
        """404 for an id it does not hold; 503 when the file cannot be written (another writer holds it past
        `deadline`, or it is broken, full or read-only): the response may still be there, the client may try
        again."""
        try:
            self._reopen_if_replaced()
            with self._lock, self._waiting(self._db, deadline):
                deleted = self._db.execute("DELETE FROM responses WHERE id = ? AND tenant = ? AND created_at >= ?",
                                           (response_id, tenant, self._clock() - self.ttl_s)).rowcount
        except (sqlite3.Error, OSError) as exc:
            log.warning("stored responses: cannot delete %r in %s (%s)", response_id, self.path, exc)
            raise unavailable("response_id") from None
        if not deleted:
            raise not_found(response_id)
        self._count(deadline)

    def erase(self, tenant: str, deadline: float | None = None) -> int:
        """Deletes every stored response of `tenant` (DELETE /v1/cache); returns how many. 503 when the file cannot
        be written (the client asked for an erasure: it must learn that none happened)."""
        try:
            self._reopen_if_replaced()
            with self._lock, self._waiting(self._db, deadline):
                erased = self._db.execute("DELETE FROM responses WHERE tenant = ?", (tenant,)).rowcount
        except (sqlite3.Error, OSError) as exc:
            log.warning("stored responses: cannot erase tenant %s's in %s (%s)", tenant, self.path, exc)
            raise unavailable() from None
        self._count(deadline)
        return erased

    def __len__(self) -> int:
        return self._count()

    def _count(self, deadline: float | None = None) -> int:
        """Stored responses not expired (the last count, with a warning, when the file cannot be read)."""
        try:
            with self._read_lock:
                (self.num_stored,) = self._waiting(self._reader, deadline).execute(
                    "SELECT COUNT(*) FROM responses WHERE created_at >= ?", (self._clock() - self.ttl_s,)).fetchone()
        except sqlite3.Error as exc:
            log.warning("stored responses: cannot count %s (%s); %d as last counted", self.path, exc,
                        self.num_stored)
        return self.num_stored

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._read_thread.shutdown(wait=True)
        if self._reader is not self._db:
            self._reader.close()
        self._db.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)


def open_store(max_responses: int, path: str | None, ttl_days: float):
    """The store on `path` (None: $PREFIXGATE_RESPONSES_DB, else the default file; a postgresql:// URL: a shared
    server, gateway/response_store_postgres.py). A corrupt file is renamed to `<name>.corrupt-<UTC time>` (kept for
    whoever wants to recover from it) and a new store starts on `path`; a file that cannot be opened all the same
    (locked, a folder that cannot be created, a rename refused) costs a warning and a store in memory. Never a
    failed start."""
    from gateway.response_store_postgres import PostgresResponseStore, is_postgres_url

    path = path or os.environ.get(RESPONSES_DB_ENV) or None
    if is_postgres_url(path):
        return PostgresResponseStore(path, max_responses, ttl_days)
    if path is not None and (scheme := re.match(r"([A-Za-z][A-Za-z0-9+.-]+):/", path)):
        # (a URL of another database, or SQLAlchemy's sqlite:///: it made a file named after the URL, in silence)
        raise ValueError(f"--responses-db takes a file path or a postgresql:// URL, not a {scheme[1]}: URL")
    path = str(default_db_path()) if path is None else path
    try:
        try:
            return ResponseStore(max_responses, path, ttl_days)
        except CorruptFile:
            return _replace_corrupt(max_responses, path, ttl_days)
    except (sqlite3.Error, OSError) as exc:
        log.warning("stored responses: cannot open %s (%s); keeping them in memory, lost at exit", path, exc)
        return ResponseStore(max_responses, IN_MEMORY, ttl_days)


def _replace_corrupt(max_responses: int, path: str, ttl_days: float) -> ResponseStore:
    """A store on `path`, found corrupt: under a lock beside it, so that of the gateways starting together on the
    file one moves it aside and the others open the new one (each moving it on its own, the later ones failed and
    kept their responses in memory, or moved the first one's new file away from under it)."""
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return ResponseStore(max_responses, path, ttl_days)  # (another gateway may have replaced it)
        except CorruptFile as exc:
            log.warning("stored responses: %s is corrupt (%s); moved it to %s and started a new, empty store at %s",
                        path, exc, _move_aside(path), path)
            return ResponseStore(max_responses, path, ttl_days)


def _move_aside(path: str) -> Path:
    """Renames the file, with its WAL and shared-memory files (a WAL left behind would be replayed into the new
    file), to `<name>.corrupt-<UTC time>` (`-wal`, `-shm`): a set the sqlite3 shell opens as it was."""
    aside = Path(f"{path}.corrupt-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}")
    if aside.exists():  # a file moved aside this second already (corrupt again at once): keep it, open in memory
        raise FileExistsError(f"{aside} exists")
    Path(path).rename(aside)
    for suffix in ("-wal", "-shm"):
        part = Path(path + suffix)
        if part.exists():
            part.rename(f"{aside}{suffix}")
    return aside


def _file_id(path: str) -> FileId | None:
    """(device, inode) of the file on `path`; None where there is none."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def _is_corrupt(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def unavailable(param: str | None = None) -> APIError:
    """A call the client may try again: the database is locked by another writer, cannot be reached, read or
    written now (the reason goes to the log, not to the client)."""
    return APIError(503, "the stored responses' database cannot be used now; try again", param=param,
                    code="responses_store_busy", headers={"Retry-After": str(RETRY_AFTER_S)})


def not_found(response_id: str) -> APIError:
    return APIError(404, f"no response {response_id!r} is stored for this key", param="response_id",
                    code="response_not_found")


def _open(path: str, busy_timeout_ms: int) -> sqlite3.Connection:
    if path != IN_MEMORY:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _check_intact(path, busy_timeout_ms)
    # the event loop's thread uses it, which need not be the thread that built the app
    # (the default isolation level: a write opens a transaction, `with db:` commits it)
    # (timeout: SQLite's busy_timeout, how long a write waits for another connection's)
    db = sqlite3.connect(path, timeout=busy_timeout_ms / 1000, check_same_thread=False)
    try:
        if path != IN_MEMORY:
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")  # in WAL mode a crash of the process loses no commit
        db.executescript(SCHEMA)
    except sqlite3.Error:
        db.close()
        raise
    return db


def _check_intact(path: str, busy_timeout_ms: int) -> None:
    """Raises CorruptFile for a file that is not a database or a damaged one. Its own connection, read-only: a
    writable one would set WAL mode in the header and, closing, delete a corrupt file's WAL. Reads every page
    once (the store is capped: a start-up cost)."""
    if not Path(path).exists():
        return
    db = sqlite3.connect(f"{Path(path).absolute().as_uri()}?mode=ro", uri=True, timeout=busy_timeout_ms / 1000)
    try:
        problems = [line for (rows,) in db.execute("PRAGMA quick_check") for line in rows.splitlines()]
    except sqlite3.Error as exc:
        if _is_corrupt(exc):
            raise CorruptFile(str(exc)) from exc
        raise
    finally:
        db.close()
    if problems != ["ok"]:  # (one line per damaged page: the first few say enough)
        raise CorruptFile(f"quick_check: {'; '.join(problems[:3])}")
