"""The chat page kept open all day, in a real browser (as tests/gateway/test_chat_page.py drives it): a chat that
outgrows the model's context leaves its oldest messages out (and says so) instead of being refused from then on, a
message too long by itself says so, an answer near the context's end gets the server's whole cap (the model card's,
which is what a request without max_tokens gets), a chat of more messages than the server takes leaves its oldest
out too, the keyboard keeps its place, an error from a server that was away goes once it
answers again, a server away (or hanging) is asked less and less often, one request at a time, a rename keeps the
list's order, and a tap beside the phone layout's chat list closes it."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest
from playwright.sync_api import expect

from tests.gateway.test_chat_page import (answer_stats, browser, cached, opened, send, server, settings,  # noqa: F401
                                          slowed, start_streaming)
from tests.support.gateway_helpers import LiveServer, tiny_settings

pytestmark = pytest.mark.browser

CONTEXT = 320  # tokens: about ten turns of the questions below fill it
CAP = 64  # the max_tokens of a request that sets none


@pytest.fixture(scope="module")
def short_server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir, engine={"max_model_len": CONTEXT}, default_max_tokens=CAP)) as live:
        yield live


def prompt_tokens(stats: str) -> int:
    return int(re.search(r"prompt (\d+) tokens", stats).group(1))


def answer_tokens(stats: str) -> int:
    return int(re.search(r"answer (\d+) tokens?", stats).group(1))


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def question(i: int) -> str:
    return f"question {i}: tell me about the capital of France"


def test_a_chat_longer_than_the_context_leaves_its_oldest_messages_out(opened, short_server):
    tab = opened(short_server.url + "/")
    page = tab.page
    settings(page, max_tokens="4", temperature="0")
    turn = 0
    while not page.locator(".context-start").count():
        send(page, question(turn))
        stats = answer_stats(page, turn)
        assert prompt_tokens(stats) < CONTEXT
        turn += 1
        assert turn < 30, "the chat never outgrew the context"
    expect(page.locator("#error")).to_be_hidden()
    note = page.locator(".context-start")
    expect(note).to_contain_text("no longer sent")
    sent_from = page.locator(".message").evaluate_all(
        "els => els.findIndex(el => el.querySelector('.context-start'))")
    assert sent_from > 0 and page.locator(".message").nth(sent_from).get_attribute("class") == "message user"
    send(page, question(turn))  # the next turn starts where the last one did: its prefix is cached
    stats = answer_stats(page, turn)
    assert cached(stats) > 0 and prompt_tokens(stats) < CONTEXT
    expect(page.locator(".context-start")).to_have_count(1)
    page.reload()  # the chat keeps where its sent part starts
    expect(page.locator(".context-start")).to_have_count(1)
    first = prompt_tokens(answer_stats(page, 0))
    page.locator(".message.user .actions .edit").nth(1).click()  # a message above the mark, edited
    page.click(".edit-box .save")
    expect(page.locator(".message")).to_have_count(4)
    stats = answer_stats(page, 1)
    assert prompt_tokens(stats) > first  # sent from the start again: the first turn with it
    expect(page.locator(".context-start")).to_have_count(0)
    tab.errors.clear()  # the browser logs the 400s the page answered by leaving messages out


def test_a_message_too_long_by_itself_says_so_and_the_next_one_is_answered(opened, short_server):
    tab = opened(short_server.url + "/")
    page = tab.page
    settings(page, max_tokens="4", temperature="0")
    send(page, "a first question")
    answer_stats(page, 0)
    settings(page, max_tokens=str(CONTEXT))  # a short message that max_tokens leaves no room for says that
    send(page, "short")
    expect(page.locator("#error")).to_contain_text("lower max_tokens")
    expect(page.locator(".context-start")).to_have_count(0)  # nothing left out for a refusal it could not help
    settings(page, max_tokens="4")
    page.locator(".message.user .actions .regenerate").click()  # "Answer": with the first turn, as it was
    stats = answer_stats(page, 1)
    assert 0 < cached(stats) and prompt_tokens(stats) < 60
    send(page, "a very long paste " * 200)
    expect(page.locator("#error")).to_contain_text("Edit it to shorten it")
    expect(page.locator(".context-start")).to_have_count(0)
    send(page, "and now a short question")  # sent without the long one before it
    stats = answer_stats(page, 2)
    assert prompt_tokens(stats) < 40
    expect(page.locator("#error")).to_be_hidden()
    expect(page.locator(".message.user")).to_have_count(4)  # the refused paste stays, above the mark
    expect(page.locator(".message.user").nth(3).locator(".context-start")).to_have_count(1)
    tab.errors.clear()  # the browser logs the 400s


def test_an_answer_near_the_contexts_end_gets_the_servers_cap_not_what_is_left(opened, short_server):
    """With max_tokens left blank the page sends the server's cap: a chat that leaves the answer less room leaves its
    older messages out (the answer was cut after what the context had left); a message that leaves less room by
    itself is answered as far as the context goes, as before, not refused."""
    tab = opened(short_server.url + "/")
    page = tab.page
    settings(page, max_tokens="4", temperature="0")
    send(page, "an older question about the capital of France " * 12)
    answer_stats(page, 0)
    settings(page, max_tokens="")  # the server's cap from here on
    send(page, "and now a longer one about Paris " * 14)  # with the first turn: 291 tokens, room for 29
    stats = answer_stats(page, 1)  # (the tiny model never ends by itself: each answer runs to its cap)
    assert answer_tokens(stats) == CAP and prompt_tokens(stats) + CAP <= CONTEXT
    expect(page.locator(".message.user").nth(1).locator(".context-start")).to_have_count(1)
    page.click("#new-chat")
    send(page, "and now a longer one about Paris " * 28)  # alone: 293 tokens
    stats = answer_stats(page, 0)
    assert answer_tokens(stats) == CONTEXT - prompt_tokens(stats) < CAP
    expect(page.locator("#error")).to_be_hidden()
    tab.errors.clear()  # the browser logs the 400s the page answered by leaving messages out, then the cap


@pytest.mark.parametrize("default_cap, limit, cap", [(1024, 16, 16), (None, 16, 16), (8, 16, 8)])
def test_the_model_card_gives_the_cap_a_request_without_max_tokens_gets(tiny_llama_dir, default_cap, limit, cap):
    """--max-tokens-limit caps the default too (a default of None: the rest of the context), and the card says so:
    the page sends the card's cap, which a larger one would have made a 400 (max_tokens must be <= limit)."""
    with LiveServer(tiny_settings(tiny_llama_dir, default_max_tokens=default_cap, max_tokens_limit=limit)) as live:
        with urllib.request.urlopen(live.url + "/v1/models") as response:
            assert json.loads(response.read())["data"][0]["sampling_defaults"]["max_tokens"] == cap
        chat = {"messages": [{"role": "user", "content": "hello"}], "ignore_eos": True}
        status, body = post(live.url + "/v1/chat/completions", chat)
        assert (status, body["usage"]["completion_tokens"]) == (200, cap)
        assert post(live.url + "/v1/chat/completions", {**chat, "max_tokens": cap})[0] == 200


