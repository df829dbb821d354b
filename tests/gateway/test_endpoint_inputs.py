"""Malformed input on the newer endpoints gets a 400 naming the field, never a 500: the Responses API's
input items and content parts, embeddings at the context's edge, and bodies sent with methods that take
none; and their answers match the OpenAPI document."""
from __future__ import annotations

import json

import pytest
import requests

from tests.gateway.test_openapi_responses import assert_matches
from tests.support.gateway_helpers import LiveServer, is_error_body, tiny_settings

CONTEXT = 512  # max_model_len: an embedding input may fill all of it (and a tools prompt fits)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir, engine={"max_model_len": CONTEXT}, max_tokens_limit=2)) as live:
        yield live


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json={"model": server.state.model_name, **body}, timeout=60)


def assert_400(resp: requests.Response, param: str | None) -> None:
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert is_error_body(body) and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param, body


def message(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


@pytest.mark.parametrize("items, param", [
    (message({"type": "input_text", "text": 5}), "input[0].content[0].text"),
    (message({"type": "input_text", "text": None}), "input[0].content[0].text"),
    (message({"type": "input_text", "text": ["a"]}), "input[0].content[0].text"),
    (message({"type": "input_text"}), "input[0].content[0].text"),
    (message({"type": "input_text", "text": "ok"}, {"type": "output_text", "text": {"a": 1}}),
     "input[0].content[1].text"),
    (message({"type": "input_image", "image_url": "x"}), "input[0].content[0].type"),
    (message({"type": ["input_text"], "text": "x"}), "input[0].content[0].type"),
    (message("just text"), "input[0].content[0]"),
    ([{"role": "user", "content": 5}], "input[0].content"),
    ([{"role": "user", "content": None}], "input[0].content"),
    ([{"role": ["user"], "content": "x"}], "input[0].role"),
    ([{"role": {"a": 1}, "content": "x"}], "input[0].role"),
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"content": "x"}], "input[0].role"),
    ([{"role": "user", "content": "x"}, {"type": {"a": 1}}], "input[1].type"),
    ([{"role": "user", "content": "x", "id": 7}], "input[0].id"),
    ([{"type": "function_call", "call_id": "c1", "name": ["f"], "arguments": "{}"}], "input[0].name"),
    ([{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"a": 1}}], "input[0].arguments"),
    ([{"type": "function_call_output", "output": "sunny"}], "input[0].call_id"),
    ([{"type": "function_call_output", "call_id": "c1"}], "input[0].output"),
    (["hello"], "input[0]"),
])
def test_malformed_input_items_name_the_field(server, items, param):
    assert_400(post(server, "/v1/responses", {"input": items, "max_output_tokens": 2}), param)


@pytest.mark.parametrize("extra, param", [
    ({"text": 5}, "text"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 5}]}, "tools[0].parameters"),
    ({"tools": 5}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"background": True}, "background"),
    ({"previous_response_id": 5}, "previous_response_id"),
    ({"instructions": 5}, "instructions"),
    ({"input": []}, "input"),
    ({"metadata": 5}, "metadata"),
    ({"store": "yes"}, "store"),
    ({"max_output_tokens": -1}, "max_output_tokens"),  # the chat parser's max_tokens, by its Responses name
])
def test_malformed_top_level_fields_name_the_field(server, extra, param):
    assert_400(post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2, **extra}), param)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": "5m"}]}]}, "messages[0].content[0].cache_control"),
    ("/v1/chat/completions", {**CHAT, "cache_control": ["ephemeral"]}, "cache_control[0]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "cache_control": {"type": "ephemeral", "tokens": 0}},
     "cache_control.tokens"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": [1, 2]}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": "json"}, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"json": 5}}, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": ""}}, "structured_outputs"),
])
def test_malformed_sampling_and_cache_fields_name_the_field(server, path, body, param):
    """Cases that only the schemathesis fuzz reached before its calls ran untraced (tests/conftest.py)."""
    assert_400(post(server, path, body), param)


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},  # no schema: any JSON object
    {"structured_outputs": {"json_object": True}},
    {"structured_outputs": {"json": '{"type": "object"}'}},  # the schema as JSON text
])
def test_each_output_format_spelling_answers(server, extra):
    resp = post(server, "/v1/chat/completions", {**CHAT, **extra})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_body_that_is_not_an_object_is_refused(server):
    for path in ("/v1/responses", "/v1/chat/completions"):
        assert_400(requests.post(server.url + path, json=[{"input": "hi"}], timeout=60), None)


