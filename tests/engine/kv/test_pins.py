"""Pinned prefixes (engine/kv/pins.py): the pool's invariants under pins, quotas, TTL renewal and expiry,
pins giving way where a request could not run otherwise (property-tested over pin, expire, erase, allocate
and free through the real scheduler, no model), and the engine: a pinned prefix survives a flood that
evicts it unpinned, DELETE-style erasure in RAM and on disk touches one tenant only, and pins come back
after a restart through the disk tier with their wall-clock expiry."""
from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.pins import REFUSED_NOT_CACHED, REFUSED_POOL_QUOTA, REFUSED_TENANT_QUOTA
from engine.messages import CacheBreakpoint, CacheCommand, CacheDirectives, PinList
from engine.request import Request
from engine.sampling_params import SampledToken
from engine.scheduler import Scheduler

BS = 2


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def pin_all(ttl_s: float = 300.0, quota: int | None = None) -> CacheDirectives:
    return CacheDirectives((CacheBreakpoint(10**9, ttl_s),), quota)


class MiniEngine:
    """The real scheduler and KV cache manager, with every scheduled token "computed" at once and one token
    sampled per step after the prompt: the engine's step without a model."""

    def __init__(self, num_blocks: int = 12, max_pinned_blocks: int = 6, policy: str = "lru",
                 enable_caching: bool = True) -> None:
        config = EngineConfig(model="none", block_size=BS, num_kv_blocks=num_blocks, max_num_batched_tokens=8,
                              max_num_seqs=4, eviction_policy=policy)
        self.kv = KVCacheManager(num_blocks, BS, enable_caching=enable_caching, eviction_policy=config.eviction_policy,
                                 max_pinned_blocks=max_pinned_blocks)
        self.clock = Clock()
        self.kv.pins.clock = self.clock
        self.scheduler = Scheduler(config, self.kv)
        self.requests: dict[str, Request] = {}
        self._ids = 0

    def add(self, tokens: list[int], tenant: str, cache: CacheDirectives | None, max_tokens: int = 2) -> Request:
        self._ids += 1
        request = Request(f"r{self._ids}", tokens, SamplingParams(max_tokens=max_tokens), tenant=tenant,
                          cache=cache)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request

    def step(self) -> None:
        self.kv.pins.expire()
        out = self.scheduler.schedule()
        for chunk in out.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_tokens
            if request.num_computed_tokens < request.num_tokens:
                self.kv.cache_full_blocks(request)
                continue
            first = not request.output_token_ids
            request.append_token(SampledToken(7), self.clock())
            self.kv.cache_full_blocks(request)
            if first:
                self.kv.pin_prompt(request)
            if len(request.output_token_ids) >= request.params.max_tokens:
                self.finish(request)

    def finish(self, request: Request) -> None:
        self.scheduler.remove(request)
        del self.requests[request.request_id]

    def drain(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.requests:
                return
            self.step()
            check_invariants(self)
        raise AssertionError(f"requests never finished: {sorted(self.requests)} (a deadlock or a preemption loop)")


def check_invariants(engine: MiniEngine) -> None:
    kv, pool, pins = engine.kv, engine.kv.pool, engine.kv.pins
    holders = {b.block_id: 0 for b in pool.blocks}
    for table in kv.block_tables.values():
        for block in table:
            holders[block.block_id] += 1
    for block in pool.blocks:
        expected = holders[block.block_id] + pins.is_pinned(block)
        assert block.ref_cnt == expected, f"block {block.block_id}: ref {block.ref_cnt}, holders {expected}"
        assert (block in pool.free_queue) == (block.ref_cnt == 0)
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    bs = kv.block_size
    for request_id, table in kv.block_tables.items():  # the slot tables follow the block tables
        assert kv.slots(request_id).tolist() == [b.block_id * bs + offset for b in table for offset in range(bs)]
    assert set(kv._slot_tables) <= set(kv.block_tables)
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    for pin in pins.pins.values():
        assert all(pool.cached.get(b.block_hash) is b for b in pin.blocks), "a pinned block lost its hash"
        assert pin.blocks[-1].block_hash == pin.key
    assert pins.num_blocks <= pins.max_blocks
    assert pins.num_blocks == len({b.block_id for pin in pins.pins.values() for b in pin.blocks})


# ---- examples

def test_a_pin_holds_its_blocks_through_a_flood_and_releases_them_when_it_expires():
    engine = MiniEngine(num_blocks=12)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    engine.add(system + [9], "a", pin_all())
    engine.drain()
    assert engine.kv.pins.num_blocks == 4
    for seed in range(8):  # one-off prompts, each big enough to evict everything unpinned
        rng = random.Random(seed)
        engine.add([rng.randrange(100, 10**6) for _ in range(14)], "b", None)
        engine.drain()
    hit = engine.add(system + [10], "a", None)
    engine.drain()
    assert hit.num_cached_tokens == 8 and hit.num_pinned_tokens == 8  # a hit reports (and renews) the pin
    engine.clock.now += 301
    engine.step()
    assert engine.kv.pins.num_blocks == 0 and engine.kv.pins.released["expired"] == 1
    assert engine.kv.pins.take_tenant_expiries() == {"a": 1}
    check_invariants(engine)


def test_every_hit_renews_the_ttl():
    engine = MiniEngine()
    first = engine.add([1, 2, 3, 4, 5], "a", pin_all(ttl_s=300))
    engine.drain()
    assert first.pinned_until == engine.clock.now + 300
    engine.clock.now += 200
    again = engine.add([1, 2, 3, 4, 6], "a", None)
    engine.drain()
    assert again.pinned_until == engine.clock.now + 300
    engine.clock.now += 200  # 400 s after the pin was made, 200 after the hit
    engine.step()
    assert engine.kv.pins.num_blocks == 2
    [pin] = engine.kv.pins.list("a")
    assert pin.hits == 1 and pin.num_tokens == 4


def test_sending_a_pinned_prompt_of_whole_blocks_again_renews_its_pin():
    """Its last block is not hit (its last token is computed again, for the logits) but is read all the same."""
    engine = MiniEngine()
    engine.add([1, 2, 3, 4], "a", pin_all(ttl_s=300))
    engine.drain()
    engine.clock.now += 200
    again = engine.add([1, 2, 3, 4], "a", None)
    engine.drain()
    assert again.num_cached_tokens == 2  # the hit: the first block alone
    assert again.num_pinned_tokens == 4 and again.pinned_until == engine.clock.now + 300
    [pin] = engine.kv.pins.list("a")
    assert pin.hits == 1 and pin.expires_at == engine.clock.now + 300
    single = engine.add([1, 2], "a", pin_all(ttl_s=300))  # one whole block: no hit at all, renewed the same
    engine.drain()
    engine.clock.now += 100
    engine.add([1, 2], "a", None)
    engine.drain()
    assert {p.num_tokens: p.expires_at for p in engine.kv.pins.list("a")}[2] == engine.clock.now + 300
    assert engine.add([1, 2, 3, 4], "b", None) and single.num_pinned_tokens == 2
    engine.drain()
    assert [p.hits for p in engine.kv.pins.list("a") if p.num_tokens == 4] == [1]  # another tenant renews nothing
    check_invariants(engine)


def test_pinning_a_pinned_prefix_again_keeps_the_longer_ttl_and_the_later_expiry():
    engine = MiniEngine(num_blocks=16)
    engine.add([1, 2, 3, 4, 5], "a", pin_all(ttl_s=300))
    engine.drain()
    engine.clock.now += 100
    engine.add([1, 2, 3, 4, 6], "a", pin_all(ttl_s=3600))  # the same two full blocks: the same pin
    engine.drain()
    [pin] = engine.kv.pins.list("a")
    assert (pin.ttl_s, pin.expires_at) == (3600, engine.clock.now + 3600)
    engine.clock.now += 100
    engine.add([1, 2, 3, 4, 7], "a", pin_all(ttl_s=60))  # a shorter ttl shortens nothing
    engine.drain()
    [pin] = engine.kv.pins.list("a")
    assert (pin.ttl_s, pin.expires_at) == (3600, engine.clock.now + 3600)
    assert engine.kv.pins.num_blocks == 2
    check_invariants(engine)


def test_with_prefix_caching_off_a_breakpoint_is_refused_as_not_cached_and_the_request_runs():
    engine = MiniEngine(num_blocks=16, enable_caching=False)
    request = engine.add([1, 2, 3, 4, 5], "a", pin_all())
    engine.drain()
    assert request.pin_refused == REFUSED_NOT_CACHED and request.num_pinned_tokens == 0
    assert request.output_token_ids and engine.kv.pins.num_blocks == 0


def test_quotas_refuse_a_pin_without_failing_the_request():
    engine = MiniEngine(num_blocks=16, max_pinned_blocks=3)
    over_pool = engine.add([1, 2, 3, 4, 5, 6, 7, 8, 9], "a", pin_all())
    over_tenant = engine.add([11, 12, 13, 14, 15], "b", pin_all(quota=1))
    fits = engine.add([21, 22, 23], "c", pin_all(quota=1))
    engine.drain()
    assert over_pool.pin_refused == REFUSED_POOL_QUOTA and over_pool.num_pinned_tokens == 0
    assert over_tenant.pin_refused == REFUSED_TENANT_QUOTA and over_tenant.num_pinned_tokens == 0
    assert fits.pin_refused is None and fits.num_pinned_tokens == 2
    assert all(r.output_token_ids for r in (over_pool, over_tenant, fits))  # every request ran
    assert engine.kv.pins.take_tenant_refusals() == {("a", REFUSED_POOL_QUOTA): 1, ("b", REFUSED_TENANT_QUOTA): 1}


def test_a_request_that_needs_the_whole_pool_runs_and_pins_give_way():
    engine = MiniEngine(num_blocks=12, max_pinned_blocks=6)
    engine.add(list(range(1, 13)), "a", pin_all())
    engine.drain()
    assert engine.kv.pins.num_blocks == 6
    big = engine.add(list(range(100, 121)), "b", None, max_tokens=2)  # 11 blocks: only 6 are unpinned
    engine.drain()
    assert big.output_token_ids and engine.kv.pins.released["pressure"] == 1


def test_pins_give_way_before_a_running_request_is_preempted():
    engine = MiniEngine(num_blocks=12, max_pinned_blocks=6)
    engine.add(list(range(1, 13)), "a", pin_all())
    engine.drain()
    assert engine.kv.pins.num_blocks == 6
    # two decodes that together outgrow the 6 unpinned blocks (2 + 4 tokens of their own: 3 blocks each, and more)
    running = [engine.add(list(range(100 + 10 * i, 104 + 10 * i)), "b", None, max_tokens=6) for i in range(2)]
    engine.drain()
    assert all(len(r.output_token_ids) == 6 for r in running)
    assert engine.scheduler.num_preemptions == 0 and engine.kv.pins.released["pressure"] >= 1


def test_nested_breakpoints_share_blocks_and_count_them_once():
    engine = MiniEngine(num_blocks=16, max_pinned_blocks=8)
    cache = CacheDirectives((CacheBreakpoint(4, 300.0), CacheBreakpoint(8, 3600.0)))
    request = engine.add(list(range(1, 11)), "a", cache)
    engine.drain()
    assert len(engine.kv.pins.pins) == 2 and engine.kv.pins.num_blocks == 4
    assert engine.kv.pins.tenant_blocks("a") == 4
    assert request.num_pinned_tokens == 8


def test_a_breakpoint_inside_the_first_block_pins_nothing():
    engine = MiniEngine(num_blocks=16, max_pinned_blocks=8)
    request = engine.add(list(range(1, 11)), "a", CacheDirectives((CacheBreakpoint(BS - 1, 300.0),)))
    engine.drain()
    assert (engine.kv.pins.num_blocks, request.num_pinned_tokens) == (0, 0)
    check_invariants(engine)


def test_erase_forgets_one_tenants_blocks_pinned_or_not():
    engine = MiniEngine(num_blocks=16)
    engine.add([1, 2, 3, 4, 5], "a", pin_all())
    engine.add([1, 2, 3, 4, 5], "b", None)  # the same tokens under another tenant: distinct in a real salt
    engine.drain()
    assert engine.kv.erase("a").pins == 1
    assert engine.kv.pins.num_blocks == 0
    assert all(b.tenant != "a" for b in engine.kv.pool.cached.values())
    check_invariants(engine)


def test_erase_keeps_the_blocks_another_tenants_pin_holds():
    """Tenants sharing a salt share blocks: b's pin on blocks a cached keeps them cached (b's now) when a erases
    its cache. They lost their hashes before, so b's pin held hashless blocks, b's next request missed them, and
    with a disk tier saving the pins (a block's hash by name) crashed the engine loop at its next idle."""
    engine = MiniEngine(num_blocks=12, max_pinned_blocks=6)
    prefix = list(range(1, 9))
    engine.add(prefix + [999], "a", None)
    engine.drain()
    engine.add(prefix + [999], "b", pin_all())
    engine.drain()
    assert engine.kv.pins.tenant_blocks("b") > 0
    erased = engine.kv.erase("a")
    check_invariants(engine)  # ("a pinned block lost its hash" before)
    pinned = [b for pin in engine.kv.pins.pins.values() for b in pin.blocks]
    assert (erased.pins, erased.blocks) == (0, 0) and {b.tenant for b in pinned} == {"b"}
    again = engine.add(prefix + [998], "b", None)
    engine.drain()
    assert again.num_cached_tokens == len(pinned) * BS


# ---- property

_op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from("ab"), st.integers(0, 3), st.integers(1, 16) | st.just(16), st.booleans()),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 10)),
    st.tuples(st.just("expire"), st.floats(0, 400)),
    st.tuples(st.just("erase"), st.sampled_from("ab")),
    st.tuples(st.just("release")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=40), policy=st.sampled_from(["lru", "slru"]))
