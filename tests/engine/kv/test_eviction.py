"""Eviction policies through the real engine: a scan of one-off prompts against a hot prefix, with exact
block-level outcomes, and the eviction accounting (reasons, regret) the metrics export; and through the KV
cache manager alone (no model), the request patterns that decide between the policies."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import EvictionPolicy
from engine.kv.hashing import hash_full_blocks
from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request

BS = 16
POOL = 16  # blocks: the hot prompt (5) plus room for a few one-off prompts


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def greedy(max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


HOT = tokens(4 * BS + 1, seed=0)  # 4 hittable blocks
SCAN = [tokens(4 * BS + 1, seed=100 + i) for i in range(6)]  # one-off prompts, 5 blocks each in use


def run_scan(model_dir, policy: str) -> tuple[LLM, list[int]]:
    """Hot prompt twice (the second time a hit), then the scan one prompt at a time, then the hot prompt."""
    llm = LLM(str(model_dir), num_kv_blocks=POOL, eviction_policy=policy)
    cached = [llm.generate(HOT, greedy())[0].num_cached_tokens, llm.generate(HOT, greedy())[0].num_cached_tokens]
    for prompt in SCAN:
        assert llm.generate(prompt, greedy())[0].num_cached_tokens == 0
    llm.ghosts_before_last = list(llm.core.kv.pool.ghosts)
    cached.append(llm.generate(HOT, greedy())[0].num_cached_tokens)
    return llm, cached


def hot_hashes() -> list[bytes]:
    return hash_full_blocks(HOT, BS)


def test_slru_keeps_the_hot_prefix_through_a_scan(tiny_llama_dir):
    llm, cached = run_scan(tiny_llama_dir, "slru")
    assert cached == [0, 64, 64]
    pool = llm.core.kv.pool
    assert all(h in pool.cached for h in hot_hashes())
    # the scan evicted its own blocks only: 6 prompts x 4 full blocks, minus what the pool still holds
    scan_hashes = {h for p in SCAN for h in hash_full_blocks(p, BS)}
    assert set(pool.ghosts) <= scan_hashes
    assert pool.evictions["capacity"] == len(scan_hashes) - sum(h in pool.cached for h in scan_hashes)
    assert pool.num_regrets == 0


def test_lru_loses_the_hot_prefix_to_the_same_scan(tiny_llama_dir):
    llm, cached = run_scan(tiny_llama_dir, "lru")
    assert cached == [0, 64, 0]
    pool = llm.core.kv.pool
    # all 4 hot blocks were evicted and asked for again: 4 regrets
    assert all(h in llm.ghosts_before_last for h in hot_hashes())
    assert pool.num_regrets == 4
    assert all(h in pool.cached for h in hot_hashes())


def test_eviction_stats_carry_reasons_and_per_tenant_regrets(tiny_llama_dir):
    from engine.request import Request

    llm = LLM(str(tiny_llama_dir), num_kv_blocks=8, eviction_policy="lru")
    core = llm.core

    def run(request_id: str, prompt: list[int], tenant: str):
        core.add_request(Request(request_id, prompt, greedy(), tenant=tenant))
        regrets: dict[str, int] = {}
        while core.has_unfinished():
            _, stats = core.step()
            for t, n in stats.tenant_regrets.items():
                regrets[t] = regrets.get(t, 0) + n
        return regrets

    assert run("a", HOT, "alice") == {}
    # 5 blocks in an 8-block pool: alice's hashless tail block and 3 unused ones, then her 4th block
    assert run("b", SCAN[0], "bob") == {}
    stats = core.prefix_cache_stats()
    assert stats.evictions_capacity == 1 and stats.evictions_spill == 0 and stats.regrets == 0
    assert run("c", HOT, "alice") == {"alice": 1}  # 3 blocks hit, the 4th asked for again
    assert core.prefix_cache_stats().regrets == 1


@pytest.mark.parametrize("policy", ["lru", "slru"])
def test_both_policies_give_the_same_tokens_as_no_cache(tiny_llama_dir, policy):
    prompts = [HOT, *SCAN[:3], HOT, SCAN[0], HOT]
    off = LLM(str(tiny_llama_dir), num_kv_blocks=POOL, enable_prefix_caching=False)
    on = LLM(str(tiny_llama_dir), num_kv_blocks=POOL, eviction_policy=policy)
    expected = [o.token_ids for o in off.generate(prompts, greedy(6))]
    assert [on.generate(p, greedy(6))[0].token_ids for p in prompts] == expected
    assert all(b.ref_cnt == 0 for b in on.core.kv.pool.blocks)


def cached_blocks(prompts: list[list[int]], num_blocks: int, policy: str, block_size: int) -> list[int]:
    """Blocks hit by each prompt, run one at a time through the KV cache manager (no model)."""
    kv = KVCacheManager(num_blocks, block_size, eviction_policy=EvictionPolicy(policy))
    hits = []
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", prompt, greedy())
        prefix = kv.find_cached_prefix(request)
        assert kv.allocate(request, len(prompt) - prefix.num_tokens, prefix)
        request.num_computed_tokens = len(prompt)
        kv.cache_full_blocks(request)
        kv.free(request)
        hits.append(prefix.num_tokens // block_size)
    return hits


def test_slru_keeps_a_hot_prompt_between_bursts_of_one_off_prompts():
    # issue 14's scan: one hot ~1,000-token prompt (62 full blocks), then 3 unique ones, in a 200-block pool
    hot = tokens(1000, seed=1)
    prompts = [hot + tokens(24, seed=2)]
    for r in range(12):
        prompts += [hot + tokens(24, seed=10 + r)] + [tokens(1000, seed=100 + 3 * r + i) for i in range(3)]
    slru, lru = (cached_blocks(prompts, 200, policy, BS)[1::4] for policy in ("slru", "lru"))
    assert slru == [62] * 12
    assert lru == [62] + [13] * 11  # the bursts flush all but the hot prompt's first 13 blocks (freed last)


def test_slru_learns_a_recency_pattern_that_a_fixed_protected_share_loses():
    """issue 14's rag diagnosis, scaled down: an instruction plus one of four documents, the pool holding about
    1.75 of them. A document hit once is protected and, under a fixed protected share (80%), stays so long after
    it went cold, while the probation left over holds one document: each new one is flushed before its second
    use (176 blocks hit; LRU 253). Ghost hits on the flushed blocks shrink the protected share instead."""
    bs, instruction = 4, tokens(4 * 4, seed=0)
    docs = {d: tokens(32 * 4, seed=10 + d) for d in (0, 1, 3, 7)}
    order = [0, 1, 0, 3, 3, 1, 3, 7, 0, 7, 1, 1, 7, 3, 7, 0]
    prompts = [instruction + docs[d] + tokens(5, seed=100 + i) for i, d in enumerate(order)]
    lru = cached_blocks(prompts, 64, "lru", bs)
    slru = cached_blocks(prompts, 64, "slru", bs)
    assert lru == [0, 4, 30, 4, 36, 4, 30, 4, 4, 30, 4, 36, 29, 4, 30, 4]
    assert slru == [0, 4, 30, 4, 36, 4, 30, 4, 4, 28, 4, 36, 29, 4, 30, 4]
