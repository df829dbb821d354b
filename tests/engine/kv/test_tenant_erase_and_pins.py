"""A tenant's erase and pins where tenants share a salt, the disk refuses, or the configuration changed: a damaged
block file passed to another tenant is dropped, never checksummed anew; a block read back from disk stays in the
cache of the tenant whose file it is; an erase the folder refuses says so (a 503) and never serves the files; a
pin is its tenant's own; pins saved under another salt secret or of a tenant gone are not restored; an erase
reaches the files and pins of other configurations."""
from __future__ import annotations

import asyncio
import errno
import json
import time

import torch

from engine import LLM, SamplingParams
from engine.kv import disk_tier
from engine.kv.disk_tier import DiskTier
from engine.kv.hashing import hash_full_blocks
from engine.kv.kv_io import KVBlockIO
from engine.kv.pins import REFUSED_TENANT_QUOTA
from engine.messages import CacheCommand
from tests.engine.kv.test_pins import BS as MINI_BS
from tests.engine.kv.test_pins import HOT, MiniEngine, check_invariants, flood, pin_all

BS = 16  # the engine's block size (the mini engine's is MINI_BS)


def greedy(n: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def erase(llm: LLM, tenant: str):
    return llm.core.cache_command(CacheCommand(1, "erase", tenant))


def kv_files(folder) -> set[str]:
    return {p.name for p in folder.glob("*/*.kv")}


# ---- 1. passing a file to another tenant verifies it first

def test_a_damaged_file_passed_to_another_tenant_is_dropped_not_checksummed_anew(tiny_llama_dir, tmp_path):
    """bob pins a prefix alice computed (a salt they share); alice's erase passes the files to bob, rewriting their
    tag and checksum. A file damaged on disk got a fresh checksum over its damaged bytes: after a restart it read as
    sound and bob's pinned prompt was answered from the damaged K/V (cached_tokens 64, another answer)."""
    prompt = HOT + [5]
    [expected] = LLM(str(tiny_llama_dir), num_kv_blocks=32, enable_prefix_caching=False).generate(prompt, greedy(8))
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=32, kv_disk_dir=str(tmp_path))
    llm.generate(prompt, greedy(), tenant="alice", cache_salt="shared")
    llm.generate(prompt, greedy(), tenant="bob", cache_salt="shared", cache=pin_all(ttl_s=3600))
    llm.core.kv.flush_to_disk()
    damaged = llm.core.kv.disk.dir / f"{hash_full_blocks(prompt, BS, cache_salt='shared')[1].hex()}.kv"
    data = bytearray(damaged.read_bytes())
    data[-416:-16] = b"\x7f" * 400  # a run of the K/V payload
    damaged.write_bytes(bytes(data))
    assert erase(llm, "alice").disk_blocks == 0  # every file of alice's is under bob's pin
    assert not damaged.exists() and llm.core.kv.disk.snapshot().corrupt == 1
    llm.close()  # bob's pinned blocks are still in RAM: the dropped one is written again, sound
    again = LLM(str(tiny_llama_dir), num_kv_blocks=32, kv_disk_dir=str(tmp_path))
    [out] = again.generate(prompt, greedy(8), tenant="bob", cache_salt="shared")
    assert out.token_ids == expected.token_ids
    again.close()


# ---- 2. a block read back from disk keeps its file's tenant

def test_a_block_read_back_from_disk_stays_in_the_cache_of_the_tenant_whose_file_it_is(tiny_llama_dir, tmp_path):
    """alice's prefix goes to disk; bob (the same salt) reads it back. It was cached in RAM as bob's, so alice's erase
    missed it and her next identical request was a full hit; hit in RAM (never spilled) it stayed hers, and went."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path), eviction_policy="lru")
    llm.generate(HOT + [5], greedy(), tenant="alice", cache_salt="shared")
    flood(llm, seed=1)
    llm.generate(HOT + [6], greedy(), tenant="bob", cache_salt="shared")
    assert llm.core.kv.num_disk_hit_tokens == len(HOT)
    erased = erase(llm, "alice")
    assert (erased.blocks, erased.disk_blocks) == (4, 4)
    [alice] = llm.generate(HOT + [7], greedy(), tenant="alice", cache_salt="shared")
    assert alice.num_cached_tokens == 0
    llm.close()


# ---- 3. an erase the folder refuses

def refuse_kv_deletes(monkeypatch) -> None:
    unlink = disk_tier.os.unlink

    def refuse(path, *args, **kwargs):
        if str(path).endswith(".kv"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(disk_tier.os, "unlink", refuse)


def test_block_files_an_erase_cannot_delete_are_counted_as_kept_never_served_and_deleted_later(
        tiny_llama_dir, tmp_path, monkeypatch):
    """The folder turned read-only: the erase said disk_blocks 4 and deleted none, and a restart indexed them
    again as the tenant's hits."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=24, kv_disk_dir=str(tmp_path))
    llm.generate(HOT + [5], greedy(), tenant="alice")
    llm.core.kv.flush_to_disk()
    files = kv_files(tmp_path)
    hashes = hash_full_blocks(HOT + [5], BS)
    with monkeypatch.context() as refused:
        refuse_kv_deletes(refused)
        erased = erase(llm, "alice")
        assert (erased.disk_blocks, erased.disk_blocks_kept) == (0, 4)
        assert kv_files(tmp_path) == files and not any(h in llm.core.kv.disk for h in hashes)  # never served
        llm.core.idle(False)  # tries again: still refused
        erased = erase(llm, "alice")
        assert (erased.disk_blocks, erased.disk_blocks_kept) == (0, 4)
    llm.core.idle(False)  # the folder lets them go now
    assert kv_files(tmp_path) == set()
    erased = erase(llm, "alice")
    assert (erased.disk_blocks, erased.disk_blocks_kept) == (0, 0)
    llm.close()


