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


@dataclass(slots=True)
class _Hit:
    """A waiting request's longest hit, remembered between steps; valid while no block was evicted."""

    blocks: list[KVCacheBlock]
    num_evictions: int  # the pool's eviction count when `blocks` were found


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
        self._hits: dict[str, _Hit] = {}  # request id -> its longest hit so far (waiting requests)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_lookups = 0
        self.num_preemption_evictions = 0
        self._tenant_lookups: dict[str, tuple[int, int]] = {}  # tenant -> (queried, hit) tokens since last taken

    def num_hittable_blocks(self, request: Request) -> int:
        """Blocks a hit may cover: the last prompt token is always computed, its logits give the next token."""
        return (request.num_tokens - 1) // self.block_size

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Longest run of cached full blocks, covering at most num_tokens - 1 tokens."""
        num_blocks = self.num_cached_blocks(request)
        return CachedPrefix(self._hits[request.request_id].blocks[:num_blocks] if num_blocks else [],
                            num_blocks * self.block_size)

    def num_cached_blocks(self, request: Request) -> int:
        """Blocks find_cached_prefix would hit (it remembers a waiting request's hit between calls)."""
        if not self.enable_caching:
            return 0
        num_blocks = len(self._longest_hit(request))
        return num_blocks if num_blocks * self.block_size >= self.min_shared_prefix_tokens else 0

    def _longest_hit(self, request: Request) -> list[KVCacheBlock]:
        # NOTE: registering a block never takes one out of the hash map, only an eviction does: while the
        # pool's eviction count stands still a remembered hit is still cached, and can only grow at its end
        hit = self._hits.get(request.request_id)
        if hit is None or hit.num_evictions != self.pool.num_evictions:
            hit = self._hits[request.request_id] = _Hit([], self.pool.num_evictions)
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
