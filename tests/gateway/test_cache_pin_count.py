"""GET /v1/cache counts a tenant's pinned blocks as `prefixgate_tenant_pinned_blocks` does: a block held by
several pins (two breakpoints on one prefix) counts once."""
from __future__ import annotations

import httpx

from gateway.settings import ApiKey
from tests.support.gateway_helpers import LiveServer, tiny_settings

BS = 16


def test_overlapping_pins_count_their_shared_blocks_once(tiny_llama_dir):
    short = list(range(100, 100 + 2 * BS + 8))  # 2 full blocks
    long = short + list(range(300, 300 + 2 * BS))  # the same 2, and 2 more
    auth = {"Authorization": "Bearer sk-alice"}
    with LiveServer(tiny_settings(tiny_llama_dir, keys=(ApiKey("sk-alice", "alice"),))) as server:
        for prompt in (short, long):
            warmed = httpx.post(server.url + "/v1/cache/warm", headers=auth, timeout=60,
                                json={"prompt": prompt, "cache_control": {"type": "ephemeral", "ttl": "1h"}})
            assert warmed.status_code == 200, warmed.text
        listed = httpx.get(server.url + "/v1/cache", headers=auth).json()
        metrics = httpx.get(server.url + "/metrics").text
    assert [pin["blocks"] for pin in listed["data"]] == [2, 4]
    assert listed["pinned_blocks"] == 4  # not 2 + 4
    model = server.state.model_name
    assert f'prefixgate_tenant_pinned_blocks{{model_name="{model}",tenant="alice"}} 4.0' in metrics
