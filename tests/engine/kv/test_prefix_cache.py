"""The prefix cache through the real engine: exact cached-token counts, stats and eviction order.

Prompts are token-id lists so the block math is exact: block_size 16, a hit covers whole cached blocks
and at most len(prompt) - 1 tokens; a request that generated M tokens after an L-token prompt has
computed (and registered) floor((L + M - 1) / 16) full blocks, since the last sampled token's K/V is
never computed.
"""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.kv.hashing import hash_full_blocks

BS = 16


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def make_llm(model_dir, **overrides) -> LLM:
    overrides.setdefault("num_kv_blocks", 64)
    return LLM(str(model_dir), **overrides)


def run(llm: LLM, prompt: list[int], max_tokens: int = 1, cache_salt: str | None = None):
    [out] = llm.generate(prompt, greedy(max_tokens), cache_salt=cache_salt)
    assert len(out.token_ids) == max_tokens
    return out


def cached_block_ids(llm: LLM) -> dict[bytes, int]:
    return {h: b.block_id for h, b in llm.core.kv.pool.cached.items()}


def assert_released(llm: LLM) -> None:
    """Nothing is referenced once every request has finished."""
    pool = llm.core.kv.pool
    assert [b.ref_cnt for b in pool.blocks] == [0] * len(pool.blocks)
    assert pool.num_free_blocks == len(pool.blocks) == len(list(pool.free_queue))
    assert llm.core.kv.block_tables == {}
    assert not llm.core.scheduler.running and not llm.core.scheduler.waiting
    assert llm.stats().usage == 0.0


@pytest.mark.parametrize("prompt_len, max_tokens, expected_cached, expected_blocks", [
    (48, 4, 32, 3),  # 3 full prompt blocks cached, but the hit stops at 47 tokens: 2 blocks
    (49, 4, 48, 3),  # one token past the boundary: all 3 blocks hit
    (47, 4, 32, 3),  # block 2 is full only with the first output token in it
    (17, 4, 16, 1),
    (16, 4, 0, 1),  # a one-block prompt can never hit: its last token is always computed
    (16, 1, 0, 1),  # computed 16 tokens: the prompt block is registered even with no decode
])
def test_identical_prompt_hits_every_full_block_but_never_the_last_token(
        tiny_llama_dir, prompt_len, max_tokens, expected_cached, expected_blocks):
    llm = make_llm(tiny_llama_dir)
    prompt = tokens(prompt_len, seed=1)
    first = run(llm, prompt, max_tokens)
    assert first.num_cached_tokens == 0
    assert llm.stats().cached_blocks == expected_blocks == (prompt_len + max_tokens - 1) // BS
    second = run(llm, prompt, max_tokens)
    assert second.num_cached_tokens == expected_cached
    assert second.token_ids == first.token_ids  # the cache never changes an answer
    stats = llm.stats()
    assert (stats.queries, stats.hits, stats.requests) == (2 * prompt_len, expected_cached, 2)
    assert stats.cached_blocks == expected_blocks  # the recomputed copy stays private
    assert stats.evictions_capacity == 0
    assert_released(llm)


