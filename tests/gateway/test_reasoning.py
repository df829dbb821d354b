"""A reasoning model's thinking in the message's `reasoning` (vLLM's --reasoning-parser), whole and streamed alike:
the splitter on its own (hypothesis), then through HTTP with a Qwen3-style and a DeepSeek-R1-style chat template and a
scripted answer (the engine, prefix cache and HTTP layer are real; only the sampled text is scripted)."""
from __future__ import annotations

import json
import shutil

import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from engine.async_engine import AsyncEngine
from gateway.reasoning import ThinkingSplit, split_whole
from tests.gateway.test_tools_api import CALL_TEXT, WEATHER, ScriptedEngine, pieces
from tests.support.gateway_helpers import LiveServer, tiny_settings

QWEN3_STYLE = (  # thinks unless enable_thinking is false, which closes an empty thinking in the prompt; shows the
    # thinking sent back with an answer
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
DEEPSEEK_STYLE = (  # the prompt opens the thinking: the answer starts inside it
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.mark.parametrize("thinking, text, expected", [
    (False, "<think>Let me see.</think>\n\nParis.", ("Let me see.", "\n\nParis.")),
    (False, "\n <think>a</think>b", ("a", "b")),
    (False, "Paris. <think>not at the start</think>", ("", "Paris. <think>not at the start</think>")),
    (False, "<thinking>x", ("", "<thinking>x")),
    (False, "<thi", ("", "<thi")),
    (False, "<think>cut short by max_tokens", ("cut short by max_tokens", "")),
    (True, "Hmm.</think>Paris", ("Hmm.", "Paris")),
    (True, "all thinking </thi", ("all thinking </thi", "")),
    (False, "", ("", "")),
])
def test_split(thinking, text, expected):
    assert split_whole(text, thinking) == expected


@given(st.booleans(), st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "b"]),
                               max_size=12), st.data())
def test_a_stream_splits_as_the_whole(thinking, parts, data):
    """However the text is cut into deltas, their pieces add up to the whole answer's split, and nothing is lost."""
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    splitter, reasoning, content = ThinkingSplit(thinking), "", ""
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        r, c = splitter.feed(text[start:end])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    assert (reasoning + r, content + c) == split_whole(text, thinking)
    whole_reasoning, whole_content = split_whole(text, thinking)
    assert len(whole_reasoning) + len(whole_content) <= len(text)
    assert whole_content in text and whole_reasoning in text


def _model_with(template: str, source, tmp_path_factory, name: str):
    model_dir = tmp_path_factory.mktemp(name)
    shutil.copytree(source, model_dir, dirs_exist_ok=True)
    (model_dir / "chat_template.jinja").write_text(template)
    return model_dir


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def server(request, tiny_tools_dir, tmp_path_factory):
    template = QWEN3_STYLE if request.param == "qwen3" else DEEPSEEK_STYLE
    settings = tiny_settings(_model_with(template, tiny_tools_dir, tmp_path_factory, request.param),
                             engine={"num_kv_blocks": 256})
    engine = ScriptedEngine(AsyncEngine.from_config(settings.engine))
    with LiveServer(settings, engine) as live:
        live.scripted, live.style = engine, request.param
        yield live


def chat(server, script: list[str], stream: bool = False, **body):
    server.scripted.script = script
    try:
        resp = requests.post(f"{server.url}/v1/chat/completions", timeout=60, stream=stream, json={
            "model": server.state.model_name, "messages": [{"role": "user", "content": "Capital of France?"}],
            "stream": stream, **body})
        assert resp.status_code == 200, resp.text
        if not stream:
            return resp.json()
        return [json.loads(line[6:]) for line in (raw.decode() for raw in resp.iter_lines())
                if line.startswith("data: ") and line != "data: [DONE]"]
    finally:
        server.scripted.script = None


def _joined(chunks, field: str) -> str:
    return "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks if c["choices"])


def test_thinking_goes_to_reasoning_whole_and_streamed(server):
    answer = ("" if server.style == "deepseek_r1" else "<think>") + "Paris is in France.</think>\n\nParis."
    message = chat(server, pieces(answer))["choices"][0]["message"]
    assert message.get("reasoning") == message.get("reasoning_content") == "Paris is in France.", message
    assert message["content"] == "\n\nParis."
    chunks = chat(server, pieces(answer, 2), stream=True)
    assert _joined(chunks, "reasoning") == _joined(chunks, "reasoning_content") == "Paris is in France."
    assert _joined(chunks, "content") == "\n\nParis."
    first_content = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
    assert all(not c["choices"][0]["delta"].get("reasoning") for c in chunks[first_content:] if c["choices"])


