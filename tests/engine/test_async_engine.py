"""AsyncEngine: deltas over asyncio, aborts release blocks, a failed step fails only its requests."""
from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from bench.engine_faults import assert_blocks_released, set_step_hook
from engine import AsyncEngine, EngineConfig, SamplingParams


@pytest.fixture
async def engine(tiny_llama_dir):
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64,
                                                  max_num_batched_tokens=16, max_num_seqs=16))
    engine.start()
    yield engine
    await engine.shutdown(timeout=1)


async def _collect(engine, request_id, prompt, params, **kw):
    return [out async for out in engine.generate(request_id, prompt, params, **kw)]


async def test_generate_streams_deltas_and_finishes(engine):
    prompt = engine.tokenizer.encode("the capital of France is Paris and the world is good")
    outs = await _collect(engine, "a", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o.new_token_ids) for o in outs] == [1] * 8
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert outs[-1].num_output_tokens == 8 and outs[-1].num_prompt_tokens == len(prompt)
    assert not any(o.finished for o in outs[:-1])
    assert_blocks_released(engine)


async def test_consumer_leaving_aborts_and_releases_blocks(engine):
    prompt = list(range(3, 60))
    gen = engine.generate("b", prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    await anext(gen)
    await gen.aclose()  # what a client disconnect does to the handler's generator
    for _ in range(100):
        if not engine.core.requests:
            break
        await asyncio.sleep(0.01)
    assert_blocks_released(engine)
    assert engine.core.kv.pool.cached  # the prompt's full blocks stay cached for the next request


async def test_failed_step_fails_its_requests_and_the_engine_keeps_serving(engine):
    def explode():
        set_step_hook(engine, None)
        raise RuntimeError("injected")

    set_step_hook(engine, explode)
    outs = await _collect(engine, "c", list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0))
    assert outs[-1].finish_reason == "error" and "injected" in outs[-1].error
    ok = await _collect(engine, "d", list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0,
                                                                       ignore_eos=True))
    assert ok[-1].finish_reason == "length"
    assert engine.is_alive()
    assert_blocks_released(engine)


async def test_failed_idle_housekeeping_leaves_the_engine_serving(engine, monkeypatch):
    """The idle loop's housekeeping (pins' expiry, the disk tier's write-behind, saving the pins) raised straight
    out of the step loop, which killed the engine: every later request failed (a pin on hashless blocks did it,
    2026-12-01)."""
    calls = []

    def broken_idle(just_idle: bool) -> None:
        calls.append(just_idle)
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.core, "idle", broken_idle)
    for request_id in ("h", "i"):
        outs = await _collect(engine, request_id, list(range(3, 40)), SamplingParams(max_tokens=2, temperature=0,
                                                                                    ignore_eos=True))
        assert outs[-1].finish_reason == "length"
        for _ in range(100):  # the idle loop ran (and failed) after the request
            if True in calls:
                break
            await asyncio.sleep(0.01)
        assert True in calls and engine.is_alive()
        calls.clear()


async def test_invalid_prompts_raise_before_anything_runs(engine):
    with pytest.raises(ValueError, match="empty"):
        await _collect(engine, "e", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        await _collect(engine, "f", [10**9], SamplingParams())
    with pytest.raises(ValueError, match="context length"):
        await _collect(engine, "g", [5], SamplingParams(max_tokens=10**6))


async def test_concurrent_requests_share_the_prefix(tiny_llama_dir):
    """The others wait for the prefix the first one is computing, instead of computing it again.

    A 48-token budget: step 1 prefills the first request's blocks 0-2, step 2 its block 3 and its last
    two tokens with 30 tokens of budget to spare. The others could be admitted in step 2 and hit blocks
    0-2, but block 3 is in flight: they wait one step and hit all four blocks.
    """
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64,
                                                  max_num_batched_tokens=48, max_num_seqs=16))
    engine.start()
    first_step = iter([True])
    set_step_hook(engine, lambda: next(first_step, False) and time.sleep(0.2))  # all four arrive by step 2
    system = list(range(3, 67))  # 64 tokens: four full blocks
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    results = await asyncio.gather(*[_collect(engine, f"u{i}", system + [100 + i, 200 + i], params)
                                     for i in range(4)])
    cached = sorted(r[-1].num_cached_tokens for r in results)
    assert cached == [0, 64, 64, 64]  # computed once, hit by the three others
    assert_blocks_released(engine)
    await engine.shutdown(timeout=1)


async def test_a_caller_id_reused_right_after_an_abort_gets_only_its_own_outputs(engine):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    new_prompt = list(range(100, 140))
    expected = [t for o in await _collect(engine, "fresh", new_prompt, params) for t in o.new_token_ids]
    old = engine.generate("x", list(range(3, 60)), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    await anext(old)
    await old.aclose()  # sends the old request's abort; its abort output is still to come
    outs = await _collect(engine, "x", new_prompt, params)  # the same caller id at once
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
    assert all(o.request_id == "x" for o in outs)
    for _ in range(100):
        if not engine.core.requests:
            break
        await asyncio.sleep(0.01)
    assert_blocks_released(engine)


async def test_a_broken_stats_listener_does_not_stop_the_engine(engine):
    def broken(stats):
        raise RuntimeError("metrics bug")

    engine.add_stats_listener(broken)
    outs = await _collect(engine, "h", list(range(3, 30)), SamplingParams(max_tokens=3, temperature=0,
                                                                         ignore_eos=True))
    assert outs[-1].finish_reason == "length" and engine.is_alive()


def test_context_length_is_capped_by_the_kv_pool(tiny_llama_dir):
    """A request longer than the pool could never finish (it would preempt itself forever)."""
    from engine.core import EngineCore
    core = EngineCore(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8, block_size=16))
    assert core.max_model_len == 8 * 16  # a prompt that generates nothing needs a slot for its every token
    with pytest.raises(ValueError, match="context length"):
        core.validate(list(range(3, 100)), SamplingParams(max_tokens=32))
    core.validate(list(range(3, 100)), SamplingParams(max_tokens=31))
    core.validate(list(range(3, 131)), SamplingParams(pooling="last"))


def test_a_context_longer_than_the_models_own_is_served_with_a_warning(caplog):
    from engine.core import _context_length
    model = SimpleNamespace(max_position_embeddings=2048)
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
        assert _context_length(EngineConfig(model="m", max_model_len=1024), model, 1000) == 1024
        assert not caplog.records
        assert _context_length(EngineConfig(model="m", max_model_len=4096), model, 1000) == 4096
    assert "exceeds the model's own (2048" in caplog.text


async def test_shutdown_aborts_what_is_left_and_ends_every_stream(tiny_llama_dir):
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64))
    engine.start()
    set_step_hook(engine, lambda: time.sleep(0.005))  # keep the engine inside a step most of the time
    gen = engine.generate("long", list(range(3, 40)), SamplingParams(max_tokens=900, temperature=0,
                                                                     ignore_eos=True))
    await anext(gen)
    await engine.shutdown(timeout=0)
    rest = [out async for out in gen]  # ends instead of waiting forever
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert_blocks_released(engine)
