"""KVCacheManager without a model: the remembered hit of a waiting request, preemption counts, block ids."""
from __future__ import annotations

import itertools
import random

import pytest

from engine import LLM, SamplingParams
from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request

BS = 4
_probe_ids = itertools.count()


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1))


def compute(kv: KVCacheManager, r: Request, num_tokens: int | None = None) -> None:
    """What the engine does for a prefill: hit, allocate the rest, compute it, register full blocks."""
    num_tokens = r.num_tokens if num_tokens is None else num_tokens
    prefix = kv.find_cached_prefix(r)
    assert kv.allocate(r, num_tokens - prefix.num_tokens, prefix)
    r.num_computed_tokens = num_tokens
    kv.cache_full_blocks(r)


def fresh_hit(kv: KVCacheManager, tokens: list[int]) -> int:
    """The hit a never-seen request with these tokens gets: nothing remembered."""
    return kv.find_cached_prefix(request(f"probe-{next(_probe_ids)}", tokens)).num_tokens


class CountingLookups:
    def __init__(self, kv: KVCacheManager, monkeypatch) -> None:
        self.calls = 0
        lookup = kv.pool.get_cached_block

        def counting(block_hash, token_ids):
            self.calls += 1
            return lookup(block_hash, token_ids)

        monkeypatch.setattr(kv.pool, "get_cached_block", counting)


def test_a_waiting_requests_hit_is_remembered_and_only_extended(monkeypatch):
    kv = KVCacheManager(32, BS)
    tokens = list(range(100, 133))  # 33 tokens: 8 hittable blocks
    writer = request("writer", tokens)
    compute(kv, writer, 16)  # blocks 0-3 cached
    waiting = request("waiting", tokens)
    assert kv.find_cached_prefix(waiting).num_tokens == 16
    lookups = CountingLookups(kv, monkeypatch)
    for _ in range(5):  # every step orders the queue again: one probe past the hit, nothing more
        assert kv.find_cached_prefix(waiting).num_tokens == 16
    assert lookups.calls == 5
    assert kv.allocate(writer, 8)
    writer.num_computed_tokens = 24
    kv.cache_full_blocks(writer)  # blocks 4-5 registered: the hit grows without starting over
    lookups.calls = 0
    assert kv.find_cached_prefix(waiting).num_tokens == 24
    assert lookups.calls == 3  # blocks 4, 5 and the miss at 6


def test_an_eviction_makes_a_remembered_hit_start_over():
    kv = KVCacheManager(8, BS)
    tokens = list(range(100, 125))
    first = request("first", tokens)
    compute(kv, first)
    kv.free(first)  # 6 cached blocks wait in the free queue
    waiting = request("waiting", tokens)
    assert kv.find_cached_prefix(waiting).num_tokens == 24
    other = request("other", list(range(500, 532)))
    assert kv.allocate(other, 32)  # takes all 8 blocks: every cached one is evicted
    kv.free(other)
    assert kv.find_cached_prefix(waiting).num_tokens == 0


@pytest.mark.parametrize("seed", range(20))
def test_remembered_hits_equal_fresh_lookups_under_churn(seed):
    """Random registrations, evictions and frees: a waiting request's remembered hit is always what a
    fresh lookup finds."""
    rng = random.Random(seed)
    kv = KVCacheManager(12, BS)
    prefixes = [[rng.randrange(1000) for _ in range(24)] for _ in range(3)]
    waiting = [request(f"w{i}", p + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))])
               for i, p in enumerate(prefixes)]
    running: list[Request] = []
    for step in range(60):
        action = rng.random()
        if action < 0.5 and kv.pool.num_free_blocks >= 7:
            p = rng.choice(prefixes)
            r = request(f"r{step}", p[:rng.randrange(4, 25)] + [rng.randrange(1000) for _ in range(rng.randrange(4))])
            compute(kv, r)
            running.append(r)
        elif running:
            kv.free(running.pop(rng.randrange(len(running))))
        for w in waiting:
            assert kv.find_cached_prefix(w).num_tokens == fresh_hit(kv, w.all_token_ids)
    assert kv.pool.num_evictions > 0  # the churn did evict