async def test_an_erase_that_leaves_block_files_behind_is_a_503_to_retry(tiny_llama_dir, tmp_path, monkeypatch):
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.app import create_app
    from gateway.settings import ApiKey
    from tests.support.gateway_helpers import tiny_settings

    settings = tiny_settings(tiny_llama_dir, keys=(ApiKey("sk-alice", "alice"),),
                             engine={"num_kv_blocks": 24, "kv_disk_dir": str(tmp_path)})
    alice = {"Authorization": "Bearer sk-alice"}
    async with TestClient(TestServer(create_app(settings))) as client:
        model = (await (await client.get("/v1/models", headers=alice)).json())["data"][0]["id"]
        resp = await client.post("/v1/completions", headers=alice, json={"model": model, "prompt": HOT,
                                                                          "max_tokens": 1})
        assert resp.status == 200
        deadline = time.monotonic() + 30
        while len(kv_files(tmp_path)) < 4 and time.monotonic() < deadline:  # written when the engine goes idle
            await asyncio.sleep(0.05)
        with monkeypatch.context() as refused:
            refuse_kv_deletes(refused)
            resp = await client.delete("/v1/cache", headers=alice)
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "cache_erase_incomplete"
        resp = await client.delete("/v1/cache", headers=alice)  # (or the idle moment before it deleted them)
        assert resp.status == 200 and (await resp.json())["deleted"] is True
        assert kv_files(tmp_path) == set()


# ---- 4. a pin is its tenant's

def test_a_pin_of_a_prefix_another_tenant_pinned_is_the_callers_own():
    """Tenants sharing a salt: b's pin of the prefix a pinned renewed a's pin, past b's quota, listed as a's (with b's
    TTL) and released by a's erase."""
    engine = MiniEngine(num_blocks=16, max_pinned_blocks=8)
    prefix = list(range(1, 9))  # 4 blocks
    engine.add(prefix + [99], "a", pin_all(ttl_s=300))
    engine.drain()
    over = engine.add(prefix + [98], "b", pin_all(ttl_s=3600, quota=2))
    engine.drain()
    assert over.num_cached_tokens == 8  # it hits a's blocks, but pins nothing beyond b's quota
    assert (over.pin_refused, over.num_pinned_tokens) == (REFUSED_TENANT_QUOTA, 0)
    [pin_a] = engine.kv.pins.list("a")
    assert (pin_a.ttl_s, pin_a.expires_at, pin_a.hits) == (300, pin_a.created_at + 300, 0)  # b's hit renews none
    assert engine.kv.pins.list("b") == [] and engine.kv.pins.tenant_blocks("b") == 0
    within = engine.add(prefix + [97], "b", pin_all(ttl_s=3600, quota=4))
    engine.drain()
    assert (within.pin_refused, within.num_pinned_tokens) == (None, 8)
    assert [p.ttl_s for p in engine.kv.pins.list("b")] == [3600] and engine.kv.pins.tenant_blocks("b") == 4
    assert [p.ttl_s for p in engine.kv.pins.list("a")] == [300]
    assert engine.kv.pins.num_blocks == 4  # the same blocks, held once
    assert engine.kv.erase("a").pins == 1
    assert engine.kv.pins.num_blocks == 4  # b's pin keeps the blocks
    assert engine.kv.pins.list("a") == [] and [p.ttl_s for p in engine.kv.pins.list("b")] == [3600]
    check_invariants(engine)
    hit = engine.add(prefix + [96], "b", None)
    engine.drain()
    assert (hit.num_cached_tokens, hit.num_pinned_tokens) == (8, 8)


# ---- 5. which saved pins a start restores

def attach_disk(engine: MiniEngine, path) -> None:
    io = KVBlockIO(torch.zeros(2, 1, len(engine.kv.pool.blocks), MINI_BS, 1, 2))
    engine.kv.use_disk_tier(DiskTier(path, 2**30, bytes(32), io.block_shape, torch.float32), io)