def test_pins_keep_the_pool_consistent_and_never_starve_a_request(ops, policy):
    engine = MiniEngine(num_blocks=12, max_pinned_blocks=6, policy=policy)
    families = [[f * 50 + i for i in range(1, 17)] for f in range(4)]  # shared prefixes
    for op in ops:
        if op[0] == "add":
            _, tenant, family, length, pin = op
            tokens = families[family][:length] + [999]
            engine.add(tokens, tenant, pin_all(quota=4 if tenant == "b" else None) if pin else None)
        elif op[0] == "step":
            engine.step()
        elif op[0] == "abort" and engine.requests:
            engine.finish(sorted(engine.requests.values(), key=lambda r: r.request_id)[op[1] % len(engine.requests)])
        elif op[0] == "expire":
            engine.clock.now += op[1]
            engine.kv.pins.expire()
        elif op[0] == "erase":
            engine.kv.erase(op[1])
        elif op[0] == "release":
            engine.kv.release_pin_for_room()
        check_invariants(engine)
        assert engine.kv.pins.tenant_blocks("b") <= 4
    big = engine.add(list(range(5000, 5021)), "a", None, max_tokens=1)  # 11 of the 12 blocks, whatever is pinned
    engine.drain()
    assert big.output_token_ids
    engine.clock.now += 4000
    engine.kv.pins.expire()
    check_invariants(engine)
    assert engine.kv.pool.num_free_blocks == 12  # nothing leaked: every pin and request gave its blocks back


