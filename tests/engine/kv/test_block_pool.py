"""FreeBlockQueue and BlockPool: exact block ids, eviction order, lazy eviction, and a stateful model check."""
from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.config import EvictionPolicy
from engine.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from engine.kv.eviction import PROTECTED_START
from engine.kv.hashing import BlockHash


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def h(n: int) -> BlockHash:
    return BlockHash(bytes([n]))


def walk_backward(queue: FreeBlockQueue) -> list[KVCacheBlock]:
    out, block = [], queue._tail.prev
    while block is not queue._head:
        out.append(block)
        block = block.prev
    return out


# ---- FreeBlockQueue

def test_queue_pops_in_insertion_order():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert queue.num_free == 4
    assert ids(queue) == [0, 1, 2, 3]
    assert ids([queue.popleft(), queue.popleft()]) == [0, 1]
    assert ids(queue) == [2, 3]
    assert queue.num_free == 2


def test_queue_remove_from_the_middle_and_the_ends():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert blocks[2] not in queue and blocks[2].prev is None and blocks[2].next is None
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert ids(walk_backward(queue)) == [3, 1]
    assert queue.num_free == 2
    assert blocks[1] in queue and blocks[3] in queue


def test_queue_append_goes_to_the_tail():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeBlockQueue(blocks)
    first = queue.popleft()
    queue.append(first)
    assert ids(queue) == [1, 2, 0]
    queue.remove(blocks[2])
    queue.append(blocks[2])
    assert ids(queue) == [1, 0, 2]
    assert ids(walk_backward(queue)) == [2, 0, 1]
    assert queue.num_free == 3


def test_queue_empty_popleft_raises_and_can_refill():
    block = KVCacheBlock(7)
    queue = FreeBlockQueue([block])
    assert queue.popleft() is block
    assert queue.num_free == 0 and list(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()
    queue.append(block)
    assert ids(queue) == [7]


# ---- BlockPool

def test_allocate_hands_out_the_lowest_free_ids_first():
    pool = BlockPool(8)
    assert ids(pool.allocate(3)) == [0, 1, 2]
    assert ids(pool.allocate(2)) == [3, 4]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.num_free_blocks == 3
    assert pool.usage() == pytest.approx(5 / 8)
    with pytest.raises(ValueError):
        pool.allocate(4)
    assert pool.num_free_blocks == 3  # a refused allocation takes nothing


def test_free_tail_first_evicts_the_suffix_before_the_prefix():
    pool = BlockPool(8)
    request = pool.allocate(3)  # blocks 0, 1, 2: a request's block table
    for i, block in enumerate(request):
        pool.cache_block(block, h(i), (i,))
    pool.free(reversed(request))  # tail first, as KVCacheManager.free does
    assert ids(pool.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
    # 6 new blocks: the 5 never-used ones, then the request's last block (its suffix)
    assert ids(pool.allocate(6)) == [3, 4, 5, 6, 7, 2]
    assert pool.num_evictions == 1
    assert set(pool.cached) == {h(0), h(1)}
    assert pool.get_cached_block(h(2), (2,)) is None
    assert pool.get_cached_block(h(0), (0,)) is pool.blocks[0]
    assert ids(pool.allocate(1)) == [1]  # then the middle block, the prefix (block 0) last
    assert set(pool.cached) == {h(0)}


def test_lazy_eviction_a_freed_block_stays_hittable_until_handed_out():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), (10, 11))
    pool.cache_block(b, h(2), (12, 13))
    pool.free([b, a])
    assert pool.num_free_blocks == 4
    assert a.block_hash == h(1) and b.block_hash == h(2)
    assert pool.get_cached_block(h(1), (10, 11)) is a
    assert pool.get_cached_block(h(2), (12, 13)) is b
    assert pool.num_evictions == 0
    assert ids(pool.allocate(3)) == [2, 3, 1]  # free queue: 2, 3, then b (1), then a (0)
    assert pool.num_evictions == 1
    assert b.block_hash is None and b.token_ids is None
    assert pool.get_cached_block(h(2), (12, 13)) is None
    assert pool.get_cached_block(h(1), (10, 11)) is a
    assert ids(pool.allocate(1)) == [0]
    assert pool.cached == {} and pool.num_evictions == 2


