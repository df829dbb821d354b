"""Pinned prefixes: the full blocks of a prompt prefix held in RAM past their requests, for a TTL that every
hit of its tenant renews (prompt caching's `cache_control` breakpoints).

A pin is its tenant's: tenants that share a salt share blocks, and each one's pin of a prefix is its own (its
quota, its listing, its erase, its hits). A pin holds one reference on each of its blocks (the table takes one per
distinct block, however many pins cover it), so a pinned block never sits in the free queue and is never evicted;
the pool's invariants hold as they are. An expired or released pin drops those references: blocks nobody else
holds go back to the free queue like blocks a request frees, in the normal eviction order. The table holds at
most `max_blocks` distinct blocks, a tenant at most its key's quota; a pin beyond either is refused (never an
error). Pins never cost a running request its blocks, nor keep a waiting one out when nothing running would free
blocks: there the scheduler releases pins, the soonest to expire first (`release_one`); while requests run, a
waiting one waits for their blocks, as it would without pins.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.kv.block_pool import BlockPool, KVCacheBlock
from engine.kv.hashing import BlockHash
from engine.messages import PinInfo

RELEASE_REASONS = ("expired", "pressure", "erased")
# why a breakpoint was not pinned (the response's prompt_tokens_details.pin_refused)
REFUSED_TENANT_QUOTA = "tenant_quota"
REFUSED_POOL_QUOTA = "pool_quota"
REFUSED_NOT_CACHED = "not_cached"  # prefix caching is off, or the blocks were erased while the request ran


@dataclass(slots=True, eq=False)
class Pin:
    key: BlockHash  # its last block's hash: one per salted prefix
    tenant: str | None
    blocks: list[KVCacheBlock]
    ttl_s: float
    created_at: float  # clock(): wall time, so expiries survive a restart
    expires_at: float
    hits: int = 0


class PinTable:
    def __init__(self, pool: BlockPool, block_size: int, max_blocks: int,
                 clock: Callable[[], float] | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.clock = clock or time.time  # wall time: an expiry means the same after a restart
        self.pins: dict[tuple[str | None, BlockHash], Pin] = {}  # (tenant, key) -> its pin
        self._holders: Counter[int] = Counter()  # block id -> pins holding it (the table holds one ref)
        self._tenant_holders: dict[str | None, Counter[int]] = {}  # tenant -> block id -> its pins holding it
        self._next_expiry = float("inf")  # no pin expires before this (a lower bound: renewals only push out)
        self.released = dict.fromkeys(RELEASE_REASONS, 0)
        self.dirty = False  # changed since last saved (the disk tier keeps pins across restarts)
        self._tenant_expiries: Counter[str | None] = Counter()  # since last taken
        self._tenant_refusals: Counter[tuple[str | None, str]] = Counter()

    @property
    def num_blocks(self) -> int:
        return len(self._holders)

    def tenant_blocks(self, tenant: str | None) -> int:
        return len(self._tenant_holders.get(tenant, ()))

    def is_pinned(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._holders

    # ---- pin, renew, release

    def pin(self, tenant: str | None, blocks: list[KVCacheBlock], ttl_s: float,
            max_tenant_blocks: int | None = None) -> Pin | str:
        """Pins `blocks` (a prefix's cached blocks, in order) for `tenant`, or renews the tenant's pin of them;
        returns the pin, or why it was refused."""
        key = blocks[-1].block_hash
        now = self.clock()
        pin = self.pins.get((tenant, key))
        if pin is not None:
            pin.ttl_s = max(pin.ttl_s, ttl_s)
            pin.expires_at = max(pin.expires_at, now + pin.ttl_s)
            self.dirty = True
            return pin
        held = self._tenant_holders.get(tenant, Counter())
        if max_tenant_blocks is not None and len(held) + sum(b.block_id not in held for b in blocks) > max_tenant_blocks:
            return self._refuse(tenant, REFUSED_TENANT_QUOTA)
        if self._over_cap(blocks):
            return self._refuse(tenant, REFUSED_POOL_QUOTA)
        return self._add(Pin(key, tenant, list(blocks), ttl_s, now, now + ttl_s))

    def restore(self, tenant: str | None, blocks: list[KVCacheBlock], ttl_s: float, created_at: float,
                expires_at: float, hits: int) -> Pin | None:
        """A pin saved before a restart (its tenant's quota was checked when it was made); None past the cap."""
        if (tenant, blocks[-1].block_hash) in self.pins or expires_at <= self.clock():
            return None
        if self._over_cap(blocks):
            return None
        return self._add(Pin(blocks[-1].block_hash, tenant, list(blocks), ttl_s, created_at, expires_at, hits))

    def _over_cap(self, blocks: list[KVCacheBlock]) -> bool:
        return len(self._holders) + sum(b.block_id not in self._holders for b in blocks) > self.max_blocks

    def _add(self, pin: Pin) -> Pin:
        tenant_holders = self._tenant_holders.setdefault(pin.tenant, Counter())
        for block in pin.blocks:
            if not self._holders[block.block_id]:
                self.pool.touch([block])
            self._holders[block.block_id] += 1
            tenant_holders[block.block_id] += 1
        self.pins[pin.tenant, pin.key] = pin
        self._next_expiry = min(self._next_expiry, pin.expires_at)
        self.dirty = True
        return pin

    def _refuse(self, tenant: str | None, reason: str) -> str:
        self._tenant_refusals[tenant, reason] += 1
        return reason

    def renew_hits(self, tenant: str | None, block_hashes: Iterable[BlockHash]) -> Pin | None:
        """A request of `tenant` hit these leading blocks: every pin of the tenant's among them is renewed; returns
        the longest."""
        if not self.pins:
            return None
        now, longest = self.clock(), None
        for block_hash in block_hashes:
            pin = self.pins.get((tenant, block_hash))
            if pin is not None:
                pin.hits += 1
                pin.expires_at = max(pin.expires_at, now + pin.ttl_s)
                longest = pin
        if longest is not None:
            self.dirty = True
        return longest

    def expire(self) -> int:
        """Releases the pins whose TTL ran out; O(1) while none is due."""
        now = self.clock()
        if now < self._next_expiry:
            return 0
        expired = [pin for pin in self.pins.values() if pin.expires_at <= now]
        for pin in expired:
            self._tenant_expiries[pin.tenant] += 1
            self.release(pin, "expired")
        self._next_expiry = min((pin.expires_at for pin in self.pins.values()), default=float("inf"))
        return len(expired)

    def release_one(self) -> bool:
        """Releases the pin closest to expiry, for a request that could not run otherwise; False if none."""
        if not self.pins:
            return False
        self.release(min(self.pins.values(), key=lambda p: p.expires_at), "pressure")
        return True

    def release(self, pin: Pin, reason: str) -> None:
        del self.pins[pin.tenant, pin.key]
        tenant_holders = self._tenant_holders[pin.tenant]
        for block in reversed(pin.blocks):  # tail first: the prefix outlives the suffix in the free queue
            tenant_holders[block.block_id] -= 1
            if not tenant_holders[block.block_id]:
                del tenant_holders[block.block_id]
            self._holders[block.block_id] -= 1
            if not self._holders[block.block_id]:
                del self._holders[block.block_id]
                self.pool.free([block])
        if not tenant_holders:
            del self._tenant_holders[pin.tenant]
        self.released[reason] += 1
        self.dirty = True

    def erase(self, tenant: str | None) -> int:
        """Releases every pin of `tenant`; returns how many."""
        pins = [pin for pin in self.pins.values() if pin.tenant == tenant]
        for pin in pins:
            self.release(pin, "erased")
        return len(pins)

    # ---- what the API and the metrics see

    def list(self, tenant: str | None) -> list[PinInfo]:
        return [PinInfo(pin.key.hex(), len(pin.blocks) * self.block_size, len(pin.blocks), pin.ttl_s,
                         pin.created_at, pin.expires_at, pin.hits)
                for pin in sorted(self.pins.values(), key=lambda p: p.created_at) if pin.tenant == tenant]

    def tenants_blocks(self) -> dict[str | None, int]:
        return {tenant: len(holders) for tenant, holders in self._tenant_holders.items()}

    def take_tenant_expiries(self) -> dict[str | None, int]:
        taken, self._tenant_expiries = self._tenant_expiries, Counter()
        return dict(taken)

    def take_tenant_refusals(self) -> dict[tuple[str | None, str], int]:
        taken, self._tenant_refusals = self._tenant_refusals, Counter()
        return dict(taken)