# ---- the engine

HOT = list(range(20, 84))  # 4 full blocks of 16


def greedy(n: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def flood(llm: LLM, seed: int, count: int = 6) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        llm.generate([rng.randrange(100, 500) for _ in range(120)], greedy(), tenant="other")


def test_a_pinned_prompt_survives_a_flood_that_evicts_it_unpinned(tiny_llama_dir):
    answers = {}
    for pinned in (False, True):
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=12, eviction_policy="lru")
        llm.generate(HOT + [5], greedy(), tenant="a", cache=pin_all() if pinned else None)
        flood(llm, seed=1)
        [out] = llm.generate(HOT + [6], greedy(), tenant="a")
        answers[pinned] = out
    assert answers[False].num_cached_tokens == 0
    assert answers[True].num_cached_tokens == len(HOT)
    assert answers[True].token_ids == answers[False].token_ids  # the cache never changes an answer


def test_erasing_a_tenant_clears_its_ram_and_disk_blocks_and_spares_the_others(tiny_llama_dir, tmp_path):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=24, kv_disk_dir=str(tmp_path))
    for tenant in ("alice", "bob"):
        llm.generate(HOT + [5], greedy(), tenant=tenant, cache_salt=tenant, cache=pin_all())
    llm.core.kv.flush_to_disk()  # both tenants' blocks on disk too
    files = len(list(llm.core.kv.disk.dir.glob("*.kv")))
    erased = llm.core.cache_command(CacheCommand(1, "erase", "alice"))
    assert (erased.pins, erased.blocks, erased.disk_blocks) == (1, 4, 4)
    assert len(list(llm.core.kv.disk.dir.glob("*.kv"))) == files - 4
    [alice] = llm.generate(HOT + [6], greedy(), tenant="alice", cache_salt="alice")
    [bob] = llm.generate(HOT + [6], greedy(), tenant="bob", cache_salt="bob")
    assert (alice.num_cached_tokens, bob.num_cached_tokens) == (0, len(HOT))
    assert llm.core.cache_command(CacheCommand(2, "list", "alice")) == PinList([], 0)
    assert len(llm.core.cache_command(CacheCommand(3, "list", "bob")).pins) == 1