def test_touch_takes_a_free_cached_block_out_of_the_free_queue():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], h(5), (1,))
    pool.free(reversed(blocks))
    assert ids(pool.free_queue) == [1, 2, 3, 0]  # the hashless block 1 in front: reused first
    hit = pool.get_cached_block(h(5), (1,))
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit not in pool.free_queue
    assert ids(pool.free_queue) == [1, 2, 3]
    assert pool.num_free_blocks == 3
    pool.touch([hit])  # a second sharer: only the ref count grows
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 3
    assert ids(pool.allocate(3)) == [1, 2, 3]  # the touched block is never handed out
    pool.free([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.free([hit])
    assert ids(pool.free_queue) == [0] and hit.block_hash == h(5)


def test_a_freed_hashless_block_is_reused_before_an_older_cached_one():
    pool = BlockPool(2)
    cached, hashless = pool.allocate(2)
    pool.cache_block(cached, h(1), (1,))
    pool.free([cached])  # freed first: the older one
    pool.free([hashless])  # freed last, but worth nothing
    assert ids(pool.free_queue) == [1, 0]
    assert ids(pool.allocate(1)) == [1]
    assert pool.num_evictions == 0 and pool.get_cached_block(h(1), (1,)) is cached


def test_a_hash_hit_with_different_token_ids_is_a_miss():
    pool = BlockPool(2)
    block = pool.allocate(1)[0]
    pool.cache_block(block, h(9), (1, 2, 3))
    assert pool.get_cached_block(h(9), (1, 2, 4)) is None  # a collision never returns another prompt's KV
    assert pool.get_cached_block(h(9), (1, 2)) is None
    assert pool.get_cached_block(h(9), (1, 2, 3)) is block
    assert pool.get_cached_block(h(8), (1, 2, 3)) is None


def test_a_duplicate_is_reused_first_and_without_an_eviction():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), (7,))
    pool.cache_block(b, h(1), (7,))  # the same tokens computed twice: b is a live copy
    assert pool.cached == {h(1): a} and pool.duplicates == {h(1): {1: b}}
    pool.cache_block(a, h(2), (8,))  # a block is registered once
    assert pool.cached == {h(1): a} and a.block_hash == h(1)
    pool.free([b, a])
    assert ids(pool.free_queue) == [1, 2, 0]  # the copy in front
    assert ids(pool.allocate(2)) == [1, 2]
    assert pool.num_evictions == 0 and pool.duplicates == {}
    assert pool.get_cached_block(h(1), (7,)) is a


def test_a_live_duplicate_stays_hittable_when_the_holder_is_evicted():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), (7,))
    pool.cache_block(b, h(1), (7,))
    pool.free([a])  # b is still in use
    assert ids(pool.allocate(2)) == [2, 0]  # the holder goes
    assert pool.get_cached_block(h(1), (7,)) is b  # ...but its copy is hit
    assert pool.num_evictions == 0 and pool.duplicates == {}
    pool.free([b])
    assert ids(pool.free_queue) == [1] and b.block_hash == h(1)


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    block = pool.allocate(1)[0]
    pool.cache_block(block, h(1), (1,))
    assert pool.cached == {} and block.block_hash is None


def test_evictions_by_reason_and_the_spill_hook():
    pool = BlockPool(2)
    spilled = []
    pool.spill = lambda block: spilled.append((block.block_id, block.block_hash)) or block.block_id == 0
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), (1,), "alice")
    pool.cache_block(b, h(2), (2,), "bob")
    pool.free([a, b])
    pool.allocate(2)
    assert spilled == [(0, h(1)), (1, h(2))]  # called with the hash still on the block
    assert pool.evictions == {"capacity": 1, "spill": 1, "erase": 0}
    assert pool.take_tenant_evictions() == {"alice": 1, "bob": 1}


