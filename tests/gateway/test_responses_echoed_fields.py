"""Fields a Responses request sends that the response echoes must be of their documented type even when they do
nothing (`parallel_tool_calls` without tools): schemathesis found a string echoed back in a 200."""
from __future__ import annotations

import pytest

from gateway.app import create_app
from gateway.state import STATE
from tests.support.gateway_helpers import tiny_settings


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir):
    return await aiohttp_client(create_app(tiny_settings(tiny_llama_dir)))


@pytest.mark.parametrize("value", ["g$", 1, [], {}])
async def test_a_parallel_tool_calls_that_is_no_boolean_is_a_400_without_tools_too(client, value):
    resp = await client.post("/v1/responses", json={"model": client.app[STATE].model_name, "input": "hi",
                                                    "max_output_tokens": 1, "parallel_tool_calls": value})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "parallel_tool_calls"


async def test_a_boolean_parallel_tool_calls_without_tools_is_echoed(client):
    resp = await client.post("/v1/responses", json={"model": client.app[STATE].model_name, "input": "hi",
                                                    "max_output_tokens": 1, "parallel_tool_calls": False})
    assert resp.status == 200 and (await resp.json())["parallel_tool_calls"] is False