@pytest.fixture(scope="module")
def few_messages_server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir, max_messages=4)) as live:
        yield live


def test_a_chat_of_more_messages_than_the_server_takes_leaves_its_oldest_out(opened, few_messages_server):
    """More than --max-messages is a 400 with OpenAI's code for an over-long array, which the page takes as it takes
    a conversation too long for the context (every message was refused from then on)."""
    too_many = {"messages": [{"role": "user", "content": "hi"}] * 5, "max_tokens": 1}
    status, body = post(few_messages_server.url + "/v1/chat/completions", too_many)
    assert (status, body["error"]["param"], body["error"]["code"]) == (400, "messages", "array_above_max_length")
    tab = opened(few_messages_server.url + "/")
    page = tab.page
    settings(page, max_tokens="2")
    for turn in range(3):  # the third sends five messages
        send(page, question(turn))
        answer_stats(page, turn)
    expect(page.locator(".message.user").nth(1).locator(".context-start")).to_have_count(1)
    expect(page.locator("#error")).to_be_hidden()
    tab.errors.clear()  # the browser logs the 400


def test_the_keyboard_keeps_its_place(opened, server):
    page = opened().page
    settings(page, max_tokens="4")
    send(page, "first chat")
    answer_stats(page, 0)
    page.focus("#new-chat")
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "input"  # a new chat: type at once
    page.locator("#chats li button.open", has_text="first chat").focus()
    page.keyboard.press("Enter")
    expect(page.locator(".message")).to_have_count(2)
    assert page.evaluate("document.activeElement.id") == "input"
    order = page.locator("#chats li button.open").all_inner_texts()
    page.locator("#chats li", has_text="first chat").locator("button.rename").click()
    page.fill("#chats li .title-input", "renamed")
    page.press("#chats li .title-input", "Enter")
    assert page.evaluate("[document.activeElement.className, document.activeElement.textContent]") == [
        "open", "renamed"]
    renamed = ["renamed" if t == "first chat" else t for t in order]
    assert page.locator("#chats li button.open").all_inner_texts() == renamed  # a rename keeps the chat's place
    page.reload()  # (the list is sorted by each chat's last change as it loads)
    expect(page.locator("#chats li button.open")).to_have_text(renamed)
    page.locator(".message.user .actions .edit").click()
    page.press(".edit-box textarea", "Escape")
    assert page.evaluate("document.activeElement.id") == "input"