def test_regret_counts_an_evicted_hash_asked_for_again_once():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), (1,), "alice")
    pool.cache_block(b, h(2), (2,), None)
    pool.free([a, b])
    pool.allocate(2)
    assert list(pool.ghosts) == [h(1), h(2)]
    assert pool.count_regrets([h(1), h(2), h(3)]) == 2
    assert pool.count_regrets([h(1)]) == 0  # regretted once
    assert pool.num_regrets == 2 and pool.take_tenant_regrets() == {"alice": 1}


def test_the_ghost_list_is_bounded_by_the_pool_size():
    pool = BlockPool(2)
    for key in range(5):
        [block] = pool.allocate(1)
        pool.cache_block(block, h(key), (key,))
        pool.free([block])
    pool.allocate(2)
    assert list(pool.ghosts) == [h(3), h(4)]  # the two newest of the five evicted hashes
    block = pool.blocks[0]
    pool.cache_block(block, h(4), (4,))  # cached again: no longer a ghost
    assert list(pool.ghosts) == [h(3)]


# ---- SLRU

def slru_pool(num_blocks: int) -> BlockPool:
    return BlockPool(num_blocks, eviction_policy=EvictionPolicy.SLRU)


def _cache_a_hot_prefix(pool: BlockPool) -> list:
    """Blocks 0 and 1 cached as hashes 0 and 1, freed, hit again, freed again."""
    hot = pool.allocate(2)
    for i, block in enumerate(hot):
        pool.cache_block(block, h(i), (i,))
    pool.free(reversed(hot))
    pool.touch(hot)  # the hot prefix is hit again
    pool.free(reversed(hot))
    return hot


def _scan(pool: BlockPool) -> None:
    """Six one-off blocks, cached and freed one at a time."""
    for key in range(10, 16):
        [block] = pool.allocate(1)
        pool.cache_block(block, h(key), (key,))
        pool.free([block])


def test_slru_a_block_hit_again_is_protected_from_a_scan():
    pool = slru_pool(6)
    hot = _cache_a_hot_prefix(pool)
    assert ids(pool.free_queue.probation) == [2, 3, 4, 5] and ids(pool.free_queue.protected) == [1, 0]
    _scan(pool)
    assert pool.get_cached_block(h(0), (0,)) is hot[0] and pool.get_cached_block(h(1), (1,)) is hot[1]
    assert pool.evictions["capacity"] == 2  # the scan evicted its own oldest blocks only
    assert pool.get_cached_block(h(10), (10,)) is None and pool.get_cached_block(h(11), (11,)) is None
    assert ids(pool.allocate(6)) == [4, 5, 2, 3, 1, 0]


def test_lru_loses_the_same_prefix_to_the_same_scan():
    pool = BlockPool(6)
    _cache_a_hot_prefix(pool)
    _scan(pool)
    assert pool.get_cached_block(h(0), (0,)) is None and pool.get_cached_block(h(1), (1,)) is None
    assert pool.evictions["capacity"] == 2 and list(pool.ghosts) == [h(1), h(0)]


def test_slru_protected_segment_is_bounded_and_demotes_its_oldest():
    pool = slru_pool(5)  # protects at most int(5 * 0.5) = 2 free blocks until ghost hits move the bound
    blocks = pool.allocate(5)
    for i, block in enumerate(blocks):
        pool.cache_block(block, h(i), (i,))
    pool.touch(blocks)
    pool.free(blocks)  # drops the second reference
    pool.free(blocks)
    assert pool.free_queue.max_protected == 2
    assert ids(pool.free_queue.protected) == [3, 4]
    assert ids(pool.free_queue.probation) == [0, 1, 2]  # demoted, keep their hashes
    assert blocks[0].block_hash == h(0) and not blocks[0].protected
    assert ids(pool.allocate(4)) == [0, 1, 2, 3]  # probation first, then the protected LRU


def cache_new(pool: BlockPool, keys: list[int], hit: bool = False) -> list[KVCacheBlock]:
    """New blocks cached as h(key) for each key and freed tail first; with hit, hit and freed once more."""
    blocks = pool.allocate(len(keys))
    for key, block in zip(keys, blocks):
        pool.cache_block(block, h(key), (key,))
    pool.free(reversed(blocks))
    if hit:
        pool.touch(blocks)
        pool.free(reversed(blocks))
    return blocks


