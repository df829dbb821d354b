"""Per-request block tables over the block pool: longest cached prefix, allocation, release."""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import HashAlgo
from engine.kv.block_pool import BlockPool, KVCacheBlock
from engine.request import Request


@dataclass(slots=True)
class CachedPrefix:
    blocks: list[KVCacheBlock]
    num_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 hash_algo: HashAlgo = HashAlgo.SHA256, min_shared_prefix_tokens: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.min_shared_prefix_tokens = min_shared_prefix_tokens
        self.pool = BlockPool(num_blocks, enable_caching)
        # NOTE: block tables are append-only while a request runs
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of a table already in the hash map
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_lookups = 0
        self.num_preemption_evictions = 0
        self._tenant_lookups: dict[str, tuple[int, int]] = {}  # tenant -> (queried, hit) tokens since last taken

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Longest run of cached full blocks, covering at most num_tokens - 1 tokens."""
        if not self.enable_caching:
            return CachedPrefix([], 0)
        request.update_block_hashes(self.block_size, self.hash_algo)
        # the last prompt token is always computed: its logits give the next token
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.get_cached_block(block_hash, request.block_tokens(i, self.block_size))
            if block is None:
                break
            blocks.append(block)
        if len(blocks) * self.block_size < self.min_shared_prefix_tokens:
            return CachedPrefix([], 0)
        return CachedPrefix(blocks, len(blocks) * self.block_size)

    def record_lookup(self, request: Request, prefix: CachedPrefix) -> None:
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
        self.pool.touch(hit_blocks)
        table += hit_blocks
        self._num_registered.setdefault(request.request_id, 0)
        self._num_registered[request.request_id] += len(hit_blocks)
        if num_needed > 0:
            table += self.pool.allocate(num_needed)
        return True

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
        self._num_registered.pop(request.request_id, None)
        if preempted:
            # computed K/V in blocks nobody else holds and no hash keeps is lost
            self.num_preemption_evictions += sum(1 for b in table if b.ref_cnt == 1 and b.block_hash is None)
        self.pool.free(reversed(table))  # tail first: the prefix outlives the suffix

    def slots(self, request: Request, start: int, end: int) -> list[int]:
        """Slots of token positions [start, end) of a request."""
        table = self.block_tables[request.request_id]
        bs = self.block_size
        return [table[p // bs].block_id * bs + p % bs for p in range(start, end)]