def test_enter_while_an_answer_streams_says_why_and_stop_hands_back_the_keys(opened, server):
    with slowed(server, 0.05):
        page = opened().page
        start_streaming(page, "count to a thousand", 300)
        send(page, "the next question")
        expect(page.locator("#error")).to_contain_text("press Stop")
        assert page.input_value("#input") == "the next question"  # kept for later
        page.click("#stop")
        expect(page.locator("#error")).to_be_hidden()
        assert page.evaluate("document.activeElement.id") == "input"
        page.press("#input", "Enter")
        expect(page.locator(".message.user")).to_have_count(2)
    server.wait_idle(timeout=30)


def test_the_error_of_a_server_that_was_away_goes_when_it_answers_again(opened, server):
    tab = opened()
    page = tab.page
    settings(page, max_tokens="4")
    expect(page.locator("#cache-used")).to_contain_text("/")
    page.route("**/v1/**", lambda route: route.abort())  # the server away
    send(page, "sent while it is away")
    expect(page.locator("#error")).to_contain_text("connection to the server was lost")
    expect(page.locator("#cache-status")).to_contain_text("server unreachable", timeout=10_000)
    page.unroute("**/v1/**")
    expect(page.locator("#cache-status")).to_be_hidden(timeout=10_000)
    expect(page.locator("#error")).to_be_hidden()
    tab.errors.clear()  # the browser logs the failed fetches


# each fetch of the cache's figures: its time on the page's clock, and `lastPoll`, a promise that settles once the
# page has handled its answer (its failure, or its body's JSON read): each settles a microtask after the page's own
# handler, which was queued after this script's (registered first)
POLL_LOG = """
const pageFetch = window.fetch;
const pageJson = Response.prototype.json;
const polled = (url) => String(url).includes("/v1/cache/stats");
const afterPage = (promise) => promise.then(() => null, () => null).then(() => null);
let settle = () => {};
window.polls = [];
window.lastPoll = Promise.resolve();
window.fetch = (url, ...rest) => {
  const reply = pageFetch(url, ...rest);
  if (polled(url)) {
    window.polls.push(Date.now());
    window.lastPoll = new Promise((resolve) => { settle = resolve; });
    reply.then((r) => { if (!r.ok) afterPage(Promise.resolve()).then(settle); },
               () => afterPage(Promise.resolve()).then(settle));
  }
  return reply;
};
Response.prototype.json = function () {
  const parsed = pageJson.call(this);
  if (polled(this.url)) afterPage(parsed).then(settle);
  return parsed;
};
"""


class PausedPage:
    """The page on a clock of its own, paused once the page has read the figures: it moves only when told, so the
    time between fetches is exact."""

    def __init__(self, browser, server) -> None:
        self.context = browser.new_context()
        self.page = self.context.new_page()
        self.page.clock.install()
        self.page.add_init_script(POLL_LOG)
        self.page.goto(server.url + "/")
        expect(self.page.locator("#cache-used")).to_contain_text("/")
        self.page.clock.pause_at(self.page.evaluate("Date.now()") + 10)
        self.page.evaluate("() => window.lastPoll")  # (the next fetch timed from a clock that has stopped)

    def run(self, seconds: int, settle: bool = True) -> list[int]:
        """The gaps between the fetches of the figures made in the next `seconds` of the page's clock; `settle`:
        each second's fetch answered or failed (and handled) before the clock moves on."""
        before = self.page.evaluate("window.polls.length")
        for _ in range(seconds):
            self.page.clock.run_for(1000)
            if settle:
                self.page.evaluate("() => window.lastPoll")
        polls = self.page.evaluate("window.polls")[before:]
        return [b - a for a, b in zip(polls, polls[1:])]


@pytest.fixture
def paused(browser, server):
    on_clock = PausedPage(browser, server)
    yield on_clock
    on_clock.context.close()


def test_a_server_away_is_asked_less_often_and_a_tab_shown_again_asks_at_once(paused):
    page = paused.page
    assert paused.run(10) == [2000] * 4  # the server answers: every 2 s
    page.route("**/v1/cache/stats", lambda route: route.abort())  # the server away
    assert paused.run(80) == [4000, 8000, 16000, 16000, 16000, 16000]
    expect(page.locator("#cache-status")).to_contain_text("server unreachable")
    page.unroute("**/v1/cache/stats")
    page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")  # the tab shown again
    page.clock.run_for(0)
    expect(page.locator("#cache-status")).to_be_hidden()
    assert paused.run(10) == [2000] * 4  # every 2 s again


def test_a_server_that_answers_with_an_error_is_asked_less_often_too(paused):
    page = paused.page
    page.route("**/v1/cache/stats", lambda route: route.fulfill(  # a server draining: each fetch a 503
        status=503, content_type="application/json", body='{"error": {"message": "draining", "type": "x"}}'))
    assert paused.run(60) == [4000, 8000, 16000, 16000]
    expect(page.locator("#cache-status")).to_contain_text("HTTP 503")
    page.unroute("**/v1/cache/stats")
    page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
    page.clock.run_for(0)
    expect(page.locator("#cache-status")).to_be_hidden()
    assert paused.run(10) == [2000] * 4


