"""Real responses against the response schemas of our own /openapi.json, so the document and the
gateway cannot drift apart: chat completions (plain with logprobs, a tool call forced by the grammar,
tool calls parsed out of the text around them), text completions, each streamed and not, the model
list, health and an error. The response schemas are closed objects, so a field the gateway sends but
the document does not describe fails here, as does a described field it stops sending."""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import requests

from tests.support.gateway_helpers import ask
from tests.gateway.test_tools_api import TIME, TWO_CALLS, WEATHER, pieces
from tests.gateway.test_tools_api import server  # noqa: F401  (fixture: a live gateway whose sampled text a test may script)
from tests.gateway.test_tools_forced import NAMED
from tests.gateway.test_tools_forced import WEATHER as BOUNDED_WEATHER  # a random model cannot ramble in its arguments

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def spec(server) -> dict[str, Any]:
    return requests.get(server.url + "/openapi.json", timeout=30).json()


def json_schema(node: Any) -> Any:
    """OpenAPI 3.0's `nullable` in JSON Schema, as schemathesis reads it: the schema, or null."""
    if isinstance(node, list):
        return [json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: json_schema(value) for key, value in node.items() if key != "nullable"}
    return {"anyOf": [converted, {"type": "null"}]} if node.get("nullable") else converted


def assert_matches(spec: dict[str, Any], schema: dict[str, Any], body: Any) -> None:
    """`schema` (a $ref into the document, typically) validated with the document's components."""
    root = {**json_schema(schema), "components": json_schema(spec["components"])}
    jsonschema.Draft4Validator(root).validate(body)  # OpenAPI 3.0's schemas are draft 4's, nearly


def response_schema(spec: dict[str, Any], path: str, method: str = "post", status: int = 200) -> dict[str, Any]:
    return spec["paths"][path][method]["responses"][str(status)]["content"]["application/json"]["schema"]


def post(server, path: str, body: dict[str, Any], script: list[str] | None = None) -> requests.Response:
    server.scripted.script = script
    try:
        return requests.post(server.url + path, json={"model": server.state.model_name, **body}, timeout=120)
    finally:
        server.scripted.script = None


