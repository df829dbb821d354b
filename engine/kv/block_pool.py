"""Blocks of KV slots, the free blocks in eviction order, and the hash -> block map of cached blocks."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from engine.config import EvictionPolicy
from engine.kv.eviction import FreeBlockQueue, make_eviction
from engine.kv.hashing import BlockHash, tenant_tag

__all__ = ["BlockPool", "FreeBlockQueue", "Ghost", "KVCacheBlock", "EVICTION_REASONS"]

# why a cached block hash was dropped from RAM (preemption is counted by the KV cache manager)
EVICTION_REASONS = ("capacity", "spill", "erase")


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "tenant", "owner", "reused", "protected",
                 "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to reject hash collisions
        self.tenant: str | None = None  # whose request cached it (per-tenant eviction counts)
        # tenant_tag() of the tenant whose cache it is (DELETE /v1/cache): who computed it, or its block file's
        self.owner: bytes | None = None
        self.reused = False  # hit since it was cached, or cached again while a ghost (SLRU protects it)
        self.protected = False  # sits in SLRU's protected segment
        self.prev: KVCacheBlock | None = None
        self.next: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


@dataclass(slots=True)
class Ghost:
    """An evicted block hash, remembered for a while."""

    tenant: str | None
    reused: bool  # it had been hit while cached: SLRU grows its protected segment when it is asked for again
    regretted: bool = False  # asked for again since its eviction (each eviction is regretted once)


class BlockPool:
    """Owns every block: hands out free ones (evicting lazily), tracks refs and cached hashes.

    A block may hold a hash another block already holds (the same tokens computed twice); it is a
    duplicate, kept in `duplicates`, reused first, and promoted when the cached holder is evicted.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 eviction_policy: EvictionPolicy = EvictionPolicy.LRU) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = make_eviction(eviction_policy, self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # NOTE: free blocks that are the cached holder of their hash: hittable, yet handed out when blocks run out
        self.num_free_cached = 0
        self.duplicates: dict[BlockHash, dict[int, KVCacheBlock]] = {}  # hash -> block id -> live copy
        self.enable_caching = enable_caching
        self.evictions = dict.fromkeys(EVICTION_REASONS, 0)
        self.num_regrets = 0  # evicted blocks asked for again while still in the ghost list
        # NOTE: ghosts are bounded: hashes of the last num_blocks evictions (as ARC keeps)
        self.ghosts: OrderedDict[BlockHash, Ghost] = OrderedDict()
        self.max_ghosts = num_blocks
        self.spill: Callable[[KVCacheBlock], bool] | None = None  # disk tier: True if it took the block
        self._tenant_evictions: dict[str, int] = {}  # since last taken
        self._tenant_regrets: dict[str, int] = {}
        self.kv_events: list[tuple[str, BlockHash]] | None = None  # ("stored"|"removed", hash); opt-in, for routers
        # bumped whenever a hash leaves the map or moves to another block: a remembered hit is stale after it
        self.generation = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_evictions(self) -> int:
        return sum(self.evictions.values())

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / len(self.blocks)

    def get_cached_block(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        block = self.cached.get(block_hash)
        # a hit must match the tokens too, so a hash collision never returns another prompt's KV
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks (a free one leaves the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_free_cached -= self._is_holder(block)
            block.ref_cnt += 1
            block.reused = True

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"need {n} blocks, {self.num_free_blocks} free")
        blocks = [self.free_queue.pop() for _ in range(n)]
        for block in blocks:
            self._evict(block, "capacity")
            block.ref_cnt = 1
        return blocks

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; pass them tail first so the prefix outlives the suffix."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                worthless = self._is_worthless(block)
                self.num_free_cached += not worthless
                self.free_queue.push(block, worthless)

    def _is_holder(self, block: KVCacheBlock) -> bool:
        return block.block_hash is not None and self.cached.get(block.block_hash) is block

    def _is_worthless(self, block: KVCacheBlock) -> bool:
        """No hash, or a copy of a cached hash: nothing is lost when it is reused."""
        return not self._is_holder(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: tuple[int, ...],
                    tenant: str | None = None, *, reused: bool = False, owner: bytes | None = None) -> None:
        """`owner`: the tag of the tenant whose cache the block is, where that is not `tenant` (read from disk)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash, block.token_ids, block.tenant, block.reused = block_hash, token_ids, tenant, reused
        block.owner = tenant_tag(tenant) if owner is None else owner
        if block_hash in self.cached:  # the same tokens computed twice: a live copy, hittable once the holder goes
            self.duplicates.setdefault(block_hash, {})[block.block_id] = block
            return
        self.cached[block_hash] = block
        if self.ghosts.pop(block_hash, None) is not None:
            block.reused = True  # computed again after its eviction: its second use (ARC counts a ghost hit so)
        if self.kv_events is not None:
            self.kv_events.append(("stored", block_hash))

    def _evict(self, block: KVCacheBlock, reason: str) -> None:
        # NOTE: lazy eviction: a free block keeps its hash until it is handed out again
        block_hash = block.block_hash
        if block_hash is None:
            return
        if block.ref_cnt == 0:  # (handed out, or erased while free)
            self.num_free_cached -= self._is_holder(block)
        if self.cached[block_hash] is not block:
            self._drop_duplicate(block_hash, block)
        elif block_hash in self.duplicates:
            self._promote_duplicate(block_hash)
        else:
            self._drop_hash(block, reason)
        block.block_hash = block.token_ids = block.tenant = block.owner = None
        block.reused = False

    def _drop_duplicate(self, block_hash: BlockHash, block: KVCacheBlock) -> None:
        copies = self.duplicates[block_hash]
        del copies[block.block_id]
        if not copies:
            del self.duplicates[block_hash]

    def _promote_duplicate(self, block_hash: BlockHash) -> None:
        """The holder goes but a live copy stays: the copy becomes the cached block (nothing is lost)."""
        # NOTE: the copy is in use: a free copy sits in front of its holder (worthless first), so goes first
        copies = self.duplicates[block_hash]
        copy = copies.pop(next(iter(copies)))
        if not copies:
            del self.duplicates[block_hash]
        self.cached[block_hash] = copy
        self.num_free_cached += copy.ref_cnt == 0
        self.generation += 1

    def _drop_hash(self, block: KVCacheBlock, reason: str) -> None:
        if reason == "capacity" and self.spill is not None and self.spill(block):
            reason = "spill"  # its KV lives on in the disk tier
        del self.cached[block.block_hash]
        self.evictions[reason] += 1
        self.generation += 1
        if self.kv_events is not None:
            self.kv_events.append(("removed", block.block_hash))
        if reason == "erase":  # the tenant asked for it: not an eviction of theirs, nothing to regret
            return
        if block.tenant is not None:
            self._tenant_evictions[block.tenant] = self._tenant_evictions.get(block.tenant, 0) + 1
        self.ghosts[block.block_hash] = Ghost(block.tenant, block.reused)
        if len(self.ghosts) > self.max_ghosts:
            self.ghosts.popitem(last=False)

    def count_regrets(self, missed: Iterable[BlockHash]) -> int:
        """Counts the missed block hashes evicted recently, and tells the eviction policy of each."""
        num = 0
        for block_hash in missed:
            ghost = self.ghosts.get(block_hash)
            if ghost is None or ghost.regretted:
                continue
            ghost.regretted = True
            num += 1
            self.free_queue.on_ghost_hit(ghost.reused)
            if ghost.tenant is not None:
                self._tenant_regrets[ghost.tenant] = self._tenant_regrets.get(ghost.tenant, 0) + 1
        self.num_regrets += num
        return num

    def take_kv_events(self) -> list[tuple[str, BlockHash]]:
        if not self.kv_events:
            return []
        taken, self.kv_events = self.kv_events, []
        return taken

    def take_tenant_evictions(self) -> dict[str, int]:
        taken, self._tenant_evictions = self._tenant_evictions, {}
        return taken

    def take_tenant_regrets(self) -> dict[str, int]:
        taken, self._tenant_regrets = self._tenant_regrets, {}
        return taken

    def erase(self, tenant: str | None, pinned_by: Mapping[int, str | None] | None = None) -> int:
        """Forgets every hash a block of `tenant`'s cache holds (DELETE /v1/cache), free or in use, whoever's
        request hit it or read it back from disk; returns how many cached hashes went. A block in use keeps its
        K/V for its request, but nothing hits it any more. `pinned_by`: block id -> the tenant of a pin holding it
        (tenants sharing a salt share blocks): such a block stays cached, that tenant's now, as its pin needs
        its hash."""
        before, tag = self.evictions["erase"], tenant_tag(tenant)
        for block in self.blocks:
            if block.block_hash is None or block.owner != tag:
                continue
            if pinned_by and block.block_id in pinned_by:
                block.tenant = pinned_by[block.block_id]
                block.owner = tenant_tag(block.tenant)
                continue
            free = block.ref_cnt == 0
            if free:
                self.free_queue.remove(block)
            self._evict(block, "erase")  # a promoted copy of the same tenant goes later in this loop
            if free:
                self.free_queue.push(block, True)
        for block_hash in [h for h, ghost in self.ghosts.items() if ghost.tenant == tenant]:
            del self.ghosts[block_hash]
        return self.evictions["erase"] - before