def test_a_server_that_does_not_answer_gets_one_fetch_of_the_figures_at_a_time(paused):
    paused.page.route("**/v1/cache/stats", lambda route: None)  # a server that takes the request, never answers
    # one fetch at a time: each given up after 10 s, the next then 4, 8, 16 s later
    assert paused.run(60, settle=False) == [14000, 18000, 26000]


def test_the_error_of_a_server_that_answers_stays_until_the_next_send(opened, server):
    tab = opened()
    page = tab.page
    settings(page, max_tokens="4")
    expect(page.locator("#cache-used")).to_contain_text("/")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=500, content_type="application/json",
        body='{"error": {"message": "the engine failed", "type": "server_error", "param": null, "code": null}}'))
    send(page, "a question the engine fails")
    expect(page.locator("#error")).to_contain_text("the engine failed")
    page.wait_for_timeout(4500)  # past two refreshes of the cache panel, which the server answered all along
    expect(page.locator("#error")).to_contain_text("the engine failed")
    tab.errors.clear()  # the browser logs the 500


def test_a_tap_beside_the_phone_layouts_chat_list_closes_it(opened):
    page = opened(viewport={"width": 375, "height": 667}).page
    expect(page.locator("#model-name")).not_to_be_empty()
    page.click("#toggle-sidebar")
    expect(page.locator("#chats")).to_be_visible()
    page.mouse.click(360, 400)  # the chat beside the list
    expect(page.locator("#sidebar")).to_be_hidden()
    expect(page.locator("#toggle-sidebar")).to_have_attribute("aria-expanded", "false")


@pytest.fixture(scope="module")
def thinking_server(tiny_tools_dir, tmp_path_factory):
    """A model whose template thinks (Qwen3's way) and whose answers are scripted."""
    from engine.async_engine import AsyncEngine
    from tests.gateway.test_reasoning import QWEN3_STYLE, _model_with
    from tests.gateway.test_tools_api import ScriptedEngine

    settings = tiny_settings(_model_with(QWEN3_STYLE, tiny_tools_dir, tmp_path_factory, "page-thinks"),
                             engine={"num_kv_blocks": 64})
    engine = ScriptedEngine(AsyncEngine.from_config(settings.engine))
    with LiveServer(settings, engine) as live:
        live.scripted = engine
        yield live


def test_a_reasoning_models_thinking_shows_folded_above_its_answer(opened, thinking_server):
    thinking_server.scripted.script = list("<think>The capital of France is Paris.</think>Paris.")
    try:
        page = opened(thinking_server.url + "/").page
        send(page, "Capital of France?")
        answer = page.locator(".message.assistant").last
        expect(answer.locator(".stats")).to_contain_text("prompt", timeout=30_000)
        thinking = answer.locator("details.thinking")
        expect(thinking).to_contain_text("The capital of France is Paris.")
        expect(answer.locator(".body")).to_contain_text("Paris.")
        assert thinking.evaluate("el => !el.open")  # folded once the answer began
        page.click(".message.assistant details.thinking summary")
        assert thinking.evaluate("el => el.open")
        page.reload()  # kept with the chat
        expect(page.locator(".message.assistant details.thinking")).to_contain_text("The capital of France is Paris.")
    finally:
        thinking_server.scripted.script = None


def test_a_template_with_qwen3s_switch_gets_a_thinking_setting(opened, thinking_server, server):
    """Shown where the chat template takes enable_thinking (not for the tiny default's); each request says whether
    to think, and the choice is kept across a reload."""
    bodies = []
    page = opened(thinking_server.url + "/").page
    page.route("**/v1/chat/completions", lambda route: (bodies.append(route.request.post_data_json),
                                                         route.continue_()))
    page.click("#settings summary")
    expect(page.locator("#thinking-label")).to_be_visible(timeout=10_000)
    page.uncheck("#thinking")
    thinking_server.scripted.script = list("Paris.")
    try:
        send(page, "Capital of France?")
        expect(page.locator(".message.assistant .stats")).to_contain_text("prompt", timeout=30_000)
    finally:
        thinking_server.scripted.script = None
    assert bodies[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    page.reload()
    page.click("#settings summary")
    expect(page.locator("#thinking")).not_to_be_checked()
    plain = opened(server.url + "/").page  # ChatML: no switch
    plain.click("#settings summary")
    expect(plain.locator("#model-name")).not_to_be_empty()
    plain.wait_for_timeout(500)
    assert plain.evaluate("document.getElementById('thinking-label').hidden")