def test_a_shared_salts_pin_survives_the_other_tenants_erase_and_a_restart(tiny_llama_dir, tmp_path):
    """bob pins a prefix alice computed under the salt they share; alice's erase leaves bob's pinned blocks cached,
    in RAM and on disk, so bob's next request hits them, the engine saves the pins at its next idle (it failed
    on the hashless blocks before), and the pin comes back after a restart."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=24, kv_disk_dir=str(tmp_path))
    llm.generate(HOT + [5], greedy(), tenant="alice", cache_salt="shared")
    llm.generate(HOT + [6], greedy(), tenant="bob", cache_salt="shared", cache=pin_all(ttl_s=3600))
    llm.core.kv.flush_to_disk()
    erased = llm.core.cache_command(CacheCommand(1, "erase", "alice"))
    assert (erased.blocks, erased.disk_blocks) == (0, 0)  # every block alice cached is under bob's pin
    [bob] = llm.generate(HOT + [7], greedy(), tenant="bob", cache_salt="shared")
    assert bob.num_cached_tokens == len(HOT)
    llm.core.idle(True)  # saves the pins
    llm.close()
    again = LLM(str(tiny_llama_dir), num_kv_blocks=24, kv_disk_dir=str(tmp_path))
    assert [p.num_tokens for p in again.core.kv.pins.list("bob")] == [len(HOT)]
    erased = again.core.cache_command(CacheCommand(2, "erase", "bob"))  # bob's now: his erase takes the files too
    assert (erased.pins, erased.disk_blocks) == (1, 4)
    [carol] = again.generate(HOT + [8], greedy(), tenant="carol", cache_salt="shared")
    assert carol.num_cached_tokens == 0  # nothing of either left to hit
    again.close()


def test_pins_survive_a_restart_with_their_wall_clock_expiry(tiny_llama_dir, tmp_path):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path))
    llm.generate(HOT + [5], greedy(), tenant="a", cache=pin_all(ttl_s=3600))
    [before] = llm.core.kv.pins.list("a")
    llm.close()
    again = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path))
    assert again.core.kv.pins.list("a") == [before]  # same prefix, size, expiry (wall clock) and hits
    flood(again, seed=2)  # the restored pin holds its blocks in RAM as before
    [out] = again.generate(HOT + [6], greedy(), tenant="a")
    assert out.num_cached_tokens == len(HOT)
    again.close()


def test_restored_pins_keep_their_kv_through_the_start_up_probes(tiny_llama_dir, tmp_path):
    """The thread-count probe and the step-cost calibration (max_step_ms) write scratch K/V from slot 0: pins read
    back before them were overwritten there, and a pinned prompt's answer changed after a restart."""
    from engine.threads import ThreadBudget

    def pinned_kv(llm: LLM) -> torch.Tensor:
        [pin] = llm.core.kv.pins.pins.values()
        size = llm.core.runner.block_size
        return torch.cat([llm.core.runner.kv_slots[:, :, b.block_id * size:(b.block_id + 1) * size]
                          for b in pin.blocks], dim=2).clone()

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path), threads=1, threads_batch=1)
    llm.generate(HOT + [5], greedy(), tenant="a", cache=pin_all(ttl_s=3600))
    saved = pinned_kv(llm)
    [before] = llm.generate(HOT + [6], params, tenant="a")
    llm.close()
    again = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path), max_step_ms=50)
    assert again.core.thread_budget.prefill_ms and again.core.step_target is not None  # both probes ran
    assert torch.equal(pinned_kv(again), saved)
    # (a small prefill chunk's floats follow the thread count, which the probe chose: the first run's, for the answer)
    again.core.thread_budget = ThreadBudget(1, 1)
    [after] = again.generate(HOT + [6], params, tenant="a")
    assert after.num_cached_tokens == len(HOT) and after.token_ids == before.token_ids
    assert [t.logprob for t in after.logprobs] == [t.logprob for t in before.logprobs]
    again.close()


