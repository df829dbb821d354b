"""A short prefill shares the step with a long one ahead of it: a short prompt behind a long one starts at once, the
long one keeps at least half of each step, and no step loses tokens to sharing."""
from __future__ import annotations

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler


def _request(request_id: str, num_tokens: int, first: int = 1) -> Request:
    return Request(request_id, list(range(first, first + num_tokens)), SamplingParams(max_tokens=8))


def _scheduler(max_num_seqs: int = 8, num_blocks: int = 512, budget: int = 512) -> Scheduler:
    return Scheduler(EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
                     KVCacheManager(num_blocks, 16))


def _ran(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Schedules a step and runs it (each chunk's tokens computed, its full blocks cached, a token sampled where
    the chunk reached the end)."""
    chunks = scheduler.schedule().chunks
    for chunk in chunks:
        request = chunk.request
        request.num_computed_tokens += chunk.num_tokens
        scheduler.kv.cache_full_blocks(request)
        if request.num_computed_tokens == request.num_tokens:
            request.all_token_ids.append(0)
    return [(c.request.request_id, c.num_tokens) for c in chunks]


def test_a_short_prompt_behind_a_long_prefill_starts_at_the_next_step():
    scheduler = _scheduler()
    scheduler.add(_request("long", 2000))
    assert _ran(scheduler) == [("long", 512)]
    scheduler.add(_request("short", 20, first=5000))
    assert _ran(scheduler) == [("long", 492), ("short", 20)]  # half the room kept for it; what it left, back
    assert _ran(scheduler) == [("short", 1), ("long", 511)]  # its answer decodes beside the rest of the prefill


def test_a_shorter_prefill_keeps_its_share_once_running_and_a_third_splits_what_is_left():
    scheduler = _scheduler()
    scheduler.add(_request("a", 4000))
    assert _ran(scheduler) == [("a", 512)]
    scheduler.add(_request("b", 1000, first=5000))
    assert _ran(scheduler) == [("a", 256), ("b", 256)]
    assert _ran(scheduler) == [("a", 256), ("b", 256)]  # running, b still shares: it is not left for a's end
    scheduler.add(_request("c", 200, first=9000))  # under half of what b has left (488): b makes room too
    assert _ran(scheduler) == [("a", 256), ("b", 128), ("c", 128)]


def test_sharing_starts_below_half_of_what_the_long_prefill_has_left():
    """Two prefills sharing equally finish sooner on average than one after the other only when the shorter has
    less than half of the longer's tokens left."""
    for newcomer, expected in ((744, [("a", 512)]), (743, [("a", 256), ("b", 256)])):
        scheduler = _scheduler()
        scheduler.add(_request("a", 2000))
        assert _ran(scheduler) == [("a", 512)]  # 1,488 left
        scheduler.add(_request("b", newcomer, first=5000))
        assert _ran(scheduler) == expected


def test_a_longer_newcomer_first_in_the_queue_does_not_take_the_room_made_for_a_shorter_one():
    scheduler = _scheduler()
    scheduler.add(_request("a", 2000))
    assert _ran(scheduler) == [("a", 512)]
    scheduler.add(_request("long", 3000, first=5000))
    scheduler.add(_request("short", 20, first=9000))
    assert _ran(scheduler) == [("a", 492), ("short", 20)]  # the longer newcomer waits for a later step
    assert [r.request_id for r in scheduler.waiting] == ["long"]


def test_a_preempted_prefills_chunk_gives_its_prefill_budget_back():
    """h, catching up after a preemption (its output recomputed), is halved for the shorter prefills after it; x's
    blocks then preempt h again, and h's chunk gives back its share of the step's prefill tokens too, so z, after
    x, still gets its chunk (before, the prefill share looked spent and z got nothing)."""
    scheduler = _scheduler(num_blocks=60, budget=256)
    kv = scheduler.kv
    x, z, h = _request("x", 700), _request("z", 116, first=20000), _request("h", 100, first=50000)
    h.all_token_ids += list(range(1, 601))  # 600 tokens it had generated
    for request, computed in ((x, 512), (z, 16), (h, 300)):  # 32 + 1 + 19 of the 60 blocks
        kv.find_cached_prefix(request)
        assert kv.allocate(request, computed)
        request.num_computed_tokens, request.num_cached_tokens = computed, 0
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
    assert h.is_catching_up and not h.is_prefilling
    out = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("x", 128), ("z", 100)]
    assert out.preempted == [h]


def test_a_newcomer_waiting_for_the_prefix_being_computed_takes_nothing_from_it():
    scheduler = _scheduler()
    scheduler.add(_request("first", 2000))
    assert _ran(scheduler) == [("first", 512)]
    scheduler.add(_request("same-prompt", 600))  # short, but its blocks are the first one's, still being computed
    assert _ran(scheduler) == [("first", 512)]
    assert [r.request_id for r in scheduler.waiting] == ["same-prompt"]


def test_no_sharing_when_no_newcomer_may_start():
    scheduler = _scheduler(max_num_seqs=1)
    scheduler.add(_request("long", 2000))
    assert _ran(scheduler) == [("long", 512)]
    scheduler.add(_request("short", 20, first=5000))  # every sequence slot is taken
    assert _ran(scheduler) == [("long", 512)]


def test_sharing_changes_no_output(tiny_llama_dir):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    long_prompt, short_prompt = list(range(5, 405)), list(range(7, 27))
    alone = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=128, enable_prefix_caching=False)
    expected = [alone.generate(p, params)[0].token_ids for p in (long_prompt, short_prompt)]
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=128, max_num_batched_tokens=128,
              enable_prefix_caching=False)
    long_request = Request("long", long_prompt, params)
    llm.core.add_request(long_request)
    llm.core.step()  # the long prompt's first chunk
    short_request = Request("short", short_prompt, params)
    llm.core.add_request(short_request)
    llm.core.step()
    assert short_request.num_computed_tokens == len(short_prompt)  # all of it in the step after its arrival
    assert long_request.is_prefilling
    while llm.core.has_unfinished():
        llm.core.step()
    assert [long_request.output_token_ids, short_request.output_token_ids] == expected


def test_pins_give_way_before_the_room_a_prefill_made_is_lost():
    """A 96-block pool with 40 blocks pinned: the long prefill's full chunk needs the pin's room, as it did before
    it made room for the short newcomer (pins give way before any running request)."""
    scheduler = _scheduler(num_blocks=96)
    kv = scheduler.kv
    pinned = _request("pinned", 40 * 16 + 1, first=900000)
    kv.find_cached_prefix(pinned)
    assert kv.allocate(pinned, 40 * 16)
    pinned.num_computed_tokens = 40 * 16
    kv.cache_full_blocks(pinned)
    assert kv.pins.pin(None, [kv.pool.cached[b.block_hash] for b in kv.block_tables["pinned"]], 3600.0)
    kv.free(pinned)
    scheduler.add(_request("a", 1000))
    assert _ran(scheduler) == [("a", 512)]
    scheduler.add(_request("short", 20, first=500000))
    assert _ran(scheduler) == [("a", 488), ("short", 20)]
    assert not kv.pins.pins
