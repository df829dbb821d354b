"""A prefill in progress shares the step with requests that wait: a short prompt behind a long one starts at once,
and a long prefill loses no tokens to a newcomer that cannot start."""
from __future__ import annotations

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import Scheduler


def _request(request_id: str, num_tokens: int, first: int = 1) -> Request:
    return Request(request_id, list(range(first, first + num_tokens)), SamplingParams(max_tokens=8))


def _scheduler(max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(EngineConfig(max_num_batched_tokens=512, max_num_seqs=max_num_seqs), KVCacheManager(512, 16))


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
    scheduler.add(_request("c", 300, first=9000))
    assert _ran(scheduler) == [("a", 256), ("b", 128), ("c", 128)]


def test_prefills_of_equal_length_run_one_after_the_other():
    """Shared, both would finish at the second one's time; in turn, the first finishes a step earlier."""
    scheduler = _scheduler()
    scheduler.add(_request("a", 1000))
    assert _ran(scheduler) == [("a", 512)]
    scheduler.add(_request("b", 1000, first=5000))  # longer than what a has left
    assert _ran(scheduler) == [("a", 488), ("b", 24)]
    assert _ran(scheduler) == [("a", 1), ("b", 511)]


def test_a_newcomer_waiting_for_the_prefix_being_computed_takes_nothing_from_it():
    scheduler = _scheduler()
    scheduler.add(_request("first", 2000))
    assert _ran(scheduler) == [("first", 512)]
    scheduler.add(_request("same-prompt", 2000))  # its blocks are the first one's, still being computed
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
