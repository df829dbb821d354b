"""Fuzzing: schemathesis drives valid and malformed requests from our OpenAPI document at a live
gateway (tiny model, max_tokens capped): no 5xx, every 4xx an OpenAI error object, the server
healthy and every KV block released afterwards."""
from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import content_type_conformance, response_schema_conformance

from gateway.openapi import build_openapi
from gateway.settings import ApiKey
from tests.gateway_helpers import LiveServer, is_error_body, tiny_settings

# examples per (operation, mode); hypothesis may stop early on an operation with few distinct inputs
BUDGET = {
    ("/v1/chat/completions", GenerationMode.POSITIVE): 250,
    ("/v1/chat/completions", GenerationMode.NEGATIVE): 250,
    ("/v1/completions", GenerationMode.POSITIVE): 500,
    ("/v1/completions", GenerationMode.NEGATIVE): 500,
}
RAW_EXAMPLES = 600
MIN_REQUESTS = 2000
KEY = "sk-fuzz-tenant"
FUZZ_SETTINGS = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck),
                         print_blob=True)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # max_tokens capped at 4 and a short context: every generated request is cheap to serve
    config = tiny_settings(tiny_llama_dir, keys=(ApiKey(KEY, "fuzz"),), engine={"max_model_len": 512},
                           max_tokens_limit=4, max_waiting_requests=512)
    with LiveServer(config) as live:
        yield live


@pytest.fixture(scope="module")
def http():
    with requests.Session() as session:
        yield session


class Tally:
    def __init__(self) -> None:
        self.statuses: Counter[int] = Counter()
        self.seconds = 0.0  # waiting for the server

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())


TALLY = Tally()


def check_response(resp: requests.Response, stream_requested: bool) -> None:
    TALLY.statuses[resp.status_code] += 1
    what = f"{resp.request.method} {resp.request.url} {resp.request.body!r:.300} -> {resp.status_code} " \
           f"{dict(resp.headers)} {resp.text[:300]!r}"
    assert resp.status_code < 500, what
    content_type = resp.headers.get("Content-Type", "")
    if resp.status_code >= 400:
        assert content_type.startswith("application/json"), what
        assert is_error_body(resp.json()), what
    elif content_type.startswith("text/event-stream"):
        assert stream_requested
        lines = resp.content.decode().split("\n")  # not splitlines(): the text may hold U+2028 and the like
        events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", what + resp.text[-300:]
        assert all("error" not in json.loads(e) for e in events[:-1])
    else:
        assert content_type.startswith(("application/json", "text/plain")), what
        resp.json() if content_type.startswith("application/json") else resp.text


def test_openapi_document_is_served_and_valid(server, http):
    resp = http.get(server.url + "/openapi.json")
    assert resp.status_code == 200
    doc = resp.json()
    state = server.state
    assert doc == build_openapi(state.model_name, state.engine.tokenizer.vocab_size, state.settings.gateway)
    schema = schemathesis.openapi.from_dict(doc)  # parses and resolves every reference
    assert {op.path for op in (r.ok() for r in schema.get_all_operations())} >= {
        "/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    TALLY.statuses[resp.status_code] += 1


@pytest.mark.parametrize("path, mode", list(BUDGET), ids=lambda v: getattr(v, "value", v))
def test_generated_requests(server, http, path, mode):
    schema = schemathesis.openapi.from_dict(http.get(server.url + "/openapi.json").json())
    operation = schema[path]["POST"]
    auth = st.sampled_from([{"Authorization": f"Bearer {KEY}"}] * 4 + [{}, {"Authorization": "Bearer wrong"}])

    @settings(FUZZ_SETTINGS, max_examples=BUDGET[path, mode])
    @given(case=operation.as_strategy(generation_mode=mode), headers=auth)
    def run(case, headers):
        started = time.perf_counter()
        # sent with requests itself: schemathesis's own call stops reading a stream after a few events
        resp = http.request(**case.as_transport_kwargs(base_url=server.url, headers=headers), timeout=60)
        TALLY.seconds += time.perf_counter() - started
        stream = isinstance(case.body, dict) and case.body.get("stream") is True
        check_response(resp, stream)
        if resp.status_code < 300 and not stream:  # the body matches the document's schema
            case.validate_response(resp, checks=[response_schema_conformance, content_type_conformance])

    run()
    print(f"{path} {mode.value}: {TALLY.sent} requests so far, {TALLY.seconds:.1f}s waiting for the server")


@settings(FUZZ_SETTINGS, max_examples=RAW_EXAMPLES)
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                             "/openapi.json", "/v1/", "/%00", "/v1/completions/../models"]),
       body=st.one_of(st.binary(max_size=256), st.text(max_size=64).map(str.encode),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                                   lambda inner: st.lists(inner, max_size=4)
                                   | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                                   max_leaves=12).map(lambda v: json.dumps(v).encode())),
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                     "multipart/form-data; boundary=x", ""]))
def _raw_requests(server, http, method, path, body, content_type):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": content_type}
    resp = http.request(method, server.url + path, data=body, headers=headers, timeout=60)
    check_response(resp, False)


def test_raw_bodies_methods_and_content_types(server, http):
    _raw_requests(server, http)


def test_zz_server_healthy_and_nothing_held_after_fuzzing(server, http):
    """Runs last in this module: the totals of the whole fuzz run."""
    assert http.get(server.url + "/health").status_code == 200
    body = {"model": server.state.model_name, "messages": [{"role": "user", "content": "still there?"}],
            "max_tokens": 2}
    assert http.post(server.url + "/v1/chat/completions", json=body,
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    server.wait_idle()
    print(f"fuzz: {TALLY.sent} requests, statuses {dict(sorted(TALLY.statuses.items()))}")
    assert TALLY.sent >= MIN_REQUESTS
    assert not [s for s in TALLY.statuses if s >= 500]
