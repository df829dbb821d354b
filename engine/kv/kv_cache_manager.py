"""Per-request block tables over the block pool: longest cached prefix, allocation, release."""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from engine.config import EvictionPolicy, HashAlgo
from engine.kv.block_pool import BlockPool, KVCacheBlock
from engine.kv.disk_tier import DiskTier
from engine.kv.hashing import BlockHash
from engine.kv.kv_io import KVBlockIO
from engine.kv.pins import REFUSED_NOT_CACHED, Pin, PinTable
from engine.kv.slot_table import SlotTable
from engine.messages import CacheErased
from engine.request import Request

logger = logging.getLogger("prefixgate.engine")


@dataclass(slots=True)
class CachedPrefix:
    blocks: list[KVCacheBlock]
    num_tokens: int  # RAM and disk hits together
    num_disk_blocks: int = 0  # blocks after `blocks` found in the disk tier, loaded by allocate


@dataclass(slots=True)
class _Hit:
    """A waiting request's longest RAM hit, remembered between steps; valid while the hash map only grew."""

    blocks: list[KVCacheBlock]
    generation: int  # the pool's generation when `blocks` were found


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 hash_algo: HashAlgo = HashAlgo.SHA256, min_shared_prefix_tokens: int = 0,
                 eviction_policy: EvictionPolicy = EvictionPolicy.LRU, max_pinned_blocks: int | None = None) -> None:
        """max_pinned_blocks: most blocks pins may hold (None: half the pool)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.min_shared_prefix_tokens = min_shared_prefix_tokens
        self.pool = BlockPool(num_blocks, enable_caching, eviction_policy)
        self.pins = PinTable(self.pool, block_size, num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks)
        self.disk: DiskTier | None = None
        self.salt_fingerprint: str | None = None  # saved with each pin: see restore_pins
        self.kv_io: KVBlockIO | None = None
        self.num_disk_hit_tokens = 0
        # NOTE: block tables are append-only while a request runs
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        self._slot_tables: dict[str, SlotTable] = {}  # the same tables as slots (slot_table.py)
        self._num_registered: dict[str, int] = {}  # leading blocks of a table already in the hash map
        self._hits: dict[str, _Hit] = {}  # request id -> its longest hit so far (waiting requests)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_lookups = 0
        self.num_preemption_evictions = 0
        self._tenant_lookups: dict[str, tuple[int, int]] = {}  # tenant -> (queried, hit) tokens since last taken

    def num_hittable_blocks(self, request: Request) -> int:
        """Blocks a hit may cover: the last prompt token is always computed, its logits give the next token. A
        request that wants its prompt's logprobs hits only prompt tokens it has scored (a preempted one's: a hit's
        tokens never run through the model)."""
        num_tokens = request.num_tokens - 1
        if request.prompt_logprobs is not None:
            num_tokens = min(num_tokens, len(request.prompt_logprobs) - 1)
        return num_tokens // self.block_size

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Longest run of cached full blocks (RAM, then disk), covering at most num_tokens - 1 tokens."""
        if not self.enable_caching:
            return CachedPrefix([], 0)
        blocks = self._longest_hit(request)
        num_disk = self._num_disk_blocks(request, len(blocks))
        num_tokens = (len(blocks) + num_disk) * self.block_size
        if num_tokens < self.min_shared_prefix_tokens:
            return CachedPrefix([], 0)
        return CachedPrefix(list(blocks), num_tokens, num_disk)

    def num_cached_blocks(self, request: Request) -> int:
        """Blocks find_cached_prefix would hit, without copying the hit (lpm orders the queue by it each step)."""
        if not self.enable_caching:
            return 0
        num_ram = len(self._longest_hit(request))
        num_blocks = num_ram + self._num_disk_blocks(request, num_ram)
        return num_blocks if num_blocks * self.block_size >= self.min_shared_prefix_tokens else 0

    def _num_disk_blocks(self, request: Request, first: int) -> int:
        """A RAM miss may still be a disk hit (checked by name here, read on allocate)."""
        if self.disk is None:
            return 0
        num, max_blocks = 0, self.num_hittable_blocks(request)
        while first + num < max_blocks and request.block_hashes[first + num] in self.disk:
            num += 1
        return num

    def _longest_hit(self, request: Request) -> list[KVCacheBlock]:
        # NOTE: registering a block never takes one out of the hash map or moves it, only an eviction or a
        # duplicate's promotion does (both bump the pool's generation): while the generation stands still a
        # remembered hit is still cached, and can only grow at its end
        hit = self._hits.get(request.request_id)
        if hit is None or hit.generation != self.pool.generation:
            hit = self._hits[request.request_id] = _Hit([], self.pool.generation)
        request.update_block_hashes(self.block_size, self.hash_algo)
        blocks, max_blocks = hit.blocks, self.num_hittable_blocks(request)
        while len(blocks) < max_blocks:
            i = len(blocks)
            block = self.pool.get_cached_block(request.block_hashes[i], request.block_tokens(i, self.block_size))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_lookup(self, request: Request, prefix: CachedPrefix) -> None:
        if request.prompt_logprobs is not None:
            return  # no lookup: it may hit nothing, and would read as a miss in the hit rate (vLLM counts none either)
        self.num_lookups += 1
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += prefix.num_tokens
        if request.tenant is not None:
            queried, hit = self._tenant_lookups.get(request.tenant, (0, 0))
            self._tenant_lookups[request.tenant] = (queried + request.num_tokens, hit + prefix.num_tokens)

    def take_tenant_lookups(self) -> dict[str, tuple[int, int]]:
        taken, self._tenant_lookups = self._tenant_lookups, {}
        return taken

    def allocate(self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        """Room for `num_new_tokens` more tokens after the computed (and newly hit) ones; False if none."""
        table = self.block_tables.setdefault(request.request_id, [])
        hit_blocks = prefix.blocks if prefix else []
        num_tokens = request.num_computed_tokens + (prefix.num_tokens if prefix else 0) + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(table) - len(hit_blocks)
        # hit blocks sitting in the free queue stop being free once touched
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            if not table:
                del self.block_tables[request.request_id]
            return False
        self._hits.pop(request.request_id, None)  # admitted: it looks nothing up again until it waits again
        if prefix is not None:  # before allocating: its own evictions must not push its ghosts out
            self.pool.count_regrets(
                request.block_hashes[prefix.num_tokens // self.block_size:self.num_hittable_blocks(request)])
        self.pool.touch(hit_blocks)
        if prefix is not None and self.pins.pins:  # every hit renews the pins it covers
            self._note_pin(request, self.pins.renew_hits(request.tenant, self._hit_hashes(request, len(hit_blocks))))
        first_new = len(table)
        table += hit_blocks
        self._num_registered.setdefault(request.request_id, 0)
        self._num_registered[request.request_id] += len(hit_blocks)
        if num_needed > 0:
            table += self.pool.allocate(num_needed)
        if len(table) > first_new:
            slot_table = self._slot_tables.setdefault(request.request_id, SlotTable(self.block_size))
            slot_table.append_blocks(b.block_id for b in table[first_new:])
        if prefix and prefix.num_disk_blocks:
            self._load_from_disk(request, prefix, table)
        return True

    def use_disk_tier(self, disk: DiskTier, kv_io: KVBlockIO) -> None:
        self.disk, self.kv_io = disk, kv_io
        self.pool.spill = self._spill

    def _spill(self, block: KVCacheBlock) -> bool:
        """Called as a cached block is handed out, before its KV is overwritten."""
        if block.block_hash in self.disk:
            return True
        return self.disk.put(block.block_hash, block.token_ids, self.kv_io.copy_out(block.block_id), block.owner)

    def _load_from_disk(self, request: Request, prefix: CachedPrefix, table: list[KVCacheBlock]) -> None:
        """Fills the blocks after the RAM hits from disk; a block that fails its checks ends the hit there."""
        first = len(prefix.blocks)
        for i in range(first, first + prefix.num_disk_blocks):
            if not self._read_back(table[i], request.block_hashes[i], request.block_tokens(i, self.block_size),
                                   request.tenant):
                prefix.num_tokens -= (first + prefix.num_disk_blocks - i) * self.block_size
                prefix.num_disk_blocks = i - first
                return
            self._num_registered[request.request_id] += 1
            self.num_disk_hit_tokens += self.block_size

    def _read_back(self, block: KVCacheBlock, block_hash: BlockHash, tokens: tuple[int, ...],
                   tenant: str | None) -> bool:
        """Fills `block` with that block's K/V from the disk tier and caches it, of the cache its file belongs to (as a
        block another tenant computed stays that tenant's when it is hit); False if the file is gone or bad."""
        loaded = self.disk.load(block_hash, tokens)
        if loaded is None:
            return False
        kv, owner = loaded
        self.kv_io.copy_in(block.block_id, kv)
        self.pool.cache_block(block, block_hash, tokens, tenant, reused=True, owner=owner)
        return True

    def _missing_on_disk(self) -> list[KVCacheBlock]:
        return [b for b in self.pool.cached.values() if b.block_hash not in self.disk]

    def flush_to_disk(self) -> int:
        """Writes every cached RAM block the disk tier lacks (graceful shutdown), then marks the files of
        all of them used, the next to be evicted first: file times then keep the RAM recency across a
        restart. Returns how many blocks it queued."""
        blocks = self._missing_on_disk()
        for block in blocks:
            self.disk.put(block.block_hash, block.token_ids, self.kv_io.copy_out(block.block_id), block.owner,
                          wait=True)
        self.disk.flush()
        in_use = [b for b in self.pool.blocks if b.ref_cnt and b.block_hash is not None]
        for block in [b for b in self.pool.free_queue if b.block_hash is not None] + in_use:
            if block.block_hash in self.disk:
                self.disk.touch(block.block_hash)
        return len(blocks)

    def write_behind(self) -> int:
        """Queues the cached RAM blocks the disk tier lacks, while its writer has room, without waiting
        (called when the engine goes idle, so a killed engine restarts warm); returns how many."""
        queued = 0
        for block in self._missing_on_disk():
            kv = self.kv_io.copy_out(block.block_id)
            if not self.disk.has_room(kv.numel() * kv.element_size()):
                break
            self.disk.put(block.block_hash, block.token_ids, kv, block.owner)
            queued += 1
        return queued

    def cache_full_blocks(self, request: Request) -> None:
        """Register blocks that became full and computed (prompt and output blocks alike)."""
        if not self.enable_caching:
            return
        table = self.block_tables[request.request_id]
        start = self._num_registered[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= start:
            return
        request.update_block_hashes(self.block_size, self.hash_algo)
        for i in range(start, num_full):
            self.pool.cache_block(table[i], request.block_hashes[i], request.block_tokens(i, self.block_size),
                                  request.tenant)
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request, preempted: bool = False) -> None:
        table = self.block_tables.pop(request.request_id, [])
        self._slot_tables.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        if preempted:
            # computed K/V in blocks nobody else holds and no hash keeps is lost; blocks allocated for
            # tokens not computed yet held nothing
            num_written = -(-request.num_computed_tokens // self.block_size)
            self.num_preemption_evictions += sum(1 for b in table[:num_written]
                                                 if b.ref_cnt == 1 and b.block_hash is None)
        self.pool.free(reversed(table))  # tail first: the prefix outlives the suffix

    def block_ids(self, request_id: str) -> list[int]:
        """The block table of a running request, as block ids (position p lives in block p // block_size)."""
        return [b.block_id for b in self.block_tables[request_id]]

    def slots(self, request_id: str) -> np.ndarray:
        """The slots of a running request's blocks: position p lives in slots(request_id)[p] (a view: read only,
        and unchanged by later allocations)."""
        table = self._slot_tables.get(request_id)
        return table.slots if table is not None else np.empty(0, np.int64)

    def _hit_hashes(self, request: Request, num_hit: int) -> list[BlockHash]:
        """The hashes of a hit's blocks, and of the prompt's next block where only the last-token rule kept a
        cached one out of the hit: a prompt of whole blocks sent again reads its pinned prefix whole but for its
        last token, which is computed again."""
        hashes = request.block_hashes
        if (num_hit == self.num_hittable_blocks(request) and num_hit < len(hashes)
                and hashes[num_hit] in self.pool.cached):
            num_hit += 1
        return hashes[:num_hit]

    # ---- pins (engine/kv/pins.py)

    def pin_prompt(self, request: Request) -> None:
        """The request's prompt is computed: pins the full blocks up to each of its breakpoints."""
        if request.cache is None:
            return
        table = self.block_tables.get(request.request_id, [])
        for breakpoint in sorted(request.cache.breakpoints, key=lambda b: b.num_tokens):
            num_blocks = min(breakpoint.num_tokens, request.num_prompt_tokens) // self.block_size
            if num_blocks == 0:
                continue
            blocks = [self.pool.cached.get(b.block_hash) if b.block_hash is not None else None
                      for b in table[:num_blocks]]
            if not self.enable_caching or None in blocks:
                request.pin_refused = REFUSED_NOT_CACHED
                continue
            pin = self.pins.pin(request.tenant, blocks, breakpoint.ttl_s, request.cache.max_pinned_blocks)
            if isinstance(pin, str):
                request.pin_refused = pin
            else:
                self._note_pin(request, pin)

    def _note_pin(self, request: Request, pin: Pin | None) -> None:
        """What the request's usage reports: the longest pinned prefix it made or renewed."""
        if pin is not None and len(pin.blocks) * self.block_size >= request.num_pinned_tokens:
            request.num_pinned_tokens = len(pin.blocks) * self.block_size
            request.pinned_until = pin.expires_at

    def release_pin_for_room(self) -> bool:
        """A request cannot get blocks otherwise: the pin closest to expiry goes (False: there is none)."""
        return self.pins.release_one()

    def erase(self, tenant: str | None) -> CacheErased:
        """Forgets every cached block of `tenant`, pinned or not, in RAM and on disk (DELETE /v1/cache)."""
        erased = CacheErased(pins=self.pins.erase(tenant))
        # another tenant's pin on blocks of this one's cache (a salt they share) keeps them, in RAM and on disk,
        # that tenant's from then on: a pinned block keeps its hash (the pin's next hit renews it, the pins saved
        # beside the disk tier name its blocks by it and read them back from there at a restart)
        pinned = [(block, pin.tenant) for pin in self.pins.pins.values() for block in pin.blocks]
        erased.blocks = self.pool.erase(tenant, {block.block_id: owner for block, owner in pinned})
        if self.disk is not None and not self.disk.closed:
            erased.disk_blocks, erased.disk_blocks_kept = self.disk.erase(
                tenant, {block.block_hash: owner for block, owner in pinned})
        return erased

    def save_pins(self) -> None:
        """Writes the pins (their blocks' hashes and tokens) beside the disk tier's files, if they changed; and
        deletes the block files an erase could not, if their folder lets them go now (at each idle moment)."""
        if self.disk is None or self.disk.closed:
            return
        self.disk.retry_deletes()
        if not self.pins.dirty:
            return
        self.pins.dirty = False
        if not self.pins.pins and not self.disk.pins_path.exists():
            return
        # (an engine told no fingerprint, a cluster replica's, saves none: its pins restore anywhere, as before)
        salt = {"salt": self.salt_fingerprint} if self.salt_fingerprint is not None else {}
        self.disk.save_pins([{"tenant": pin.tenant, **salt, "ttl_s": pin.ttl_s,
                              "created_at": pin.created_at, "expires_at": pin.expires_at, "hits": pin.hits,
                              "blocks": [[b.block_hash.hex(), list(b.token_ids)] for b in pin.blocks]}
                             for pin in self.pins.pins.values()])

    def restore_pins(self, salt_fingerprint: str | None = None, tenants: Collection[str | None] | None = None) -> int:
        """At start-up: the pins of the last run that have not expired, their blocks read back from the disk
        tier into RAM (a block that is gone ends its pin there). Returns how many pins came back. Only pins saved
        under `salt_fingerprint` (a fingerprint of the salt secret, saved with each pin; one saved before there was
        one comes back as it did then) come back, of `tenants` (None: any): under another secret nothing can hit
        them, and a tenant the server no longer has could neither list nor erase its pins, which would hold the
        pool's pin quota."""
        if self.disk is None:
            return 0
        self.salt_fingerprint = salt_fingerprint
        restored, foreign = 0, Counter()
        for record in sorted(self.disk.load_pins(), key=_created_at):
            try:
                record = _checked_pin(record)
                if "salt" in record and record["salt"] != salt_fingerprint:  # (one saved before: as before)
                    foreign["made under another salt secret"] += 1
                elif tenants is not None and record["tenant"] not in tenants:
                    foreign["of tenants the server no longer has"] += 1
                else:
                    restored += self._restore_pin(record)
            except (KeyError, TypeError, ValueError) as exc:  # a hand-edited or foreign file: that pin is lost
                logger.warning("disk tier: skipping a saved pin (%r)", exc)
        for why, num in foreign.items():
            logger.warning("disk tier: %d saved pins not restored: %s", num, why)
        self.pins.dirty = False
        return restored

    def _restore_pin(self, record: dict) -> bool:
        if record["expires_at"] <= self.pins.clock():
            return False
        blocks, held = [], []  # held: a reference on each block taken so far, so no allocation below evicts one
        for hash_hex, tokens in record["blocks"]:
            block_hash, tokens = BlockHash(bytes.fromhex(hash_hex)), tuple(tokens)
            block = self.pool.get_cached_block(block_hash, tokens)
            if block is not None:
                self.pool.touch([block])
                held.append(block)
            else:
                if block_hash not in self.disk or not self.pool.num_free_blocks:
                    break
                [block] = self.pool.allocate(1)
                held.append(block)
                if not self._read_back(block, block_hash, tokens, record["tenant"]):
                    break
            blocks.append(block)
        pin = self.pins.restore(record["tenant"], blocks, record["ttl_s"], record["created_at"],
                                record["expires_at"], record["hits"]) if blocks else None
        self.pool.free(reversed(held))  # the pin holds them now (refused, they stay cached; unread, they are empty)
        return pin is not None


def _created_at(record) -> float:
    """A saved pin's creation time to order the restore by (0 where a damaged record has none)."""
    created = record.get("created_at") if isinstance(record, dict) else None
    return created if isinstance(created, (int, float)) and not isinstance(created, bool) else 0


def _checked_pin(record) -> dict:
    """A saved pin with the field types save_pins writes; TypeError naming the first that is not (a hand-edited
    or foreign pins.json: a string time would otherwise fail later, in a listing or an expiry)."""
    if not isinstance(record, dict):
        raise TypeError(f"a saved pin is an object, not {type(record).__name__}")
    for name, kinds in (("tenant", (str, type(None))), ("ttl_s", (int, float)), ("created_at", (int, float)),
                        ("expires_at", (int, float)), ("hits", int), ("blocks", list)):
        if not isinstance(record.get(name), kinds) or isinstance(record.get(name), bool):
            raise TypeError(f"a saved pin's {name} is {record.get(name)!r}")
    return record
