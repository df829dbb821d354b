"""A client that times out and retries leaves no orphan: the openai SDK closes the connection when its timeout
fires and sends the request again; the server must abort each attempt when its client goes, not run it to its
max_tokens (issue 45 saw an SDK give up after 600 s and silently send the same long request again)."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.engine_faults import set_step_hook
from tests.support.gateway_helpers import LiveServer, ask, tiny_settings

pytestmark = pytest.mark.server


def finished_by_reason(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {sample.labels["finish_reason"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "prefixgate_requests_finished" for sample in family.samples
            if sample.name.endswith("_total")}


def wait_finished(url: str, count: int, timeout: float = 10.0) -> dict[str, float]:
    # the engine thread reports a step's finished requests after the step: the scrape may come first
    deadline = time.monotonic() + timeout
    while sum((reasons := finished_by_reason(url)).values()) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return reasons


def test_a_timed_out_and_retried_request_leaves_nothing_running(tiny_llama_dir, monkeypatch):
    release = threading.Event()
    with LiveServer(tiny_settings(tiny_llama_dir)) as server:
        # every forward pass waits until the client has given up, so no attempt can finish first
        set_step_hook(server.engine, lambda: release.wait(60))
        generated: list[str] = []
        generate = server.engine.generate

        def counted(request_id: str, *args, **kwargs):
            generated.append(request_id)
            return generate(request_id, *args, **kwargs)

        monkeypatch.setattr(server.engine, "generate", counted)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=1.0, max_retries=1)
        try:
            with client, pytest.raises(openai.APITimeoutError):
                client.chat.completions.create(model=server.state.model_name, messages=ask("count to a thousand"),
                                               max_tokens=1000, extra_body={"ignore_eos": True})
        finally:
            release.set()
        server.wait_idle()  # no request left in the engine, every KV block back in the free queue
        reasons = wait_finished(server.url, len(generated))
    # the attempts that reached the engine (both, unless a loaded machine kept one from the handler for 1 s)
    assert 1 <= len(generated) <= 2
    assert reasons == {"stop": 0, "length": 0, "abort": len(generated), "error": 0}  # aborted, none ran on
