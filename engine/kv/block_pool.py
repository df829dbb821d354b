"""Blocks of KV slots, the free queue, and the hash -> block map of cached blocks."""
from __future__ import annotations

from engine.kv.hashing import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "tenant", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to reject hash collisions
        self.tenant: str | None = None  # whose request cached it (per-tenant eviction counts)
        self.prev: KVCacheBlock | None = None
        self.next: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, LRU first; prev/next live on the block (O(1) remove)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # dummy ends: no special cases
        self._tail = KVCacheBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next
        if block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev is not None

    def __iter__(self):
        block = self._head.next
        while block is not self._tail:
            yield block
            block = block.next


class BlockPool:
    """Owns every block: hands out free ones (evicting lazily), tracks refs and cached hashes."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.enable_caching = enable_caching
        self.num_evictions = 0
        self._tenant_evictions: dict[str, int] = {}  # since last taken
        self.kv_events: list[tuple[str, BlockHash]] | None = None  # ("stored"|"removed", hash); opt-in, for routers

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

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
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"need {n} blocks, {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; pass them tail first so the prefix outlives the suffix."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: tuple[int, ...],
                    tenant: str | None = None) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another block already holds these tokens; this one stays private
        block.block_hash, block.token_ids, block.tenant = block_hash, token_ids, tenant
        self.cached[block_hash] = block
        if self.kv_events is not None:
            self.kv_events.append(("stored", block_hash))

    def _evict(self, block: KVCacheBlock) -> None:
        # NOTE: lazy eviction: a free block keeps its hash until it is handed out again
        if block.block_hash is None:
            return
        del self.cached[block.block_hash]
        if self.kv_events is not None:
            self.kv_events.append(("removed", block.block_hash))
        if block.tenant is not None:
            self._tenant_evictions[block.tenant] = self._tenant_evictions.get(block.tenant, 0) + 1
        block.block_hash = block.token_ids = block.tenant = None
        self.num_evictions += 1

    def take_kv_events(self) -> list[tuple[str, BlockHash]]:
        if not self.kv_events:
            return []
        taken, self.kv_events = self.kv_events, []
        return taken

    def take_tenant_evictions(self) -> dict[str, int]:
        taken, self._tenant_evictions = self._tenant_evictions, {}
        return taken

    def reset_cache(self) -> None:
        """Forget every cached hash of a free block (used between benchmark runs)."""
        for block in self.free_queue:
            self._evict(block)
