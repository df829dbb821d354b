"""A step-time target caps each step's prefill share; decodes always run, and outputs never change."""
from __future__ import annotations

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import Scheduler


def _request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=8))


def _scheduler() -> Scheduler:
    return Scheduler(EngineConfig(max_num_batched_tokens=512, max_num_seqs=8), KVCacheManager(256, 16))


def _decoding(scheduler: Scheduler, request_id: str, num_tokens: int) -> Request:
    """A running request with its prompt computed: its next chunk is one decode token."""
    request = _request(request_id, num_tokens)
    scheduler.add(request)
    (chunk,) = [c for c in scheduler.schedule().chunks if c.request is request]
    request.num_computed_tokens = num_tokens - 1  # as if the prompt ran but its last token, the next decode
    return request


def test_the_cap_sizes_prefill_from_the_decodes_context():
    contexts = []

    def cap(decode_context_tokens: int) -> int:
        contexts.append(decode_context_tokens)
        return 40

    scheduler = _scheduler()
    _decoding(scheduler, "a", 100)
    _decoding(scheduler, "b", 60)
    scheduler.prefill_cap = cap
    scheduler.add(_request("c", 300))
    out = scheduler.schedule()
    assert contexts == [160]  # both decodes' whole context
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 40)]


def test_decodes_run_even_when_the_target_leaves_no_room_for_prefill():
    scheduler = _scheduler()
    _decoding(scheduler, "a", 20)
    scheduler.prefill_cap = lambda _: 0
    scheduler.add(_request("b", 50))
    out = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1)]


def test_without_a_target_prefill_fills_the_token_budget():
    scheduler = _scheduler()
    _decoding(scheduler, "a", 20)
    scheduler.add(_request("b", 600))
    out = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 511)]


def test_a_step_target_changes_no_output(tiny_llama_dir):
    prompts = [list(range(5, 5 + n)) for n in (70, 33, 120)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64)
    capped = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64, max_step_ms=0.001)
    assert capped.core.scheduler.prefill_cap is not None
    assert capped.core.scheduler.prefill_cap(0) == 16  # a target no step can meet still moves one block on
    assert [o.token_ids for o in capped.generate(prompts, params)] == \
           [o.token_ids for o in free.generate(prompts, params)]


def test_only_steps_with_a_prefill_share_correct_the_cost_model(tiny_llama_dir):
    """Pure decode steps take another path (the compiled step on CPU): they would skew the correction of
    the model that sizes prefill shares."""
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64, max_step_ms=50)
    target = llm.core.step_target
    seen = []
    observe = target.observe
    target.observe = lambda num_prefill, *rest: (seen.append(num_prefill), observe(num_prefill, *rest))
    steps_before = llm.core.num_steps
    llm.generate([list(range(5, 75)), list(range(9, 42))], SamplingParams(max_tokens=8, temperature=0,
                                                                           ignore_eos=True))
    assert seen and all(n > 0 for n in seen)
    assert llm.core.num_steps - steps_before > len(seen)  # the decode-only steps were left out