def test_pins_saved_under_another_salt_secret_or_of_a_tenant_gone_are_not_restored(tmp_path):
    """Restored, they were listed and held quota (the tenant's new pin of the same prompt was refused tenant_quota,
    another's pool_quota) while nothing could hit them (another secret) or list and erase them (a revoked key)."""
    first = MiniEngine(num_blocks=16, max_pinned_blocks=8)
    attach_disk(first, tmp_path)
    first.kv.restore_pins("salt-1", ["a", "gone"])
    first.add([1, 2, 3, 4, 5], "a", pin_all(ttl_s=3600))
    first.add([11, 12, 13, 14, 15], "gone", pin_all(ttl_s=3600))
    first.drain()
    first.kv.save_pins()
    first.kv.flush_to_disk()
    first.kv.disk.close()
    assert {r["salt"] for r in json.loads(next(tmp_path.glob("*/pins.json")).read_text())["pins"]} == {"salt-1"}

    same = MiniEngine(num_blocks=16, max_pinned_blocks=8)
    attach_disk(same, tmp_path)
    assert same.kv.restore_pins("salt-1", ["a"]) == 1  # the key of "gone" was revoked
    assert [p.num_tokens for p in same.kv.pins.list("a")] == [4] and same.kv.pins.list("gone") == []
    assert same.kv.pins.num_blocks == 2
    same.kv.disk.close()

    other = MiniEngine(num_blocks=16, max_pinned_blocks=8)
    attach_disk(other, tmp_path)
    assert other.kv.restore_pins("salt-2", ["a", "gone"]) == 0 and other.kv.pins.num_blocks == 0
    again = other.add([1, 2, 3, 4, 6], "a", pin_all(ttl_s=3600, quota=2))
    other.drain()
    assert (again.pin_refused, again.num_pinned_tokens) == (None, 4)
    other.kv.disk.close()


# ---- 6. an erase reaches the other configurations' files and pins

def test_an_erase_reaches_the_files_and_pins_saved_under_another_configuration(tiny_llama_dir, tmp_path):
    """alice erased her cache while the server ran with another kv dtype (another fingerprint folder): her files and
    pin of the first configuration were left, and back on it her prompt hit in full and her pin was listed. bob's pin
    there, of blocks alice computed under a salt they share, stays (bob's from then on)."""
    def first_configuration() -> LLM:
        return LLM(str(tiny_llama_dir), num_kv_blocks=24, kv_disk_dir=str(tmp_path))

    shared = list(range(300, 364))
    llm = first_configuration()
    llm.generate(HOT + [5], greedy(), tenant="alice", cache_salt="alice", cache=pin_all(ttl_s=3600))
    llm.generate(shared + [5], greedy(), tenant="alice", cache_salt="shared")
    llm.generate(shared + [6], greedy(), tenant="bob", cache_salt="shared", cache=pin_all(ttl_s=3600))
    llm.close()
    other = LLM(str(tiny_llama_dir), num_kv_blocks=24, kv_disk_dir=str(tmp_path), kv_cache_dtype="bfloat16")
    erased = erase(other, "alice")
    assert (erased.disk_blocks, erased.disk_blocks_kept) == (4, 0)  # HOT's; shared's are under bob's pin
    other.close()
    back = first_configuration()
    assert back.core.kv.pins.list("alice") == []
    [alice] = back.generate(HOT + [6], greedy(), tenant="alice", cache_salt="alice")
    assert alice.num_cached_tokens == 0
    assert [p.num_tokens for p in back.core.kv.pins.list("bob")] == [len(shared)]
    [bob] = back.generate(shared + [7], greedy(), tenant="bob", cache_salt="shared")
    assert bob.num_cached_tokens == len(shared)
    assert erase(back, "bob").disk_blocks == 4  # the files passed to bob: his erase takes them
    back.close()


def test_pins_of_an_engine_told_no_fingerprint_restore_under_any(tmp_path):
    """A cluster replica is handed no salt fingerprint: its pins are saved without one and come back under a
    gateway's own engine later, as pins saved before fingerprints did (they were all dropped as another secret's)."""
    replica = MiniEngine(num_blocks=16, max_pinned_blocks=8)
    attach_disk(replica, tmp_path)
    replica.kv.restore_pins()
    replica.add([1, 2, 3, 4, 5], "a", pin_all(ttl_s=3600))
    replica.drain()
    replica.kv.save_pins()
    replica.kv.flush_to_disk()
    replica.kv.disk.close()
    assert ["salt" in r for r in json.loads(next(tmp_path.glob("*/pins.json")).read_text())["pins"]] == [False]
    gateway_engine = MiniEngine(num_blocks=16, max_pinned_blocks=8)
    attach_disk(gateway_engine, tmp_path)
    assert gateway_engine.kv.restore_pins("salt-1", ["a"]) == 1
    gateway_engine.kv.disk.close()