def test_slru_ghost_hits_on_blocks_evicted_unused_shrink_protected():
    pool = slru_pool(6)  # bound 3
    hot = cache_new(pool, [0, 1], hit=True)
    cache_new(pool, [10, 11])  # blocks 2, 3
    pool.free(pool.allocate(4))  # evicts both one-off blocks unused; the four go back hashless, in front
    assert list(pool.ghosts) == [h(11), h(10)] and ids(pool.free_queue.protected) == [1, 0]
    assert pool.count_regrets([h(10), h(11)]) == 2  # probation was too small: 3 -> 1
    assert pool.free_queue.max_protected == 1
    assert ids(pool.free_queue.protected) == [0] and ids(pool.free_queue.probation) == [2, 3, 5, 4, 1]
    assert hot[1].block_hash == h(1) and not hot[1].protected  # demoted, still cached
    # computed again while still a ghost: its second use, so it is protected when freed
    [block] = pool.allocate(1)
    pool.cache_block(block, h(10), (10,))
    assert block.reused and list(pool.ghosts) == [h(11)]
    pool.free([block])
    assert ids(pool.free_queue.protected) == [2] and ids(pool.free_queue.probation) == [3, 5, 4, 1, 0]


def test_slru_ghost_hits_on_protected_blocks_grow_protected_up_to_the_pool():
    pool = slru_pool(2)  # bound 1
    cache_new(pool, [0, 1], hit=True)
    assert ids(pool.free_queue.protected) == [0] and ids(pool.free_queue.probation) == [1]
    pool.allocate(2)  # evicts both, each hit while cached
    assert pool.count_regrets([h(0), h(1)]) == 2
    assert pool.free_queue.max_protected == 2  # 1 + 2, capped at the pool's size
    assert pool.count_regrets([h(0), h(1)]) == 0 and pool.free_queue.max_protected == 2  # regretted once


def test_slru_at_bound_zero_evicts_as_lru_does():
    pools = slru_pool(2), BlockPool(2)
    for pool in pools:
        cache_new(pool, [0, 1])
        pool.free(pool.allocate(2))  # evicts both unused
        assert pool.count_regrets([h(0), h(1)]) == 2
        cache_new(pool, [2, 3], hit=True)
    slru, lru = pools
    assert slru.free_queue.max_protected == 0  # 1 - 2, floored at 0
    assert not slru.free_queue.protected.num_free
    assert ids(slru.free_queue) == ids(lru.free_queue) == [1, 0]

def test_free_cached_counts_the_free_holders_of_a_hash_through_each_change():
    pool = BlockPool(5)
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, h(1), (1,), "alice")
    pool.cache_block(b, h(1), (1,), "alice")  # a live copy of a's hash: not counted, as `cached` does not
    pool.cache_block(c, h(2), (2,), "alice")
    pool.free([d, c, b, a])
    assert (len(pool.cached), pool.num_free_blocks, pool.num_free_cached) == (2, 5, 2)  # a, c; b, d, e empty
    pool.touch([c])  # a hit takes it out of the free queue
    assert pool.num_free_cached == 1
    assert ids(pool.allocate(3)) == [1, 3, 4]  # the copy and the empty go first: nothing cached lost
    assert pool.num_free_cached == 1
    assert ids(pool.allocate(1)) == [0]  # then the free holder: evicted
    assert (pool.num_free_cached, pool.evictions["capacity"]) == (0, 1)
    pool.free([c])
    assert pool.num_free_cached == 1
    pool.erase("alice")
    assert (pool.num_free_cached, len(pool.cached)) == (0, 0)