@pytest.mark.parametrize("damage", [[1], [{"created_at": "yesterday"}], [{"tenant": "a", "ttl_s": 300,
                                                                          "created_at": 1.0, "expires_at": "never",
                                                                          "hits": 0, "blocks": []}]])
def test_a_damaged_saved_pin_is_skipped_and_the_engine_starts(tiny_llama_dir, tmp_path, damage, caplog):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path))
    llm.generate(HOT + [5], greedy(), tenant="a", cache=pin_all(ttl_s=3600))
    llm.close()
    path = next(tmp_path.glob("*/pins.json"))
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({"pins": damage + saved["pins"]}))
    again = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path))
    assert [p.num_tokens for p in again.core.kv.pins.list("a")] == [len(HOT)]  # the sound one came back
    assert "skipping a saved pin" in caplog.text
    again.close()


def test_an_expired_pin_is_not_restored(tiny_llama_dir, tmp_path, monkeypatch):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path))
    llm.generate(HOT + [5], greedy(), tenant="a", cache=pin_all(ttl_s=300))
    llm.close()
    from engine.kv import pins
    monkeypatch.setattr(pins.time, "time", lambda: 10**12)
    again = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path))
    assert again.core.kv.pins.num_blocks == 0
    again.close()


@pytest.mark.parametrize("fraction", [0.0, 0.25])
def test_max_pinned_fraction_caps_the_pins(tiny_llama_dir, fraction):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, max_pinned_fraction=fraction)
    llm.generate(HOT + [5], greedy(), tenant="a", cache=pin_all())
    assert llm.core.kv.pins.num_blocks == (0 if fraction == 0 else 4)
    assert llm.core.kv.pins.max_blocks == int(16 * fraction)