def check_both_ways(server, spec, path: str, body: dict[str, Any], script: list[str] | None = None
                    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The answer, and its stream's chunks (with the usage chunk), each checked against the document."""
    resp = post(server, path, body, script)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert_matches(spec, response_schema(spec, path), answer)
    resp = post(server, path, {**body, "stream": True, "stream_options": {"include_usage": True}}, script)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream"), resp.text
    events = [line[len("data: "):] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    chunk_schema = spec["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["x-stream-chunk"]
    for chunk in chunks:
        assert_matches(spec, chunk_schema, chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] is not None
    assert all(c["usage"] is None for c in chunks[:-1])
    return answer, chunks


def test_plain_chat_completion_with_logprobs(server, spec):
    # ignore_eos: four tokens each, whatever the random model samples
    body = {"messages": ask("Hello?"), "max_tokens": 4, "n": 2, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    answer, chunks = check_both_ways(server, spec, CHAT, body)
    assert [c["message"]["role"] for c in answer["choices"]] == ["assistant", "assistant"]
    assert all(len(c["logprobs"]["content"]) == 4 for c in answer["choices"])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # one choice a chunk, as OpenAI streams them: each choice's role first
    assert all(len(c["choices"]) <= 1 for c in chunks)
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:2]] == [
        (0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]


def test_chat_completion_with_vllms_output_extras(server, spec):
    body = {"messages": ask("Hello?"), "max_tokens": 4, "logprobs": True, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "stop": ["e"]}
    answer, chunks = check_both_ways(server, spec, CHAT, body)
    assert answer["prompt_token_ids"] and "prompt_token_ids" in chunks[0]


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": ask("Hello?")}), (COMPLETIONS, {"prompt": "Hello"})])
def test_vllms_prompt_logprobs(server, spec, path, body):
    """(not streamed: prompt_logprobs with stream is a 400, as in vLLM)"""
    resp = post(server, path, {**body, "max_tokens": 2, "prompt_logprobs": 2})
    assert resp.status_code == 200, resp.text
    assert_matches(spec, response_schema(spec, path), resp.json())


def test_forced_tool_call_has_null_content(server, spec):
    body = {"messages": ask("Weather?"), "tools": [BOUNDED_WEATHER], "tool_choice": NAMED, "max_tokens": 200}
    answer, chunks = check_both_ways(server, spec, CHAT, body)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None  # (named: OpenAI's "stop")
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_weather"]
    deltas = [call for c in chunks for choice in c["choices"] for call in choice["delta"].get("tool_calls", ())]
    assert "id" in deltas[0] and len(deltas) > 1 and "id" not in deltas[-1]  # a head, then argument pieces


def test_tool_calls_parsed_from_text_keep_the_text_around_them(server, spec):
    body = {"messages": ask("Weather and time?"), "tools": [WEATHER, TIME]}
    answer, chunks = check_both_ways(server, spec, CHAT, body, pieces(TWO_CALLS))
    message = answer["choices"][0]["message"]
    assert message["content"] == "Checking." and len(message["tool_calls"]) == 2
    heads = [call for c in chunks for choice in c["choices"] for call in choice["delta"].get("tool_calls", ())
             if "id" in call]
    assert [call["index"] for call in heads] == [0, 1]


@pytest.mark.parametrize("body, num_choices", [
    ({"prompt": "the cache block of the prefix", "max_tokens": 4, "n": 2, "logprobs": 2}, 2),
    ({"prompt": ["the cache block", "of the prefix"], "max_tokens": 3, "echo": True}, 2),
    ({"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 0}, 1),
    ({"prompt": ["the cache block", "of the prefix"], "max_tokens": 3, "n": 2, "logprobs": 1,
      "return_token_ids": True, "return_tokens_as_token_ids": True, "stop": ["e"]}, 4),
    ({"prompt": ["the cache block", "of"], "max_tokens": 2, "logprobs": 2, "echo": True}, 2),
    ({"prompt": [1, 2, 3], "max_tokens": 0, "logprobs": 0, "echo": True}, 1),
], ids=["top-logprobs", "echo", "token-ids", "vllm-extras", "echo-logprobs", "echo-scored-alone"])
def test_text_completion(server, spec, body, num_choices):
    answer, _ = check_both_ways(server, spec, COMPLETIONS, body)
    assert len(answer["choices"]) == num_choices


def test_models_health_and_errors(server, spec):
    name = server.state.model_name
    for path, schema in [("/v1/models", response_schema(spec, "/v1/models", "get")),
                         (f"/v1/models/{name}", response_schema(spec, "/v1/models/{model_id}", "get")),
                         ("/health", response_schema(spec, "/health", "get"))]:
        resp = requests.get(server.url + path, timeout=30)
        assert resp.status_code == 200, resp.text
        assert_matches(spec, schema, resp.json())
    resp = post(server, CHAT, {"messages": ask("Hello?"), "temperature": 5})
    assert resp.status_code == 400
    assert_matches(spec, response_schema(spec, CHAT, status=400), resp.json())


def _extra_field(answer: dict[str, Any]) -> None:
    answer["choices"][0]["message"]["refusal"] = None


def _missing_field(answer: dict[str, Any]) -> None:
    del answer["system_fingerprint"]


def _null_content_without_tool_calls(answer: dict[str, Any]) -> None:
    answer["choices"][0]["message"]["content"] = None


@pytest.mark.parametrize("drift", [_extra_field, _missing_field, _null_content_without_tool_calls],
                         ids=lambda f: f.__name__.strip("_"))
def test_an_answer_the_document_does_not_describe_fails(server, spec, drift):
    answer = post(server, CHAT, {"messages": ask("Hello?"), "max_tokens": 2}).json()
    assert_matches(spec, response_schema(spec, CHAT), answer)
    drift(answer)
    with pytest.raises(jsonschema.ValidationError):
        assert_matches(spec, response_schema(spec, CHAT), answer)
