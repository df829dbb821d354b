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
from gateway.reasoning import ThinkingSplit
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


def split_whole(text: str, thinking: bool) -> tuple[str, str]:
    splitter = ThinkingSplit(thinking)
    reasoning, content = splitter.feed(text)
    held_reasoning, held = splitter.finish()
    return reasoning + held_reasoning, content + held


@pytest.mark.parametrize("thinking, text, expected", [
    (False, "<think>Let me see.</think>\n\nParis.", ("Let me see.", "\n\nParis.")),
    (False, "\n <think>a</think>b", ("a", "b")),
    (False, "Paris. <think>not at the start</think>", ("", "Paris. <think>not at the start</think>")),
    (False, "<thinking>x", ("", "<thinking>x")),
    (False, "<thi", ("", "<thi")),
    (False, "<think>cut short by max_tokens", ("cut short by max_tokens", "")),
    (True, "Hmm.</think>Paris", ("Hmm.", "Paris")),
    (True, " <think>\nHmm</think>\n\nParis.", ("\nHmm", "\n\nParis.")),  # the open tag written again: dropped
    (True, "<thi", ("<thi", "")),
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


def test_a_think_tag_in_a_message_opens_no_thinking(server):
    """Only the template's generation prompt decides where the answer starts: a question about the tag does not."""
    if server.style == "deepseek_r1":
        pytest.skip("this template always opens the thinking")
    message = chat(server, pieces("It marks reasoning."),
                   messages=[{"role": "user", "content": "What does the <think> tag do?"}])["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It marks reasoning."}


def test_an_output_constraint_answers_without_thinking(server):
    """Its grammar holds from the first token: the answer is content, even where the prompt opens the thinking."""
    body = {"response_format": {"type": "json_object"}}
    message = chat(server, ['{"a"', ': 1}'], **body)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": '{"a": 1}'}
    response = _responses(server, ['{"a"', ': 1}'], text={"format": {"type": "json_object"}})
    assert [item["type"] for item in response["output"]] == ["message"]


def test_an_echoed_message_is_split_as_the_answer_it_starts(server):
    """continue_final_message with echo: the assistant message the answer continues opened the thinking."""
    body = {"messages": [{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": "<think>\nLet me"}],
            "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    script = pieces(" think.</think>Answer.")
    message = chat(server, script, **body)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("\nLet me think.", "Answer.")
    chunks = chat(server, script, stream=True, **body)
    assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == ("\nLet me think.", "Answer.")
    plain = chat(server, script, **{**body, "echo": False})["choices"][0]["message"]
    assert (plain["reasoning"], plain["content"]) == (" think.", "Answer.")


def test_an_answer_with_text_and_a_call_sent_back_is_the_turn_continued(server):
    """Its reasoning, message and function_call items sent back make one assistant message, as the stored turn
    is: the same prompt either way (the cache holds that one)."""
    answer = ("" if server.style == "deepseek_r1" else "<think>") + "I need the weather.</think>\n" + CALL_TEXT
    response = _responses(server, pieces(answer), tools=[{"type": "function", **WEATHER["function"]}])
    assert [item["type"] for item in response["output"]] == ["reasoning", "message", "function_call"]
    call = response["output"][2]
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "18 C"}
    tools = [{"type": "function", **WEATHER["function"]}]
    continued = _input_tokens(server, previous_response_id=response["id"], input=[result], tools=tools)
    sent_back = _input_tokens(server, input=[{"role": "user", "content": "Capital of France?"}, *response["output"],
                                             result], tools=tools)
    assert continued == sent_back


def test_an_echo_of_an_earlier_answer_is_content_before_a_new_answers_thinking(server):
    """vLLM echoes the last assistant message also under a new generation prompt: the echo is content as it was,
    and the new answer is split from the generation prompt's state."""
    answer = ("" if server.style == "deepseek_r1" else "<think>") + "thinking</think>answer"
    body = {"messages": [{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": "Hi. "}],
            "echo": True}
    message = chat(server, pieces(answer), **body)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("thinking", "Hi. answer")
    chunks = chat(server, pieces(answer), stream=True, **body)
    assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == ("thinking", "Hi. answer")


def test_each_choice_of_a_stream_is_split_on_its_own(server):
    answer = ("" if server.style == "deepseek_r1" else "<think>") + "It is Paris.</think>Paris."
    chunks = chat(server, pieces(answer, 2), stream=True, n=2)
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert (_joined(mine, "reasoning"), _joined(mine, "content")) == ("It is Paris.", "Paris.")


def test_answers_with_thinking_match_the_openapi_document(server):
    from tests.gateway.test_openapi_responses import assert_matches, response_schema

    spec = requests.get(f"{server.url}/openapi.json", timeout=30).json()
    answer = ("" if server.style == "deepseek_r1" else "<think>") + "It is Paris.</think>Paris."
    assert_matches(spec, response_schema(spec, "/v1/chat/completions"), chat(server, pieces(answer)))
    chunk_schema = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"][
        "x-stream-chunk"]
    for chunk in chat(server, pieces(answer), stream=True):
        assert_matches(spec, chunk_schema, chunk)
    assert_matches(spec, response_schema(spec, "/v1/responses"), _responses(server, pieces(answer)))


def test_usage_counts_the_thinkings_tokens(server):
    """reasoning_tokens: the answer's tokens up to the one that completes </think>; all of them when it never ended;
    none without thinking; an empty thinking its tags; whole, streamed and in the Responses API alike, and whatever
    text a stop string holds back (counted from the tokens, not from when their text arrived)."""
    opening = "" if server.style == "deepseek_r1" else "<think>"
    server.scripted.script_ids = True  # (a character a token: the ids spell the scripted text)
    try:
        script = pieces(opening + "It is Paris.</think>Paris.", 1)
        thinking = len(opening + "It is Paris.</think>")
        details = chat(server, script)["usage"]["completion_tokens_details"]
        assert details["reasoning_tokens"] == thinking
        streamed = chat(server, script, stream=True, stream_options={"include_usage": True})
        assert streamed[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == thinking
        response = _responses(server, script)
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == thinking
        cut = pieces(opening + "never ends", 1)
        assert chat(server, cut)["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(cut)
        empty = pieces(opening + "</think>Paris.", 1)
        assert chat(server, empty)["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(opening) + 8
        if server.style == "qwen3":
            plain = chat(server, pieces("Paris.", 1))["usage"]["completion_tokens_details"]["reasoning_tokens"]
            assert plain == 0
    finally:
        server.scripted.script_ids = False


def test_the_message_logprobs_leave_the_thinking_out(server):
    """A Responses message's logprobs are its text's tokens: those after the one completing </think>, whole and
    streamed (the deltas' and the done event's alike), none of the reasoning item's."""
    opening = "" if server.style == "deepseek_r1" else "<think>"
    server.scripted.script_ids = True  # (a character a token: the ids spell the scripted text)
    try:
        script = pieces(opening + "It is Paris.</think>Paris.", 1)
        asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
        message = _responses(server, script, **asked)["output"][-1]
        assert message["type"] == "message" and len(message["content"][0]["logprobs"]) == len("Paris.")
        events = _responses(server, script, stream=True, **asked)
        streamed = [entry for e in events if e["type"] == "response.output_text.delta" for entry in e["logprobs"]]
        done = next(e for e in events if e["type"] == "response.output_text.done")["logprobs"]
        assert len(streamed) == len("Paris.") and streamed == done == events[-1]["response"]["output"][-1][
            "content"][0]["logprobs"]
        assert all(len(entry["top_logprobs"]) == 1 for entry in done)
    finally:
        server.scripted.script_ids = False


def test_reasoning_tokens_follow_the_tokens_not_a_stop_strings_hold_back(tiny_tools_dir):
    """The engine's detokenizer holds text back while it may still become a stop string, so </think>'s text arrives
    some tokens after the token that wrote it: the count reads the tokens' own bytes."""
    from engine.tokenizer import load_tokenizer
    from engine.sampling_params import SamplingParams
    from gateway.formats import ChatFormat
    from gateway.generate import Choice

    tok = load_tokenizer(tiny_tools_dir, set())
    ids = [tok.encode(c)[0] for c in "<think>abc</think>def ghi jkl"]
    choice = Choice(0, 0, "r", [1], SamplingParams(stop=["a long stop string never met"]))
    choice.token_ids, choice.text = ids, ["", "<think>abc</think>def ghi jkl"]  # the text came with the last token
    ChatFormat("c", "m", tok, thinking=False).count_reasoning_tokens(choice)
    assert choice.num_reasoning_tokens == len("<think>abc</think>")


def test_the_responses_stream_closes_an_item_before_the_next_opens(server):
    """As OpenAI streams them: the thinking is done before the message opens, a call before the next call (a
    message stays open to the end: text may come after the calls)."""
    opening = "" if server.style == "deepseek_r1" else "<think>"
    calls = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    events = _responses(server, pieces(opening + "Two cities.</think>" + calls), stream=True,
                        tools=[{"type": "function", **WEATHER["function"]}])
    opened_closed = [(e["type"].rsplit(".", 1)[-1], e["output_index"]) for e in events
                     if e["type"] in ("response.output_item.added", "response.output_item.done")]
    assert opened_closed == [("added", 0), ("done", 0), ("added", 1), ("done", 1), ("added", 2), ("done", 2)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [
        ("reasoning", "completed"), ("function_call", "completed"), ("function_call", "completed")]