def test_preemption_evictions_count_only_blocks_whose_kv_was_written():
    kv = KVCacheManager(16, BS)
    r = request("r", list(range(100, 110)))  # 10 tokens
    assert kv.allocate(r, 10)
    r.num_computed_tokens = 10  # blocks 0-1 full and registered, block 2 holds 2 tokens
    kv.cache_full_blocks(r)
    r.all_token_ids += [1, 2, 3, 4, 5, 6]
    assert kv.allocate(r, 6)  # room for a 6-token chunk: block 3 is new, nothing written in it yet
    kv.free(r, preempted=True)
    assert kv.num_preemption_evictions == 1  # block 2 only: 0-1 stay cached, 3 never held anything


def test_a_resumed_request_is_not_looked_up_again(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=14, max_num_batched_tokens=64)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(30 + 5 * i)] for i in range(3)]
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert llm.core.scheduler.num_preemptions > 0
    stats = llm.stats()
    assert (stats.requests, stats.queries) == (3, sum(len(p) for p in prompts))  # one lookup per request


def test_block_ids_of_a_request():
    kv = KVCacheManager(8, BS)
    r = request("r", list(range(10)))
    assert kv.allocate(r, 10)
    assert kv.block_ids("r") == [0, 1, 2]


def test_a_duplicate_taking_over_a_hash_invalidates_remembered_hits():
    """The holder of a hash is reused while a live copy takes the hash over: no eviction is counted, yet a
    waiting request's remembered hit must move to the copy (the old holder now holds other tokens' KV)."""
    kv = KVCacheManager(6, BS)
    tokens = list(range(1, 2 * BS + 2))  # two full blocks and one more token
    holder = request("holder", tokens)
    compute(kv, holder)
    copy = request("copy", tokens)  # computes the same blocks without a hit: a live duplicate
    assert kv.allocate(copy, len(tokens))
    copy.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(copy)
    waiting = request("waiting", tokens)
    assert [b.block_id for b in kv.find_cached_prefix(waiting).blocks] == kv.block_ids("holder")[:2]
    kv.free(holder)  # its blocks go to the free queue, still the hash holders
    evictions = kv.pool.num_evictions
    taker = request("taker", list(range(100, 100 + 3 * BS)))
    assert kv.allocate(taker, 3 * BS)  # takes the holder's three blocks: both hashes pass to the copies
    assert kv.pool.num_evictions == evictions
    assert [b.block_id for b in kv.find_cached_prefix(waiting).blocks] == kv.block_ids("copy")[:2]


class _SavedBlocks:
    """A disk tier holding some blocks' K/V and the pins of a last run (what restore_pins reads of one)."""

    closed = False

    def __init__(self, hashes, pins: list[dict]) -> None:
        self.hashes, self.pins = set(hashes), pins

    def __contains__(self, block_hash) -> bool:
        return block_hash in self.hashes

    def load(self, block_hash, tokens):
        return b"kv" if block_hash in self.hashes else None

    def load_pins(self) -> list[dict]:
        return self.pins


def test_restoring_a_pin_never_evicts_a_block_it_already_found_in_ram(monkeypatch):
    """The first saved pin (3 blocks, over the cap of 2) is read back and refused: its blocks stay cached and
    free, the last of them first in line for eviction. The second pin starts with that block, found in RAM, and
    reads its next one from disk: the block found was not held, so the allocation evicted it and the pin held one
    block twice, the K/V of its second block under the first's place (a pin restored over a full pool)."""
    kv = KVCacheManager(3, BS, max_pinned_blocks=2)
    tokens = {name: tuple(range(i * BS, (i + 1) * BS)) for i, name in enumerate("xbac")}
    hashes = {name: bytes([i]) * 32 for i, name in enumerate("xbac")}

    def record(names: str, created_at: float) -> dict:
        return {"tenant": "t", "ttl_s": 300.0, "created_at": created_at, "expires_at": kv.pins.clock() + 300,
                "hits": 0, "blocks": [[hashes[n].hex(), list(tokens[n])] for n in names]}

    kv.disk = _SavedBlocks(hashes.values(), [record("xba", 1.0), record("ac", 2.0)])
    monkeypatch.setattr(kv, "kv_io", type("NoCopy", (), {"copy_in": lambda self, block_id, data: None})())
    assert kv.restore_pins() == 1
    [pin] = kv.pins.pins.values()
    assert [b.block_hash for b in pin.blocks] == [hashes["a"], hashes["c"]]
    assert len({b.block_id for b in pin.blocks}) == 2