def test_a_message_that_is_not_an_object_names_it(server):
    assert_400(post(server, "/v1/chat/completions", {**CHAT, "messages": ["hi"]}), "messages[0]")


def test_warming_another_models_cache_is_a_404(server):
    resp = requests.post(server.url + "/v1/cache/warm", json={"model": "no-such-model", "prompt": "hi"}, timeout=60)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "hi", "text": {}}),  # text without a format: plain text
    ("/v1/responses", {"input": "hi", "parallel_tool_calls": False,
                       "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
    ("/v1/chat/completions", {"messages": [  # a tool call whose arguments are not JSON is kept as its text
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]}),
])
def test_optional_shapes_still_answer(server, path, body):
    resp = post(server, path, {**body, "max_output_tokens" if "input" in body else "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def test_well_formed_items_still_answer(server):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": {"temp": 21}}]
    resp = post(server, "/v1/responses", {"input": items, "max_output_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] in ("completed", "incomplete")


def test_an_embedding_input_may_fill_the_whole_context(server):
    resp = post(server, "/v1/embeddings", {"input": [[7] * CONTEXT]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == CONTEXT
    resp = post(server, "/v1/embeddings", {"input": [[7] * (CONTEXT + 1)]})
    assert_400(resp, "input")
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert f"the limit is {CONTEXT} " in resp.json()["error"]["message"]
    server.wait_idle()


@pytest.mark.parametrize("method, path", [("GET", "/v1/cache"), ("DELETE", "/v1/cache"), ("GET", "/v1/models"),
                                          ("GET", "/health"), ("DELETE", "/v1/responses/resp_x")])
def test_a_body_on_a_method_that_takes_none_is_refused(server, method, path):
    resp = requests.request(method, server.url + path, data=json.dumps({"a": 1}), timeout=60,
                            headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and is_error_body(resp.json()), resp.text
    assert resp.json()["error"]["code"] == "unexpected_body"
    big = b"x" * (server.settings.gateway.max_body_bytes + 1)
    resp = requests.request(method, server.url + path, data=big, timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large", resp.text
    assert requests.request(method, server.url + path, timeout=60).status_code in (200, 404)  # no body: served


def test_the_newer_endpoints_answer_as_the_document_describes(server):
    spec = requests.get(server.url + "/openapi.json", timeout=30).json()

    def check(path: str, method: str, body) -> None:
        schema = spec["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        assert_matches(spec, schema, body)

    answer = post(server, "/v1/responses", {"input": "hello", "max_output_tokens": 2, "metadata": {"k": "v"},
                                            "include": ["message.output_text.logprobs"], "top_logprobs": 2,
                                            "ignore_eos": True})
    assert len(answer.json()["output"][0]["content"][0]["logprobs"]) == 2
    assert answer.status_code == 200, answer.text
    check("/v1/responses", "post", answer.json())
    response_id = answer.json()["id"]
    check("/v1/responses/{response_id}", "get", requests.get(f"{server.url}/v1/responses/{response_id}").json())
    check("/v1/responses/{response_id}/input_items", "get",
          requests.get(f"{server.url}/v1/responses/{response_id}/input_items").json())
    check("/v1/responses/{response_id}", "delete", requests.delete(f"{server.url}/v1/responses/{response_id}").json())
    for inputs, encoding in ((["a", "b"], "float"), ([[1, 2]], "base64")):
        check("/v1/embeddings", "post", post(server, "/v1/embeddings", {"input": inputs,
                                                                        "encoding_format": encoding}).json())
    check("/v1/cache/stats", "get", requests.get(server.url + "/v1/cache/stats").json())


@pytest.mark.parametrize("extra, param", [
    ({"conversation": "conv_123"}, "conversation"),  # no Conversations API: never a silent 200 without its state
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 3}, "top_logprobs"),  # (without include message.output_text.logprobs: nothing to return)
    ({"top_logprobs": "3"}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 10**6}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": -1}, "top_logprobs"),
    ({"truncation": "x"}, "truncation"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"tool_choice": "required"}, "tool_choice"),  # (no tools: a forced call would be dropped in silence)
    ({"previous_response_id": ""}, "previous_response_id"),  # (not taken as absent)
    ({"include": ["reasoning.encrypted_content", "x"]}, "include[1]"),
    ({"metadata": {"k": 5}}, "metadata.k"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 10**12}, "max_output_tokens"),  # past the context: the check after rendering
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "sunny"}]}, "input[0].call_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "banana"}}], "tool_choice": "required"},
     "tools[0].parameters"),
])
def test_responses_fields_it_cannot_honour_are_400s(server, extra, param):
    assert_400(post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2, **extra}), param)


