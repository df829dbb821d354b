"""Fuzzing: schemathesis drives valid and malformed requests from our OpenAPI document at a live
gateway (tiny model, max_tokens capped): no 5xx, every 4xx an OpenAI error object, the server
healthy and every KV block released afterwards."""
from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import content_type_conformance, response_schema_conformance

from gateway.openapi import build_openapi
from gateway.settings import ApiKey
from tests.gateway.field_corpus import field_corpus
from tests.support.gateway_helpers import LiveServer, is_error_body, tiny_settings

pytestmark = pytest.mark.fuzz

# examples per (path, method, mode); hypothesis may stop early on an operation with few distinct inputs
POS, NEG = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
BUDGET = {
    ("/v1/chat/completions", "POST", POS): 150, ("/v1/chat/completions", "POST", NEG): 150,
    ("/v1/completions", "POST", POS): 200, ("/v1/completions", "POST", NEG): 200,
    ("/v1/responses", "POST", POS): 150, ("/v1/responses", "POST", NEG): 150,
    ("/v1/responses/input_tokens", "POST", POS): 30, ("/v1/responses/input_tokens", "POST", NEG): 30,
    ("/v1/embeddings", "POST", POS): 60, ("/v1/embeddings", "POST", NEG): 60,
    ("/v1/cache/warm", "POST", POS): 40, ("/v1/cache/warm", "POST", NEG): 40,
    ("/tokenize", "POST", POS): 30, ("/tokenize", "POST", NEG): 30,
    ("/detokenize", "POST", POS): 20, ("/detokenize", "POST", NEG): 20,
    **{(path, method, POS): 10 for path, method in [
        ("/v1/models", "GET"), ("/v1/models/{model_id}", "GET"), ("/v1/cache", "GET"), ("/v1/cache", "DELETE"),
        ("/v1/cache/stats", "GET"), ("/v1/responses/{response_id}", "GET"), ("/v1/responses/{response_id}", "DELETE"),
        ("/v1/responses/{response_id}/input_items", "GET"), ("/v1/responses/{response_id}/cancel", "POST"),
        ("/health", "GET"), ("/ping", "GET"), ("/ping", "POST"), ("/version", "GET"), ("/metrics", "GET"),
        ("/openapi.json", "GET"), ("/tokenizer_info", "GET")]},
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
        if resp.request.path_url.startswith("/v1/responses"):  # typed events, no [DONE] (as OpenAI's)
            kinds = [json.loads(e)["type"] for e in events]
            assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), what
            assert "error" not in kinds, what
        else:
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
    documented = {(op.path, op.method.upper()) for op in (r.ok() for r in schema.get_all_operations())}
    assert documented == {(path, method) for path, method, _ in BUDGET}  # every route, and each one fuzzed
    served = {(route.resource.canonical, route.method) for route in server.app.router.routes()
              if route.method not in ("HEAD", "OPTIONS") and not route.resource.canonical.startswith("/static")}
    assert documented == served - {("/", "GET")}  # all but the chat page
    TALLY.statuses[resp.status_code] += 1


@pytest.mark.parametrize("path, method, mode", list(BUDGET), ids=lambda v: getattr(v, "value", v))
def test_generated_requests(server, http, path, method, mode):
    schema = schemathesis.openapi.from_dict(http.get(server.url + "/openapi.json").json())
    operation = schema[path][method]
    auth = st.sampled_from([{"Authorization": f"Bearer {KEY}"}] * 4 + [{}, {"Authorization": "Bearer wrong"}])

    @settings(FUZZ_SETTINGS, max_examples=BUDGET[path, method, mode])
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
    print(f"{method} {path} {mode.value}: {TALLY.sent} requests so far, {TALLY.seconds:.1f}s waiting for the server")


@settings(FUZZ_SETTINGS, max_examples=RAW_EXAMPLES)
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                             "/openapi.json", "/v1/", "/%00", "/v1/completions/../models", "/v1/responses",
                             "/v1/responses/resp_x", "/v1/responses/resp_x/input_items",
                             "/v1/responses/resp_x/cancel", "/v1/embeddings", "/v1/cache", "/v1/cache/warm",
                             "/v1/cache/stats", "/v1/models/x", "/metrics"]),
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


# ---- a hostile corpus (what schemathesis did not find), sent concurrently with normal traffic