def test_free_cached_follows_a_promoted_copy_and_an_erase():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), (1,), "alice")
    pool.cache_block(b, h(1), (1,), "alice")
    pool.free([b])  # the free copy, worthless
    assert pool.num_free_cached == 0
    pool.erase("alice")  # a (in use) forgets its hash, b is promoted, then forgotten too
    assert (pool.num_free_cached, pool.cached, pool.duplicates) == (0, {}, {})
    pool.free([a])
    assert (pool.num_free_blocks, pool.num_free_cached) == (3, 0)



def test_erase_forgets_the_tenants_ghosts_only():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), (1,), "alice")
    pool.cache_block(b, h(2), (2,), "bob")
    pool.free([a, b])
    pool.allocate(2)  # both evicted: their hashes stay as ghosts
    assert list(pool.ghosts) == [h(1), h(2)]
    pool.erase("alice")
    assert list(pool.ghosts) == [h(2)]


# ---- stateful model check

TENANTS = (None, "alice")

class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / hit / free / erase / miss sequences against a plain model of the pool:
    eviction order (LRU, or SLRU's two segments and their adaptive bound), worthless blocks first, duplicates,
    ghosts."""

    NUM_BLOCKS = 8
    POLICY = EvictionPolicy.LRU

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS, eviction_policy=self.POLICY)
        self.probation = list(range(self.NUM_BLOCKS))  # expected eviction order (LRU: the only segment)
        self.protected: list[int] = []
        self.max_protected = int(self.NUM_BLOCKS * PROTECTED_START)
        self.refs = [0] * self.NUM_BLOCKS
        self.cached: dict[BlockHash, tuple[int, tuple[int, ...]]] = {}  # hash -> (block id, tokens)
        self.copies: dict[BlockHash, list[int]] = {}  # hash -> duplicate block ids, oldest first
        self.block_hash: dict[int, tuple[BlockHash, tuple[int, ...]]] = {}  # every holder and copy
        self.reused: set[int] = set()
        self.ghosts: dict[BlockHash, list[bool]] = {}  # insertion-ordered: hash -> [was reused, regretted]
        self.tenants: dict[int, str | None] = {}  # block id -> whose request cached it (every holder and copy)
        self.ghost_tenants: dict[BlockHash, str | None] = {}
        self.tables: list[list[int]] = []  # one list of held block ids per simulated request
        self.evictions = 0
        self.regrets = 0
        self.generation = 0  # hashes that left the map or moved to another block (a remembered hit is stale)
        self.tenant_evictions: dict[str, int] = {}

    # -- the model's eviction order

    def _order(self) -> list[int]:
        return self.probation + self.protected

    def _push(self, i: int) -> None:
        worthless = i not in self.block_hash or self.cached[self.block_hash[i][0]][0] != i
        if worthless:
            self.probation.insert(0, i)
        elif self.POLICY is EvictionPolicy.SLRU and i in self.reused:
            self.protected.append(i)
            self._fit()
        else:
            self.probation.append(i)

    def _fit(self) -> None:
        if len(self.protected) > self.max_protected:
            self.probation.append(self.protected.pop(0))

    def _learn(self, reused: bool) -> None:
        if self.POLICY is not EvictionPolicy.SLRU:
            return
        if reused:
            self.max_protected = min(self.NUM_BLOCKS, self.max_protected + 1)
        else:
            self.max_protected = max(0, self.max_protected - 1)
            self._fit()

    def _take(self, i: int) -> None:
        (self.protected if i in self.protected else self.probation).remove(i)

    def _forget(self, i: int, erased: bool = False) -> None:
        if i not in self.block_hash:
            return
        block_hash, _ = self.block_hash.pop(i)
        tenant = self.tenants.pop(i)
        reused = i in self.reused
        self.reused.discard(i)
        if self.cached[block_hash][0] != i:
            self.copies[block_hash].remove(i)
        elif self.copies.get(block_hash):
            promoted = self.copies[block_hash].pop(0)
            self.cached[block_hash] = (promoted, self.block_hash[promoted][1])
            self.generation += 1
        else:
            del self.cached[block_hash]
            self.evictions += 1
            self.generation += 1
            if not erased and tenant is not None:
                self.tenant_evictions[tenant] = self.tenant_evictions.get(tenant, 0) + 1
            if not erased:  # (an erasure was asked for: nothing to regret)
                self.ghosts[block_hash] = [reused, False]
                self.ghost_tenants[block_hash] = tenant
                if len(self.ghosts) > self.NUM_BLOCKS:
                    del self.ghost_tenants[next(iter(self.ghosts))]
                    del self.ghosts[next(iter(self.ghosts))]
        if block_hash in self.copies and not self.copies[block_hash]:
            del self.copies[block_hash]

    # -- rules

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if n > len(self._order()):
            with pytest.raises(ValueError):
                self.pool.allocate(n)
            return
        expected = self._order()[:n]
        for i in expected:
            self._take(i)
        blocks = self.pool.allocate(n)
        assert ids(blocks) == expected
        for i in expected:
            self._forget(i)
            self.refs[i] = 1
            assert self.pool.blocks[i].block_hash is None
        self.tables.append(expected)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), key=st.integers(0, 5), token=st.integers(0, 2), tenant=st.sampled_from(TENANTS))
    def cache(self, data, key, token, tenant):
        table = data.draw(st.sampled_from(self.tables))
        block_id = data.draw(st.sampled_from(table))
        self.pool.cache_block(self.pool.blocks[block_id], h(key), (token,), tenant)
        if block_id in self.block_hash:
            return
        self.block_hash[block_id] = (h(key), (token,))
        self.tenants[block_id] = tenant
        if h(key) in self.cached:
            self.copies.setdefault(h(key), []).append(block_id)
        else:
            self.cached[h(key)] = (block_id, (token,))
            if self.ghosts.pop(h(key), None) is not None:
                del self.ghost_tenants[h(key)]
                self.reused.add(block_id)

    @rule(key=st.integers(0, 5), token=st.integers(0, 2))
    def probe(self, key, token):
        self._hit(h(key), (token,))

    @precondition(lambda self: self.cached)
    @rule(data=st.data(), token=st.integers(0, 2))
    def hit(self, data, token):
        # a registered hash, with its own tokens or (a simulated collision) with other ones
        block_hash = data.draw(st.sampled_from(sorted(self.cached)))
        tokens = data.draw(st.sampled_from([self.cached[block_hash][1], (token,)]))
        self._hit(block_hash, tokens)

    def _hit(self, block_hash, tokens):
        block = self.pool.get_cached_block(block_hash, tokens)
        entry = self.cached.get(block_hash)
        if entry is None or entry[1] != tokens:  # unknown hash, or same hash with other tokens
            assert block is None
            return
        assert block is self.pool.blocks[entry[0]]
        self.pool.touch([block])
        if self.refs[block.block_id] == 0:
            self._take(block.block_id)
        self.refs[block.block_id] += 1
        self.reused.add(block.block_id)
        self.tables.append([block.block_id])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        table = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        self.pool.free([self.pool.blocks[i] for i in reversed(table)])
        for i in reversed(table):
            self.refs[i] -= 1
            if self.refs[i] == 0:
                self._push(i)

    @rule(keys=st.lists(st.integers(0, 5), max_size=3))
    def miss(self, keys):
        self._miss([h(k) for k in keys])

    @precondition(lambda self: self.ghosts)
    @rule(data=st.data())
    def miss_ghosts(self, data):
        # what moves SLRU's bound, more often than random keys would
        self._miss(data.draw(st.lists(st.sampled_from(list(self.ghosts)), min_size=1, max_size=3)))

    def _miss(self, hashes):
        expected = 0
        for block_hash in hashes:
            ghost = self.ghosts.get(block_hash)
            if ghost is not None and not ghost[1]:
                ghost[1] = True
                expected += 1
                self._learn(ghost[0])
        self.regrets += expected
        assert self.pool.count_regrets(hashes) == expected

    @rule(tenant=st.sampled_from(TENANTS))
    def erase(self, tenant):
        # DELETE /v1/cache: the tenant's hashes go, free or in use, block by block; a free block moves to the
        # front of the eviction order (nothing left to lose)
        erased = self.evictions
        for i in sorted(i for i, t in self.tenants.items() if t == tenant):
            free = self.refs[i] == 0
            if free:
                self._take(i)
            self._forget(i, erased=True)
            if free:
                self.probation.insert(0, i)
        for block_hash in [k for k, t in self.ghost_tenants.items() if t == tenant]:
            del self.ghosts[block_hash], self.ghost_tenants[block_hash]
        assert self.pool.erase(tenant) == self.evictions - erased

    # -- invariants

    @invariant()
    def every_block_is_free_xor_referenced(self):
        for block in self.pool.blocks:
            assert block.ref_cnt >= 0
            assert (block in self.pool.free_queue) == (block.ref_cnt == 0)
        assert [b.ref_cnt for b in self.pool.blocks] == self.refs

    @invariant()
    def free_counts_agree(self):
        forward = list(self.pool.free_queue)
        num_unreferenced = sum(1 for b in self.pool.blocks if b.ref_cnt == 0)
        assert len(forward) == self.pool.num_free_blocks == num_unreferenced
        assert ids(forward) == self._order()  # exact eviction order

    @invariant()
    def linked_list_walks_agree(self):
        for queue in segments(self.pool):
            forward = list(queue)
            assert walk_backward(queue) == forward[::-1]
            assert len({id(b) for b in forward}) == len(forward) == queue.num_free
        if self.POLICY is EvictionPolicy.SLRU:
            assert ids(self.pool.free_queue.protected) == self.protected
            assert all(b.protected == (b.block_id in self.protected) for b in self.pool.blocks)

    @invariant()
    def protected_segment_within_its_adaptive_bound(self):
        if self.POLICY is EvictionPolicy.SLRU:
            queue = self.pool.free_queue
            assert queue.max_protected == self.max_protected
            assert queue.protected.num_free <= queue.max_protected
            assert 0 <= queue.max_protected <= self.NUM_BLOCKS
            if queue.max_protected in (0, self.NUM_BLOCKS):
                event(f"slru bound reached {'0' if queue.max_protected == 0 else 'the pool size'}")

    @invariant()
    def free_cached_counts_the_free_holders(self):
        holders = [block_id for block_id, _ in self.cached.values()]
        assert self.pool.num_free_cached == sum(1 for i in holders if self.refs[i] == 0)

    @invariant()
    def hash_map_matches_blocks(self):
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash
        assert {k: (b.block_id, b.token_ids) for k, b in self.pool.cached.items()} == self.cached
        assert {k: list(c) for k, c in self.pool.duplicates.items()} == self.copies
        assert {b.block_id: (b.block_hash, b.token_ids) for b in self.pool.blocks
                if b.block_hash is not None} == self.block_hash
        assert self.pool.num_evictions == self.evictions and self.pool.generation == self.generation
        assert self.pool.take_tenant_evictions() == self.tenant_evictions
        self.tenant_evictions = {}
        assert {k: [g.reused, g.regretted] for k, g in self.pool.ghosts.items()} == self.ghosts
        assert list(self.pool.ghosts) == list(self.ghosts) and self.pool.num_regrets == self.regrets


def segments(pool: BlockPool) -> list[FreeBlockQueue]:
    queue = pool.free_queue
    return [queue.queue] if hasattr(queue, "queue") else [queue.probation, queue.protected]


class SLRUBlockPoolMachine(BlockPoolMachine):
    POLICY = EvictionPolicy.SLRU


class SmallSLRUBlockPoolMachine(SLRUBlockPoolMachine):
    NUM_BLOCKS = 3  # bound 1: a few ghost hits reach 0 and the pool size


for machine in (BlockPoolMachine, SLRUBlockPoolMachine, SmallSLRUBlockPoolMachine):
    machine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestBlockPoolMachine = pytest.mark.fuzz(BlockPoolMachine.TestCase)
TestSLRUBlockPoolMachine = pytest.mark.fuzz(SLRUBlockPoolMachine.TestCase)
TestSmallSLRUBlockPoolMachine = pytest.mark.fuzz(SmallSLRUBlockPoolMachine.TestCase)
