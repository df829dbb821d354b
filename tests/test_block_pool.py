"""FreeBlockQueue and BlockPool: exact block ids, eviction order, lazy eviction, and a stateful model check."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
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
    assert ids(pool.free_queue) == [2, 3, 1, 0]
    hit = pool.get_cached_block(h(5), (1,))
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit not in pool.free_queue
    assert ids(pool.free_queue) == [2, 3, 1]
    assert pool.num_free_blocks == 3
    pool.touch([hit])  # a second sharer: only the ref count grows
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 3
    assert ids(pool.allocate(3)) == [2, 3, 1]  # the touched block is never handed out
    pool.free([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.free([hit])
    assert ids(pool.free_queue) == [0] and hit.block_hash == h(5)


def test_a_hash_hit_with_different_token_ids_is_a_miss():
    pool = BlockPool(2)
    block = pool.allocate(1)[0]
    pool.cache_block(block, h(9), (1, 2, 3))
    assert pool.get_cached_block(h(9), (1, 2, 4)) is None  # a collision never returns another prompt's KV
    assert pool.get_cached_block(h(9), (1, 2)) is None
    assert pool.get_cached_block(h(9), (1, 2, 3)) is block
    assert pool.get_cached_block(h(8), (1, 2, 3)) is None


def test_cache_block_keeps_the_first_holder_of_a_hash():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), (7,))
    pool.cache_block(b, h(1), (7,))  # the same tokens computed twice: the copy stays private
    assert pool.cached == {h(1): a}
    assert b.block_hash is None
    pool.cache_block(a, h(2), (8,))  # a block is registered once
    assert pool.cached == {h(1): a} and a.block_hash == h(1)
    pool.free([b, a])
    assert ids(pool.allocate(2)) == [2, 1]  # the private copy goes without an eviction
    assert pool.num_evictions == 0


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    block = pool.allocate(1)[0]
    pool.cache_block(block, h(1), (1,))
    assert pool.cached == {} and block.block_hash is None


def test_reset_cache_forgets_free_blocks_only():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), (1,))
    pool.cache_block(b, h(2), (2,))
    pool.free([a])
    pool.reset_cache()
    assert pool.cached == {h(2): b}  # b is still referenced: its hash stays
    assert a.block_hash is None and pool.num_evictions == 1
    assert ids(pool.free_queue) == [2, 0]


# ---- stateful model check

class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / hit / free / reset sequences against a plain model of the pool."""

    NUM_BLOCKS = 8

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.free_order = list(range(self.NUM_BLOCKS))  # expected free queue, LRU first
        self.refs = [0] * self.NUM_BLOCKS
        self.cached: dict[BlockHash, tuple[int, tuple[int, ...]]] = {}  # hash -> (block id, tokens)
        self.block_hash: dict[int, BlockHash] = {}
        self.tables: list[list[int]] = []  # one list of held block ids per simulated request
        self.evictions = 0

    def _forget(self, block_id: int) -> None:
        if block_id in self.block_hash:
            del self.cached[self.block_hash.pop(block_id)]
            self.evictions += 1

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if n > len(self.free_order):
            with pytest.raises(ValueError):
                self.pool.allocate(n)
            return
        expected, self.free_order = self.free_order[:n], self.free_order[n:]
        assert all(self.refs[i] == 0 for i in expected)
        blocks = self.pool.allocate(n)
        assert ids(blocks) == expected
        for i in expected:
            self._forget(i)
            self.refs[i] = 1
            assert self.pool.blocks[i].block_hash is None
        self.tables.append(expected)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), key=st.integers(0, 5), token=st.integers(0, 2))
    def cache(self, data, key, token):
        table = data.draw(st.sampled_from(self.tables))
        block_id = data.draw(st.sampled_from(table))
        self.pool.cache_block(self.pool.blocks[block_id], h(key), (token,))
        if block_id not in self.block_hash and h(key) not in self.cached:
            self.cached[h(key)] = (block_id, (token,))
            self.block_hash[block_id] = h(key)

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
            self.free_order.remove(block.block_id)
        self.refs[block.block_id] += 1
        self.tables.append([block.block_id])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        table = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        self.pool.free([self.pool.blocks[i] for i in reversed(table)])
        for i in reversed(table):
            self.refs[i] -= 1
            if self.refs[i] == 0:
                self.free_order.append(i)

    @rule()
    def reset_cache(self):
        self.pool.reset_cache()
        for i in list(self.free_order):
            self._forget(i)

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
        assert ids(forward) == self.free_order  # exact LRU order

    @invariant()
    def linked_list_walks_agree(self):
        forward = list(self.pool.free_queue)
        assert walk_backward(self.pool.free_queue) == forward[::-1]
        assert len({id(b) for b in forward}) == len(forward)

    @invariant()
    def hash_map_matches_blocks(self):
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash
        registered = {b.block_hash: b.block_id for b in self.pool.blocks if b.block_hash is not None}
        assert registered == {k: b.block_id for k, b in self.pool.cached.items()}
        assert {k: (b.block_id, b.token_ids) for k, b in self.pool.cached.items()} == self.cached
        assert self.pool.num_evictions == self.evictions


BlockPoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestBlockPoolMachine = BlockPoolMachine.TestCase
