"""The disk tier: file format checks, its LRU bound, evicted blocks served back through the engine with the
same KV and tokens, corrupt files never served, a warm restart, and no block leaked under concurrency."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import random

import pytest
import torch

from bench.engine_faults import assert_blocks_released
from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv import disk_tier
from engine.kv.disk_tier import CorruptBlock, DiskTier, decode_block, encode_block
from engine.kv.hashing import BlockHash, hash_full_blocks

BS = 16
FP = bytes(range(32))
SHAPE = (2, 3, 4, 2, 8)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def greedy(max_tokens: int = 1, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)


def kv(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def h(n: int) -> BlockHash:
    return BlockHash(bytes([n]) * 32)


# ---- file format

def test_a_block_file_round_trips_bit_for_bit():
    data = encode_block(FP, h(1), (5, 6, 7), kv(0))
    assert torch.equal(decode_block(data, FP, h(1), (5, 6, 7), torch.float32, SHAPE), kv(0))


@pytest.mark.parametrize("damage, reason", [
    (lambda d: d[:-1], "checksum"),  # truncated
    (lambda d: d[:10], "truncated"),
    (lambda d: d[:100] + bytes([d[100] ^ 1]) + d[101:], "checksum"),  # one flipped bit in the KV
])
def test_a_damaged_file_is_rejected(damage, reason):
    data = encode_block(FP, h(1), (5, 6, 7), kv(0))
    with pytest.raises(CorruptBlock, match=reason):
        decode_block(damage(data), FP, h(1), (5, 6, 7), torch.float32, SHAPE)


def test_a_file_of_another_model_hash_or_tokens_is_rejected():
    data = encode_block(FP, h(1), (5, 6, 7), kv(0))
    with pytest.raises(CorruptBlock, match="model"):
        decode_block(data, bytes(32), h(1), (5, 6, 7), torch.float32, SHAPE)
    with pytest.raises(CorruptBlock, match="hash"):
        decode_block(data, FP, h(2), (5, 6, 7), torch.float32, SHAPE)
    with pytest.raises(CorruptBlock, match="token ids"):  # a hash collision never serves other tokens
        decode_block(data, FP, h(1), (5, 6, 8), torch.float32, SHAPE)
    with pytest.raises(CorruptBlock, match="payload"):
        decode_block(data, FP, h(1), (5, 6, 7), torch.float64, SHAPE)


# ---- the tier

def make_tier(path, max_bytes: int = 2**30) -> DiskTier:
    return DiskTier(path, max_bytes, FP, SHAPE, torch.float32)


def test_put_then_a_new_tier_indexes_and_serves_the_block(tmp_path):
    tier = make_tier(tmp_path)
    assert tier.put(h(1), (1, 2), kv(1))
    assert h(1) in tier  # servable while the write is pending
    tier.close()
    again = make_tier(tmp_path)
    assert h(1) in again and h(2) not in again
    assert torch.equal(again.load(h(1), (1, 2))[0], kv(1))
    assert again.load(h(1), (1, 3)) is None  # other tokens: a miss
    again.close()


def test_a_corrupt_file_is_dropped_with_a_warning_and_not_served(tmp_path, caplog):
    tier = make_tier(tmp_path)
    tier.put(h(1), (1, 2), kv(1))
    tier.flush()
    path = next(tier.dir.glob("*.kv"))
    data = bytearray(path.read_bytes())
    data[200] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "prefixgate.engine"):
        assert tier.load(h(1), (1, 2)) is None
    assert "checksum" in caplog.text
    assert not path.exists() and h(1) not in tier and tier.snapshot().corrupt == 1
    tier.close()


def test_the_tier_is_bounded_by_its_own_lru(tmp_path):
    size = len(encode_block(FP, h(0), (1, 2), kv(0)))
    tier = make_tier(tmp_path, max_bytes=3 * size)
    for n in range(3):
        tier.put(h(n), (1, 2), kv(n))
    tier.flush()
    assert tier.load(h(0), (1, 2)) is not None  # h(0) becomes the most recently used
    tier.put(h(3), (1, 2), kv(3))
    tier.flush()
    assert [h(n) in tier for n in range(4)] == [True, False, True, True]
    stats = tier.snapshot()
    assert stats.files == 3 and stats.bytes == 3 * size and stats.evictions == 1
    tier.close()


def test_another_model_fingerprint_uses_another_folder(tmp_path):
    tier = make_tier(tmp_path)
    tier.put(h(1), (1, 2), kv(1))
    tier.close()
    other = DiskTier(tmp_path, 2**30, bytes(32), SHAPE, torch.float32)
    assert h(1) not in other
    other.close()


# ---- through the engine

HOT = tokens(4 * BS + 1, seed=0)
OTHERS = [tokens(4 * BS + 1, seed=10 + i) for i in range(4)]


def make_llm(model_dir, disk_dir, **overrides) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=12, kv_disk_dir=str(disk_dir), eviction_policy="lru", **overrides)


def evict_hot(llm: LLM) -> None:
    for prompt in OTHERS:
        llm.generate(prompt, greedy())
    assert not any(hh in llm.core.kv.pool.cached for hh in hash_full_blocks(HOT, BS))
    llm.core.kv.disk.flush()


def test_an_evicted_block_comes_back_from_disk_with_identical_kv_and_logits(tiny_llama_dir, tmp_path):
    llm = make_llm(tiny_llama_dir, tmp_path)
    first = llm.generate(HOT, greedy(4, logprobs=3))[0]
    pool, kv_cache = llm.core.kv.pool, llm.core.kv.kv_io.kv_cache
    hashes = hash_full_blocks(HOT, BS)
    computed = [kv_cache[:, :, pool.cached[hh].block_id].clone() for hh in hashes]
    hit_in_ram = llm.generate(HOT, greedy(4, logprobs=3))[0]
    evict_hot(llm)
    from_disk = llm.generate(HOT, greedy(4, logprobs=3))[0]
    assert from_disk.num_cached_tokens == 64 and llm.stats().disk_hits == 64
    for hh, expected in zip(hashes, computed):
        assert torch.equal(kv_cache[:, :, pool.cached[hh].block_id], expected)
    assert from_disk.token_ids == hit_in_ram.token_ids == first.token_ids
    assert [t.logprob for t in from_disk.logprobs] == [t.logprob for t in hit_in_ram.logprobs]
    assert llm.stats().evictions_spill >= 4 and llm.stats().regrets == 0


def test_a_corrupt_block_file_is_computed_instead(tiny_llama_dir, tmp_path, caplog):
    llm = make_llm(tiny_llama_dir, tmp_path)
    expected = llm.generate(HOT, greedy(4))[0].token_ids
    evict_hot(llm)
    disk = llm.core.kv.disk
    second_block = disk.dir / f"{hash_full_blocks(HOT, BS)[1].hex()}.kv"
    second_block.write_bytes(second_block.read_bytes()[:-100])  # truncated
    with caplog.at_level(logging.WARNING, "prefixgate.engine"):
        out = llm.generate(HOT, greedy(4))[0]
    assert out.num_cached_tokens == BS  # block 0 from disk; block 1 failed its check, the rest computed
    assert out.token_ids == expected
    assert "dropping" in caplog.text and not second_block.exists()
    assert llm.stats().disk.corrupt == 1 and llm.stats().disk_hits == BS
    assert all(b.ref_cnt == 0 for b in llm.core.kv.pool.blocks)


def test_a_restart_serves_the_first_repeated_prompt_from_disk(tiny_llama_dir, tmp_path):
    llm = make_llm(tiny_llama_dir, tmp_path)
    expected = llm.generate(HOT, greedy(4))[0].token_ids
    llm.close()  # graceful shutdown: the cached RAM blocks go to disk
    restarted = make_llm(tiny_llama_dir, tmp_path)
    out = restarted.generate(HOT, greedy(4))[0]
    assert out.num_cached_tokens == 64 and out.token_ids == expected
    assert restarted.stats().disk_hits == 64
    restarted.close()


@pytest.mark.slow
@pytest.mark.parametrize("change", [{"block_size": 8}, {"dtype": "bfloat16"}, {"kv_cache_dtype": "bfloat16"},
                                    {"hash_algo": "xxhash"}])
def test_a_model_dtype_or_block_size_change_never_serves_old_files(tiny_llama_dir, tmp_path, change):
    llm = make_llm(tiny_llama_dir, tmp_path)
    llm.generate(HOT, greedy())
    llm.close()
    changed = make_llm(tiny_llama_dir, tmp_path, **change)
    assert changed.generate(HOT, greedy())[0].num_cached_tokens == 0
    assert changed.stats().disk.files == 0
    changed.close()


def test_another_model_never_reads_the_files(tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    llm = make_llm(tiny_llama_dir, tmp_path)
    llm.generate(HOT, greedy())
    llm.close()
    other = make_llm(tiny_qwen2_dir, tmp_path)
    assert other.generate(HOT, greedy())[0].num_cached_tokens == 0
    other.close()


async def test_concurrent_eviction_and_reload_leak_no_block(tiny_llama_dir, tmp_path):
    prefixes = [tokens(3 * BS, seed=50 + i) for i in range(4)]
    rng = random.Random(1)
    prompts = [rng.choice(prefixes) + tokens(rng.randrange(1, 20), seed=1000 + i) for i in range(24)]
    reference = LLM(str(tiny_llama_dir), num_kv_blocks=64, enable_prefix_caching=False)
    expected = [o.token_ids for o in reference.generate(prompts, greedy(3))]
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=10, max_num_seqs=3,
                                                  kv_disk_dir=str(tmp_path)))
    engine.start()

    async def run(i: int, prompt: list[int]) -> list[int]:
        out = []
        async for delta in engine.generate(f"r{i}", prompt, greedy(3)):
            out += delta.new_token_ids
        return out

    results = []
    for wave in range(3):  # waves: later ones hit blocks spilled by earlier ones
        results += await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts) if i % 3 == wave))
    order = [i for wave in range(3) for i in range(len(prompts)) if i % 3 == wave]
    assert results == [expected[i] for i in order]
    stats = engine.core.prefix_cache_stats()
    assert stats.disk_hits > 0 and stats.evictions_spill > 0
    assert_blocks_released(engine)
    await engine.shutdown()
    assert engine.core.kv.disk.closed


@pytest.mark.parametrize("salt_secrets, expected", [(["fixed-secret"] * 2, [0, 64]),
                                                     ([None, None], [0, 64]),  # the kept secret
                                                     (["one", "another"], [0, 0])])
async def test_a_gateway_restart_hits_the_disk_tier_while_the_salt_secret_stays(tiny_llama_dir, tmp_path, monkeypatch,
                                                                                salt_secrets, expected):
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.app import create_app
    from gateway.settings import load_settings

    monkeypatch.setenv("PREFIXGATE_CACHE", str(tmp_path / "home"))  # where an unset secret is kept
    cached = []
    for salt_secret in salt_secrets:  # the second server starts after the first shut down gracefully
        # the engine in process: the salt secret is the API side's; the engine process's shutdown writing its
        # blocks to disk is the next test's
        settings = load_settings(None, engine_overrides=dict(model=str(tiny_llama_dir), num_kv_blocks=12,
                                                             kv_disk_dir=str(tmp_path / "kv")),
                                 gateway_overrides=dict(salt_secret=salt_secret, engine_process=False))
        async with TestClient(TestServer(create_app(settings))) as client:
            model = (await (await client.get("/v1/models")).json())["data"][0]["id"]
            resp = await client.post("/v1/completions", json={"model": model, "prompt": HOT, "max_tokens": 1,
                                                              "temperature": 0})
            assert resp.status == 200, await resp.text()
            cached.append((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == expected


@pytest.mark.server
async def test_usage_says_what_came_from_disk_and_what_was_written(tiny_llama_dir, tmp_path):
    """With the engine in a process of its own (create_app's default): its SIGTERM at shutdown writes the
    cached blocks to disk for the next server."""
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.app import create_app
    from gateway.settings import load_settings

    settings = load_settings(None, engine_overrides=dict(model=str(tiny_llama_dir), num_kv_blocks=12,
                                                         kv_disk_dir=str(tmp_path), eviction_policy="lru"),
                             gateway_overrides=dict(salt_secret="fixed"))
    details = []
    for _ in range(2):  # the second server starts after the first shut down and wrote its blocks to disk
        async with TestClient(TestServer(create_app(settings))) as client:
            model = (await (await client.get("/v1/models")).json())["data"][0]["id"]
            for _ in range(2):
                resp = await client.post("/v1/completions", json={"model": model, "prompt": HOT, "max_tokens": 1,
                                                                  "temperature": 0})
                details.append((await resp.json())["usage"]["prompt_tokens_details"])
    full = 4 * BS  # HOT's full blocks
    unpinned = {"pinned_tokens": 0, "pinned_until": None}
    assert details == [{"cached_tokens": 0, "disk_cached_tokens": 0, "cache_write_tokens": full, **unpinned},
                       {"cached_tokens": full, "disk_cached_tokens": 0, "cache_write_tokens": 0, **unpinned},  # RAM
                       {"cached_tokens": full, "disk_cached_tokens": full, "cache_write_tokens": 0, **unpinned},
                       {"cached_tokens": full, "disk_cached_tokens": 0, "cache_write_tokens": 0, **unpinned}]


def test_a_fifo_in_a_block_files_place_is_a_miss_not_a_hang(tmp_path, caplog):
    """A reader of a FIFO waits for a writer: the step that read it would never end."""
    import threading
    tier = make_tier(tmp_path)
    tier.put(h(1), (1, 2), kv(1))
    tier.put(h(2), (1, 2), kv(2))
    tier.flush()
    paths = sorted(tier.dir.glob("*.kv"))
    for path in paths:
        path.unlink()
        os.mkfifo(path)
    (tier.dir / "pins.json").unlink(missing_ok=True)
    results = []

    def run():
        results.append(tier.load(h(1), (1, 2)))
        results.append(disk_tier._owner(paths[1]))
        try:
            disk_tier._retagged(paths[1], "t")
        except OSError as exc:
            results.append(exc.errno)
        tier.close()
        again = make_tier(tmp_path)  # a new start indexes regular files alone
        results.append(h(2) in again)
        again.close()

    worker = threading.Thread(target=run, daemon=True)
    with caplog.at_level(logging.WARNING, "prefixgate.engine"):
        worker.start()
        worker.join(timeout=30)
    assert not worker.is_alive(), "a read of the FIFO is waiting for a writer"
    assert results == [None, None, errno.EINVAL, False]
    assert "not a regular file" in caplog.text and h(1) not in tier
