"""GET /v1/cache/stats: the pool's occupancy, its free blocks split into cached ones (hittable until handed out)
and empty ones, exact from the engine's stats to the JSON body (the chat page's cache panel shows the split)."""
from __future__ import annotations

from engine.stats import PrefixCacheStats, SchedulerStats, StepStats
from gateway.app import create_app
from gateway.cache_stats import CacheStats
from gateway.state import STATE
from tests.support.gateway_helpers import tiny_settings

BLOCK = 16  # tiny_settings' block size
BLOCKS = 128  # and pool


def test_the_body_splits_the_free_blocks_into_cached_and_empty():
    stats = CacheStats()
    cache = PrefixCacheStats(cached_blocks=5, free_cached_blocks=3)
    stats.on_step(StepStats(SchedulerStats(num_blocks=10, num_free_blocks=7, prefix_cache=cache)))
    assert stats.body("alice")["kv_blocks"] == {"total": 10, "used": 3, "cached": 5, "free": 7, "free_cached": 3,
                                                "free_empty": 4}


async def test_a_finished_requests_full_blocks_stay_cached_among_the_free_ones(aiohttp_client, tiny_llama_dir):
    client = await aiohttp_client(create_app(tiny_settings(tiny_llama_dir)))
    body = {"model": client.app[STATE].model_name, "prompt": list(range(100, 150)), "max_tokens": 20,
            "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    usage = (await resp.json())["usage"]
    # every full block of computed KV is cached: the prompt's and the answer's but its last token (never fed back)
    num_cached = (usage["prompt_tokens"] + usage["completion_tokens"] - 1) // BLOCK
    assert (usage["prompt_tokens"], usage["completion_tokens"], num_cached) == (50, 20, 4)
    stats = await (await client.get("/v1/cache/stats")).json()
    assert stats["kv_blocks"] == {"total": BLOCKS, "used": 0, "cached": num_cached, "free": BLOCKS,
                                  "free_cached": num_cached, "free_empty": BLOCKS - num_cached}