def test_shared_prefix_with_different_suffixes(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prefix = tokens(40, seed=2)  # 2.5 blocks: block 2 mixes prefix and suffix tokens
    a, b, c = prefix + tokens(20, seed=3), prefix + tokens(20, seed=4), prefix[:32] + tokens(30, seed=5)
    assert run(llm, a).num_cached_tokens == 0
    assert run(llm, b).num_cached_tokens == 32
    assert run(llm, c).num_cached_tokens == 32
    stats = llm.stats()
    assert (stats.queries, stats.hits, stats.requests) == (60 + 60 + 62, 64, 3)
    # a: 3 full blocks; b: its own block 2; c: its own blocks 2 and 3 (62 tokens computed)
    assert stats.cached_blocks == 3 + 1 + 1
    assert_released(llm)


def test_no_shared_prefix_hits_nothing_and_caches_both(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    a, b = tokens(48, seed=6), tokens(48, seed=7)
    assert run(llm, a).num_cached_tokens == 0
    assert run(llm, b).num_cached_tokens == 0
    pool = llm.core.kv.pool
    assert set(pool.cached) == set(hash_full_blocks(a, BS)) | set(hash_full_blocks(b, BS))
    assert len(pool.cached) == 6
    # a took blocks 0-2; after a was freed (tail first) the queue starts with the never-used block 3
    assert cached_block_ids(llm) == dict(zip(hash_full_blocks(a, BS) + hash_full_blocks(b, BS), [0, 1, 2, 3, 4, 5]))
    stats = llm.stats()
    assert (stats.queries, stats.hits, stats.requests, stats.cached_blocks) == (96, 0, 2, 6)
    assert_released(llm)


def test_lru_evicts_the_oldest_prompt_first(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_kv_blocks=4)
    a, b, c = tokens(32, seed=8), tokens(32, seed=9), tokens(32, seed=10)
    for prompt in (a, b, c):  # two blocks each; the pool holds two prompts
        assert run(llm, prompt).num_cached_tokens == 0
    ha, hb, hc = (hash_full_blocks(p, BS) for p in (a, b, c))
    # free queue after b: [1, 0, 3, 2] (a's blocks, each request tail first), so c takes a's blocks
    assert cached_block_ids(llm) == {hb[0]: 2, hb[1]: 3, hc[0]: 1, hc[1]: 0}
    assert llm.stats().evictions_capacity == 2
    assert run(llm, b + [7]).num_cached_tokens == 32  # b (the middle one) still hits in full
    assert run(llm, a + [7]).num_cached_tokens == 0  # a (the oldest) is gone
    assert_released(llm)


def test_lru_evicts_a_prompts_suffix_before_its_prefix(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_kv_blocks=5)
    a, b, c = tokens(32, seed=11), tokens(32, seed=12), tokens(32, seed=13)
    for prompt in (a, b, c):
        assert run(llm, prompt).num_cached_tokens == 0
    ha, hb, hc = (hash_full_blocks(p, BS) for p in (a, b, c))
    # free queue after b: [4, 1, 0, 3, 2]: c takes the unused block 4 and a's last block 1
    assert cached_block_ids(llm) == {ha[0]: 0, hb[0]: 2, hb[1]: 3, hc[0]: 4, hc[1]: 1}
    assert llm.stats().evictions_capacity == 1
    assert run(llm, a + [7]).num_cached_tokens == 16  # a's prefix block outlived its suffix
    assert_released(llm)


@pytest.mark.parametrize("answer_len, expected_cached", [
    (25, 64),  # 40 + 25 - 1 = 64 computed: 4 blocks, the last two made of answer tokens
    (24, 48),  # 63 computed: block 3 holds the last answer token, whose K/V was never computed
])
def test_next_turn_hits_the_previous_prompt_and_answer(tiny_llama_dir, answer_len, expected_cached):
    llm = make_llm(tiny_llama_dir)
    turn1 = tokens(40, seed=14)
    answer = run(llm, turn1, max_tokens=answer_len).token_ids
    assert llm.stats().cached_blocks == (40 + answer_len - 1) // BS
    turn2 = turn1 + answer + tokens(10, seed=15)
    out = run(llm, turn2, max_tokens=3)
    assert out.num_cached_tokens == expected_cached
    assert expected_cached > 32  # more than turn 1's prompt blocks alone
    stats = llm.stats()
    assert (stats.queries, stats.hits) == (40 + len(turn2), expected_cached)
    assert stats.cached_blocks == (len(turn2) + 3 - 1) // BS
    assert_released(llm)


def test_different_cache_salts_never_share_a_block(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prompt = tokens(48, seed=16)
    salts = ["tenant-a", "tenant-b", None]
    for salt in salts:
        assert run(llm, prompt, cache_salt=salt).num_cached_tokens == 0
    pool = llm.core.kv.pool
    expected = {h for s in salts for h in hash_full_blocks(prompt, BS, cache_salt=s)}
    assert set(pool.cached) == expected and len(expected) == 9
    for salt in salts:
        assert run(llm, prompt, cache_salt=salt).num_cached_tokens == 32
    assert run(llm, prompt, cache_salt="tenant-c").num_cached_tokens == 0
    stats = llm.stats()
    assert (stats.requests, stats.hits, stats.cached_blocks) == (7, 3 * 32, 12)
    assert_released(llm)


def test_prefix_caching_disabled_never_hits(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    prompt = tokens(48, seed=17)
    first = run(llm, prompt, max_tokens=4)
    outs = llm.generate([prompt, prompt], greedy(4))
    assert [first.num_cached_tokens] + [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert all(o.token_ids == first.token_ids for o in outs)
    stats = llm.stats()
    assert (stats.queries, stats.hits, stats.requests, stats.cached_blocks) == (144, 0, 3, 0)
    assert llm.core.kv.pool.cached == {}
    assert_released(llm)


def test_min_shared_prefix_tokens_drops_short_hits(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, min_shared_prefix_tokens=48)
    short, long_ = tokens(48, seed=18), tokens(64, seed=19)
    assert run(llm, short).num_cached_tokens == 0
    assert run(llm, short).num_cached_tokens == 0  # a 32-token hit is below the floor
    assert run(llm, long_).num_cached_tokens == 0
    assert run(llm, long_).num_cached_tokens == 48  # 3 blocks reach the floor
    assert run(llm, long_[:48] + tokens(20, seed=20)).num_cached_tokens == 48
    assert run(llm, long_[:32] + tokens(20, seed=21)).num_cached_tokens == 0
    stats = llm.stats()
    assert stats.hits == 96
    assert_released(llm)


def record_prefill_tokens(llm: LLM) -> list[int]:
    """The prompt tokens each engine step computes, appended as the steps run."""
    prefill_tokens = []
    step = llm.core.step

    def counting_step():
        outputs, stats = step()
        prefill_tokens.append(stats.num_prompt_tokens)
        return outputs, stats

    llm.core.step = counting_step
    return prefill_tokens


@pytest.mark.parametrize("budget", [32, 64, 256])
def test_concurrent_prompts_compute_a_shared_prefix_once(tiny_llama_dir, budget):
    """Four prompts sharing 96 tokens, submitted together: the prefix is computed by the first only.

    With a budget of 32 the first prefill uses the whole budget until its prefix is done. With 64 and
    256 the others would be admitted while it still runs, and only the scheduler's deferral lets them
    hit it: at 64 they wait for a running prefill's pending blocks, at 256 for those of a request
    admitted earlier in the same step.
    """
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=budget)
    prefill_tokens = record_prefill_tokens(llm)
    shared = tokens(96, seed=22)
    prompts = [shared + tokens(16, seed=23 + i) for i in range(4)]
    outs = llm.generate(prompts, greedy(2))
    assert [o.num_cached_tokens for o in outs] == [0, 96, 96, 96]
    assert sum(prefill_tokens) == 96 + 4 * 16
    stats = llm.stats()
    assert (stats.queries, stats.hits, stats.requests) == (4 * 112, 3 * 96, 4)
    assert_released(llm)


@pytest.mark.parametrize("budget", [32, 256])
def test_concurrent_identical_prompts_hit_up_to_the_last_token_cap(tiny_llama_dir, budget):
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=budget)
    prompt = tokens(96, seed=30)
    outs = llm.generate([prompt] * 4, greedy(2))
    assert [o.num_cached_tokens for o in outs] == [0, 80, 80, 80]  # (96 - 1) // 16 = 5 blocks
    assert all(o.token_ids == outs[0].token_ids for o in outs)
    stats = llm.stats()
    assert (stats.queries, stats.hits, stats.cached_blocks) == (4 * 96, 3 * 80, 6)
    assert_released(llm)


def test_identical_block_aligned_prompts_are_admitted_together(tiny_llama_dir):
    """Waiting requests are deferred only for a block they could hit.

    Four identical 96-token prompts: the first computes all 6 blocks; the others can hit at most 5
    ((96 - 1) // 16), so block 5 is computed by each of them anyway. Waiting for somebody else to
    compute block 5 gains nothing: all three should be admitted in step 2.
    """
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=512)
    prefill_tokens = record_prefill_tokens(llm)
    prompt = tokens(96, seed=31)
    outs = llm.generate([prompt] * 4, greedy(2))
    assert [o.num_cached_tokens for o in outs] == [0, 80, 80, 80]
    assert prefill_tokens == [96, 3 * 16, 0]
    assert_released(llm)