def _hostile_corpus(model: str) -> list[tuple[str, bytes]]:
    """(path, raw body): NaN/Infinity, numbers beyond float or 64 bits, lone surrogates, deep nesting,
    mixed-type arrays and wrong types, in every field that reaches the engine, the tokenizer or a salt."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    msgs = '[{"role": "user", "content": "hello"}]'

    def c(extra: str, messages: str = msgs) -> tuple[str, bytes]:
        return chat, f'{{"model": "{model}", "messages": {messages}, "max_tokens": 2{extra}}}'.encode()

    def p(prompt: str, extra: str = "") -> tuple[str, bytes]:
        return comp, f'{{"model": "{model}", "prompt": {prompt}, "max_tokens": 2{extra}}}'.encode()

    corpus = [c(f', "{field}": {value}') for field in ("temperature", "top_p", "top_k", "max_tokens", "seed", "n",
                                                         "top_logprobs", "frequency_penalty")
              for value in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "9" * 400)]
    corpus += [p(f"[1, {n}]") for n in ("NaN", "1e400", "-" + "9" * 30, "9" * 5000, "2.5", "true", "null")]
    corpus += [c("", '[{"role": "user", "content": "\\ud800"}]'), c("", '[{"role": "user", "content": "a\\udfff"}]'),
               c("", '[{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]'),
               c("", '[{"role": "\\ud800", "content": "x"}]'), c(', "cache_salt": "\\ud800"'),
               c(', "stop": "\\udc00"'), c(', "stop": ["ok", "\\udc00"]'), c(', "user": "\\ud800"'),
               c(', "\\ud800": 1'), c(', "stream": true, "cache_salt": "x\\udc00"'),
               (chat, b'{"model": "\\ud800", "messages": ' + msgs.encode() + b"}"),
               p('"\\ud800"'), p('["ok", "\\udfff"]'), p('"x"', ', "cache_salt": "\\ud800"')]
    corpus += [(chat, b"[" * 100_000 + b"]" * 100_000), (comp, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000),
               c("", "[" * 5000 + "]" * 5000), p("[" * 80 + "1" + "]" * 80),
               c(', "stream_options": ' + '{"a": ' * 200 + "1" + "}" * 200)]
    corpus += [p('[1, "a"]'), p('[[1], "a"]'), p('[[1, 2], [3, "x"]]'), p('["a", ["b"]]'), p("[[1], []]"),
               c(', "stop": ["a", 1]'), c("", f'[{msgs[1:-1]}, "user"]'),
               c("", '[{"role": "user", "content": [{"type": "text", "text": "a"}, 1]}]')]
    corpus += [c("", '[{"role": ["user"], "content": "x"}]'), c("", '[{"role": {"a": 1}, "content": "x"}]'),
               c("", '{"role": "user"}'), c(', "temperature": "0.5"'), c(', "n": "2"'), c(', "stream": "true"'),
               c(', "logprobs": "yes"'), c(', "max_tokens": []'), c(', "stream_options": []'),
               c(', "logprobs": true, "top_logprobs": {}'), (chat, f'{{"model": [], "messages": {msgs}}}'.encode())]
    return corpus


def _normal_requests(model: str) -> list[tuple[str, dict]]:
    """Greedy requests whose outputs must not change whatever else the server is sent."""
    bodies = []
    for i in range(12):
        extra = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": i % 3 == 0}
        if i % 2:
            bodies.append(("/v1/completions", {"model": model, "prompt": f"the cache block {i} of the prefix", **extra}))
        else:
            bodies.append(("/v1/chat/completions", {"model": model, **extra, "messages": [
                {"role": "system", "content": "You answer about the capital of France."},
                {"role": "user", "content": f"question {i}: what is the capital?"}]}))
    return bodies


def _output_text(resp: requests.Response) -> str:
    assert resp.status_code == 200, resp.text[:300]
    if not resp.headers["Content-Type"].startswith("text/event-stream"):
        choice = resp.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    events = [json.loads(line[6:]) for line in resp.text.split("\n") if line.startswith("data: {")]
    return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e["choices"])


def test_hostile_corpus_concurrent_with_normal_traffic(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    model = server.state.model_name
    normal = _normal_requests(model)
    hostile = [(path, body, None) for path, body in _hostile_corpus(model)] + field_corpus(model)

    def send_normal(item: tuple[str, dict]) -> str:
        path, body = item
        return _output_text(requests.post(server.url + path, json=body, headers=auth, timeout=60))

    def send_hostile(item: tuple[str, bytes, str | None]) -> requests.Response:
        path, body, _ = item
        return requests.post(server.url + path, data=body, timeout=60,
                             headers={**auth, "Content-Type": "application/json"})

    with ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(send_normal, normal))  # alone first
        server.wait_idle()
        # then each normal request twice, interleaved with the whole corpus twice, all at once
        hostile_futures = [pool.submit(send_hostile, h) for h in hostile * 2]
        normal_futures = [pool.submit(send_normal, n) for n in normal * 2]
        got = [f.result() for f in normal_futures]
        answers = [f.result() for f in hostile_futures]
    assert len(hostile) >= 240
    for (path, body, param), resp in zip(hostile * 2, answers):
        what = f"{path} {body[:300]!r} -> {resp.status_code} {resp.text[:200]}"
        assert 400 <= resp.status_code < 500 and is_error_body(resp.json()), what
        if param is not None:  # the error names the one field at fault
            assert resp.json()["error"]["param"] == param, what
        TALLY.statuses[resp.status_code] += 1
    assert got == expected * 2  # greedy outputs unchanged by the hostile traffic around them
    server.wait_idle()  # nothing held: every block free, no reference left
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_10mb_bodies_on_every_route_and_method(server, http):
    """A body past max_body_bytes is refused on every route and method (413, 405 for a method a route does not
    serve, 404 for a stored response that is not there), unread and as an error object."""
    paths = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/resp_x",
             "/v1/responses/resp_x/input_items", "/v1/responses/resp_x/cancel", "/v1/embeddings", "/v1/cache",
             "/v1/cache/warm", "/v1/cache/stats", "/v1/models", "/v1/models/x", "/health", "/metrics", "/openapi.json"]
    body = b'{"a": "' + b"x" * (10 * 1024 * 1024) + b'"}'
    for path in paths:
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
            resp = http.request(method, server.url + path, data=body, timeout=60,
                                headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            check_response(resp, False)
            assert resp.status_code in (404, 405, 413), f"{method} {path} -> {resp.status_code} {resp.text[:200]}"


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