def test_responses_fields_it_accepts_answer(server):
    resp = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "truncation": "auto",
                                          "include": ["reasoning.encrypted_content"], "top_logprobs": 0.0,
                                          "metadata": {f"k{i}": "v" * 512 for i in range(16)},
                                          "tool_choice": "none", "parallel_tool_calls": None})
    assert resp.status_code == 200, resp.text
    # echoed as OpenAI's Response types them: a null sent is its default
    assert (resp.json()["top_logprobs"], resp.json()["parallel_tool_calls"]) == (0, True)
    asked = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "top_logprobs": 3.0,
                                           "include": ["message.output_text.logprobs"], "tool_choice": None})
    assert (asked.json()["top_logprobs"], asked.json()["tool_choice"]) == (3, "auto"), asked.text
    stored = requests.get(f"{server.url}/v1/responses/{asked.json()['id']}", params={"stream": "False"}, timeout=30)
    assert stored.status_code == 200, stored.text


@pytest.mark.parametrize("tool_choice, param", [
    ("required", "tools[1].function.parameters"),
    ({"type": "function", "function": {"name": "g"}}, "tools[1].function.parameters"),
])
def test_a_forced_call_whose_schema_does_not_compile_is_a_400_before_the_answer(server, tool_choice, param):
    """The engine compiles a forced call's grammar as the answer starts: a schema it cannot run was a 500 there."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
                 "a": {"type": "string", "pattern": "(("}}}}}]
    resp = post(server, "/v1/chat/completions", {**CHAT, "tools": tools, "tool_choice": tool_choice})
    assert_400(resp, param)
    assert "regex" in resp.json()["error"]["message"]
    # shown to the model only (auto), the schema is not the grammar engine's to judge
    assert post(server, "/v1/chat/completions", {**CHAT, "tools": tools}).status_code == 200
    legacy = post(server, "/v1/chat/completions", {**CHAT, "functions": [t["function"] for t in tools],
                                                    "function_call": {"name": "g"}})
    assert_400(legacy, "functions[1].parameters")


def test_a_grammar_that_gives_up_while_answering_is_the_requests_400(server):
    """llguidance builds its lexer lazily: this regex passes the checks and exceeds its limits once its lexer has
    grown (here by the second request's first mask). That ends the request as its own failure, a 400, where it was
    a 500, or an empty 200 that ignored the constraint."""
    statuses = []
    for _ in range(2):
        resp = post(server, "/v1/chat/completions", {**CHAT, "temperature": 0, "guided_regex": "x{1000}{1000}"})
        statuses.append(resp.status_code)
        if resp.status_code == 200:
            assert set(resp.json()["choices"][0]["message"]["content"]) == {"x"}, resp.text
        else:
            assert_400(resp, None)
            assert resp.json()["error"]["code"] == "output_constraint_failed", resp.text
            message = resp.json()["error"]["message"]
            assert "too many expressions" in message and len(message) <= 403  # (not the grammar engine's KBs)
    assert 400 in statuses
    server.wait_idle()


def test_a_message_name_that_is_not_a_string_names_it(server):
    assert_400(post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi",
                                                                             "name": 5}]}), "messages[0].name")


def test_a_body_its_content_encoding_does_not_decode_is_a_400(server):
    with requests.Session() as session:
        resp = session.post(server.url + "/v1/chat/completions", data=json.dumps({"model": server.state.model_name,
                                                                                  **CHAT}),
                            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}, timeout=60)
        assert_400(resp, None)
        assert resp.json()["error"]["code"] == "invalid_body" and resp.headers["Connection"] == "close"
        assert session.post(server.url + "/v1/chat/completions", json={"model": server.state.model_name, **CHAT},
                            timeout=60).status_code == 200


def test_the_chat_pages_files_fail_as_json_too(server):
    missing = requests.get(server.url + "/static/nope.js", timeout=30)
    assert missing.status_code == 404 and is_error_body(missing.json()), missing.text
    folder = requests.get(server.url + "/static/", timeout=30)
    assert folder.status_code in (403, 404) and folder.json()["error"]["type"] == "invalid_request_error"


def test_input_items_come_in_pages(server):
    items = [{"role": "user", "content": f"turn {i}"} for i in range(5)]
    response_id = post(server, "/v1/responses", {"input": items, "max_output_tokens": 2}).json()["id"]
    url = f"{server.url}/v1/responses/{response_id}/input_items"
    default = requests.get(url, timeout=30).json()  # newest first, as OpenAI lists them

    def text(page: dict) -> list[str]:  # (a message's text is listed as parts)
        return [i["content"][0]["text"] for i in page["data"]]
    assert text(default) == [f"turn {i}" for i in range(4, -1, -1)]
    assert not default["has_more"] and default["first_id"] == default["data"][0]["id"]
    first = requests.get(url, params={"limit": 2, "order": "asc"}, timeout=30).json()
    assert text(first) == ["turn 0", "turn 1"] and first["has_more"]
    second = requests.get(url, params={"limit": 2, "order": "asc", "after": first["last_id"]}, timeout=30).json()
    assert text(second) == ["turn 2", "turn 3"] and second["has_more"]
    for query, param in (({"limit": "abc"}, "limit"), ({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                         ({"limit": "²"}, "limit"), ({"order": "bad"}, "order"), ({"after": "msg_nope"}, "after")):
        assert_400(requests.get(url, params=query, timeout=30), param)  # ("²": a digit to str.isdigit, was a 500)
    # an item sent with null for its id or status is listed with the ones it would have had, as the SDK types them
    nulls = [{"role": "user", "content": "hi", "id": None, "status": None}, {"role": "user", "content": "again"}]
    response_id = post(server, "/v1/responses", {"input": nulls, "max_output_tokens": 2}).json()["id"]
    listed = requests.get(f"{server.url}/v1/responses/{response_id}/input_items", timeout=30).json()["data"]
    assert all(isinstance(i["id"], str) and i["status"] == "completed" for i in listed), listed
    assert len({i["id"] for i in listed}) == 2


def test_warming_honours_and_bounds_the_messages_own_breakpoints(server):
    marked = [{"role": "user", "content": f"part {i} " * 8, "cache_control": {"type": "ephemeral"}}
              for i in range(5)]
    resp = requests.post(server.url + "/v1/cache/warm", json={"messages": marked}, timeout=60)
    assert_400(resp, "messages[4].cache_control")
    resp = requests.post(server.url + "/v1/cache/warm", json={"messages": marked[:2] + [
        {"role": "user", "content": "tail " * 8}]}, timeout=60)
    assert resp.status_code == 200, resp.text
    pins = requests.get(server.url + "/v1/cache", timeout=30).json()["data"]
    lengths = sorted(p["tokens"] for p in pins)
    # the whole prompt (its full blocks), and the prefixes its two marked messages end (each shorter)
    assert len(set(lengths)) == 3 and lengths[-1] <= resp.json()["usage"]["prompt_tokens"], pins
    requests.delete(server.url + "/v1/cache", timeout=30)


def test_tokenize_counts_as_the_generation_routes_do(server):
    """A chat's count is the prompt_tokens a chat completion of it reports (its template, its tools); a text's is
    a completion's; detokenize gives the text back."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, tokenizer"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({}, {"tools": tools}):
        counted = post(server, "/tokenize", {"messages": messages, **extra})
        assert counted.status_code == 200, counted.text
        chat = post(server, "/v1/chat/completions", {**CHAT, "messages": messages, **extra}).json()
        assert counted.json()["count"] == len(counted.json()["tokens"]) == chat["usage"]["prompt_tokens"]
        assert counted.json()["max_model_len"] == CONTEXT and counted.json()["token_strs"] is None
    with_header = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    without = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert len(without) < len(with_header) and with_header[:len(without)] == without  # the assistant's header
    text = "The capital of France is Paris."
    counted = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    completion = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert counted["count"] == completion["usage"]["prompt_tokens"]
    assert "".join(counted["token_strs"]) == text
    assert post(server, "/detokenize", {"tokens": counted["tokens"]}).json() == {"prompt": text}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    server.wait_idle()


def test_a_chat_prompt_ends_as_add_generation_prompt_and_continue_final_message_say(server):
    """vLLM's two fields: the answer starts a new assistant message (the default), follows a closed last message,
    or continues the final assistant message's text (its closing cut); chat completions and /tokenize agree."""
    messages = [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Autumn moonlight"}]
    endings = {"new answer": {}, "closed": {"add_generation_prompt": False},
               "continued": {"add_generation_prompt": False, "continue_final_message": True}}
    counted = {name: post(server, "/tokenize", {"messages": messages, **ending}).json()
               for name, ending in endings.items()}
    for name, ending in endings.items():
        chat = post(server, "/v1/chat/completions", {**CHAT, "messages": messages, **ending})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == counted[name]["count"], name
    tokens = {name: c["tokens"] for name, c in counted.items()}
    assert tokens["closed"] == tokens["new answer"][:len(tokens["closed"])]  # the header after the closed turn
    assert tokens["continued"] == tokens["closed"][:len(tokens["continued"])] and \
        len(tokens["continued"]) < len(tokens["closed"])  # the closing cut
    assert post(server, "/detokenize", {"tokens": tokens["continued"]}).json()["prompt"].endswith("Autumn moonlight")
    # cut where the final message's text ends, not at a match of it inside the template's closing
    for final in ("The answer is ", "<", "im"):
        continued = post(server, "/tokenize", {"messages": [messages[0], {"role": "assistant", "content": final}],
                                               **endings["continued"]}).json()["tokens"]
        text = post(server, "/detokenize", {"tokens": continued}).json()["prompt"]
        assert text.endswith(final) and text.removesuffix(final).endswith("assistant\n"), (final, text[-40:])
    server.wait_idle()


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "messages"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
     "continue_final_message"),  # (with add_generation_prompt's default, true)
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True,
                   "add_generation_prompt": False}, "messages"),  # no assistant message to continue
    ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
])
def test_tokenize_and_detokenize_refuse_what_they_cannot_read(server, path, body, param):
    assert_400(post(server, path, body), param)
    resp = requests.post(server.url + path, json={**body, "model": "no-such-model"}, timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_served_model_names_replace_the_models_own(tiny_llama_dir):
    """vLLM's --served-model-name: answers, /v1/models and the metrics carry the first, each selects the model, and
    the model's own name no longer does."""
    from gateway.__main__ import build_parser

    args = build_parser().parse_args(["serve", "--served-model-name", "team-model", "alias"])
    assert list(getattr(args, "gateway.served_model_name")) == ["team-model", "alias"]
    with LiveServer(tiny_settings(tiny_llama_dir, served_model_name=("team-model", "alias"))) as live:
        assert [m["id"] for m in requests.get(live.url + "/v1/models", timeout=30).json()["data"]] == ["team-model"]
        answer = requests.post(live.url + "/v1/chat/completions", timeout=60, json={**CHAT, "model": "alias"})
        assert answer.status_code == 200 and answer.json()["model"] == "team-model", answer.text
        own = requests.post(live.url + "/v1/chat/completions", timeout=60,
                            json={**CHAT, "model": live.state.engine.model_name})
        assert own.status_code == 404 and "team-model" in own.json()["error"]["message"]
        assert 'model_name="team-model"' in requests.get(live.url + "/metrics", timeout=30).text


def test_detokenize_gives_text_that_encodes_to_the_same_ids(server):
    """Special tokens' text included (as vLLM's /detokenize and transformers' decode): a chat's rendered prompt comes
    back as text that /tokenize (a prompt, no BOS added) turns into the same ids."""
    ids = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hello there"}]}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.startswith("<|im_start|>")
    assert post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"] == ids