def test_no_thinking_when_the_template_closes_it(server):
    if server.style == "deepseek_r1":
        pytest.skip("this template always opens the thinking")
    message = chat(server, pieces("Paris."), chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris."}


def test_a_tool_call_after_the_thinking(server):
    answer = ("" if server.style == "deepseek_r1" else "<think>") + "I need the weather.</think>\n" + CALL_TEXT
    body = {"tools": [WEATHER]}
    message = chat(server, pieces(answer), **body)["choices"][0]["message"]
    assert message["reasoning"] == "I need the weather."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert message["content"] == "\nChecking."
    chunks = chat(server, pieces(answer), stream=True, **body)
    assert _joined(chunks, "reasoning") == "I need the weather." and _joined(chunks, "content") == "\nChecking."
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)


def test_thinking_sent_back_reaches_the_template(server):
    """An earlier answer's thinking (as a client sends it back, under either name) is the template's
    reasoning_content; a wrong type is a 400 naming it."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
                {"role": "user", "content": "again"}]
    def count(sent):
        return requests.post(f"{server.url}/tokenize", json={"messages": sent}, timeout=30).json()["count"]

    plain = [messages[0], {"role": "assistant", "content": "Hello."}, messages[2]]
    renamed = [messages[0], {"role": "assistant", "content": "Hello.", "reasoning": "greet back"}, messages[2]]
    if server.style == "qwen3":  # (its template shows it)
        assert count(messages) == count(renamed) > count(plain)
    bad = requests.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": [messages[0], {**messages[1], "reasoning": 3}, messages[2]], "max_tokens": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].reasoning"


def test_the_parser_off_keeps_the_tags_in_the_content(tiny_tools_dir, tmp_path_factory):
    model_dir = _model_with(QWEN3_STYLE, tiny_tools_dir, tmp_path_factory, "off")
    settings = tiny_settings(model_dir, engine={"num_kv_blocks": 64}, reasoning_parser="none")
    engine = ScriptedEngine(AsyncEngine.from_config(settings.engine))
    with LiveServer(settings, engine) as live:
        live.scripted = engine
        message = chat(live, pieces("<think>x</think>y"))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>x</think>y"}


def _responses(server, script: list[str], **body):
    server.scripted.script = script
    try:
        resp = requests.post(f"{server.url}/v1/responses", timeout=60, json={
            "model": server.state.model_name, "input": "Capital of France?", **body})
        assert resp.status_code == 200, resp.text
        if not body.get("stream"):
            return resp.json()
        return [json.loads(line[6:]) for line in (raw.decode() for raw in resp.iter_lines())
                if line.startswith("data: ")]
    finally:
        server.scripted.script = None


def _input_tokens(server, **body) -> int:
    resp = requests.post(f"{server.url}/v1/responses/input_tokens", timeout=30,
                         json={"model": server.state.model_name, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["input_tokens"]


def test_the_responses_api_answers_with_a_reasoning_item(server):
    """The thinking as a reasoning item (vLLM's: one reasoning_text part) before the message, whole and streamed;
    continued by previous_response_id or sent back as an input item, it is the template's reasoning_content."""
    answer = ("" if server.style == "deepseek_r1" else "<think>") + "It is Paris.</think>Paris."
    response = _responses(server, pieces(answer))
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                          "text": "It is Paris."}]
    assert message["content"][0]["text"] == "Paris."
    events = _responses(server, pieces(answer, 2), stream=True)
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "It is Paris."
    final = events[-1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [("reasoning", "completed"), ("message", "completed")]
    assert final["output"][0]["content"] == reasoning["content"]
    if server.style == "qwen3":  # (its template shows the thinking sent back)
        continued = _input_tokens(server, previous_response_id=response["id"], input="And Spain?")
        sent_back = _input_tokens(server, input=[
            {"role": "user", "content": "Capital of France?"}, reasoning, message,
            {"role": "user", "content": "And Spain?"}])
        without = _input_tokens(server, input=[
            {"role": "user", "content": "Capital of France?"}, message, {"role": "user", "content": "And Spain?"}])
        assert continued == sent_back > without
