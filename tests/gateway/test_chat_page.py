"""The chat page at / in a real browser: Debian's Chromium, headless, driven by Playwright (make test installs
both; Playwright's own browser download needs the internet). A message streams in, the second turn of a chat
reports cached tokens, the stop button ends the request on the server and keeps the answer's token count, the
cache panel moves, a hostile reply stays text, the keys work, copy / regenerate / edit, Markdown tables and
highlighted code, a click inside an answer that streams, rename / export / import, settings kept across a reload,
a phone layout whose panels fold behind buttons, the system's dark theme, and no page logs an error."""
from __future__ import annotations

import contextlib
import json
import os
import re
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from bench.engine_faults import set_step_hook
from bench.stub_server import InstantEngine
from gateway.settings import ApiKey
from tests.support.gateway_helpers import REPO, LiveServer, served, tiny_settings
from tests.support.machine import require_binary

pytestmark = pytest.mark.browser

# as the machine notes start it: without the background-networking flags Chromium dials hosts it cannot reach
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCREENSHOT = REPO / "docs" / "images" / "chat-page.png"  # the README's, rewritten only when asked:
UPDATE_SCREENSHOTS = os.environ.get("PREFIXGATE_UPDATE_SCREENSHOTS") == "1"  # a run leaves the checkout clean
HOSTILE = '<img src=x onerror="window.pwned = 1"> <script>window.pwned = 2</script> **bold** [x](javascript:alert(1))'


@pytest.fixture(scope="module")
def browser():
    chromium = require_binary("chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir)) as live:
        yield live


class Opened:
    """A fresh page (its own localStorage) on `url`, recording console errors and uncaught exceptions."""

    def __init__(self, browser, url: str, **context) -> None:
        self.context = browser.new_context(**context)
        self.page: Page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)

    def close(self) -> None:
        self.context.close()
        assert self.errors == [], self.errors


@pytest.fixture
def opened(browser, server):
    pages = []

    def open_page(url: str | None = None, **context) -> Opened:
        pages.append(Opened(browser, url or server.url + "/", **context))
        return pages[-1]
    yield open_page
    for page in pages:
        page.close()


@contextlib.contextmanager
def slowed(server, seconds: float):
    """Each engine step waits `seconds` first: slow enough to act on the page while an answer streams."""
    set_step_hook(server.engine, lambda: time.sleep(seconds))
    try:
        yield
    finally:
        set_step_hook(server.engine, None)


def settings(page: Page, **values: str) -> None:
    """Opens the settings panel and fills its fields (#system, #temperature, #max_tokens, ...)."""
    if not page.locator("#settings").evaluate("el => el.open"):
        page.click("#settings summary")
    for field, value in values.items():
        page.fill(f"#{field}", value)


def send(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def start_streaming(page: Page, text: str, max_tokens: int) -> None:
    """Sends `text` and waits for its answer's first text (on a slowed engine: it is still streaming then)."""
    settings(page, max_tokens=str(max_tokens))
    send(page, text)
    expect(page.locator(".message.assistant .body").last).not_to_be_empty(timeout=30_000)


def answer_stats(page: Page, turn: int) -> str:
    stats = page.locator(".message.assistant .stats").nth(turn)
    expect(stats).to_contain_text("prompt", timeout=30_000)
    return stats.inner_text()


def cached(stats: str) -> int:
    return int(re.search(r"cached (\d+)", stats).group(1))


def test_a_message_streams_in_and_the_second_turn_hits_the_cache(opened, server):
    with slowed(server, 0.01):  # slow enough to see the answer grow
        page = opened().page
        expect(page.locator("#model-name")).to_have_text(server.state.model_name)
        settings(page, temperature="0", max_tokens="24",
                 system="You are a helpful assistant. Answer the question about the capital of France. " * 3)
        send(page, "hello world")
        expect(page.locator("#stop")).to_be_visible()
        expect(page.locator(".message.assistant .body").first).not_to_be_empty()  # text while it streams
        first = answer_stats(page, 0)
        assert cached(first) == 0 and "TTFT" in first
        send(page, "and the cache?")
        second = answer_stats(page, 1)
        assert cached(second) > 0  # the system prompt, the question and the first answer
        expect(page.locator(".message")).to_have_count(4)


def test_the_stop_button_ends_the_request_on_the_server(opened, server):
    with slowed(server, 0.05):
        page = opened().page
        start_streaming(page, "count to a thousand", 2000)
        page.click("#stop")
        stats = page.locator(".message.assistant .stats").first
        expect(stats).to_contain_text("stopped")
        shown = len(page.locator(".message.assistant .body").first.inner_text())
        assert int(re.search(r"answer (\d+) tokens?", stats.inner_text()).group(1)) >= 1 and shown > 0
        server.wait_idle(timeout=10)  # the engine aborted it and released its blocks
        metrics = server.call(_get(server.url + "/metrics"))
        assert re.search(r"^prefixgate_requests_running\{[^}]*\} 0\.0$", metrics, re.M)


async def _get(url: str) -> str:
    import aiohttp
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.text()


def test_the_cache_panel_moves_while_you_chat(opened, server):
    page = opened().page
    expect(page.locator("#cache-used")).to_contain_text("/")
    before = page.locator("#cache-tokens").inner_text()
    settings(page, max_tokens="4")
    send(page, "a question for the panel " * 4)
    answer_stats(page, 0)
    expect(page.locator("#cache-tokens")).not_to_have_text(before)
    expect(page.locator("#cache-hit-rate")).to_contain_text("%")
    # the free blocks split in two: empty, and cached ones a later prompt still hits (the answer's, at least)
    blocks = json.loads(urllib.request.urlopen(server.url + "/v1/cache/stats").read())["kv_blocks"]
    assert blocks["used"] == 0 and blocks["free_cached"] == blocks["cached"] > 0
    assert blocks["free_empty"] + blocks["free_cached"] == blocks["free"] == blocks["total"]
    expect(page.locator("#cache-free-empty")).to_have_text(str(blocks["free_empty"]))
    expect(page.locator("#cache-free-cached")).to_have_text(str(blocks["free_cached"]))

    tab = opened()
    down = tab.page  # a server gone: the figures stay, dimmed, and say how old they are
    expect(down.locator("#cache-used")).to_contain_text("/")
    down.route("**/v1/cache/stats", lambda route: route.abort())
    expect(down.locator("#cache-status")).to_contain_text("server unreachable: figures from", timeout=10_000)
    expect(down.locator("#cache-panel")).to_have_class(re.compile("stale"))
    down.unroute("**/v1/cache/stats")
    expect(down.locator("#cache-status")).to_be_hidden(timeout=10_000)
    expect(down.locator("#cache-panel")).not_to_have_class(re.compile("stale"))
    tab.errors.clear()  # the browser logs the failed fetches

def test_enter_sends_shift_enter_breaks_the_line_and_chats_are_kept(opened, server):
    page = opened().page
    settings(page, max_tokens="4")
    page.fill("#input", "first line")
    page.press("#input", "Shift+Enter")
    page.type("#input", "second line")
    assert page.input_value("#input") == "first line\nsecond line"
    expect(page.locator(".message")).to_have_count(0)
    page.press("#input", "Enter")
    answer_stats(page, 0)
    expect(page.locator(".message.user .body")).to_have_text("first line\nsecond line")
    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#chats li")).to_have_count(2)
    page.reload()  # kept in localStorage
    expect(page.locator("#chats li")).to_have_count(2)
    page.locator("#chats li button.open", has_text="first line").click()
    expect(page.locator(".message")).to_have_count(2)


def test_a_hostile_reply_renders_as_text(browser, tiny_llama_dir):
    engine = InstantEngine(Path(tiny_llama_dir), reply=HOSTILE)
    with LiveServer(tiny_settings(tiny_llama_dir), engine=engine) as live:
        opened = Opened(browser, live.url + "/")
        page = opened.page
        send(page, "say something nasty")
        body = page.locator(".message.assistant .body").first
        expect(body).to_contain_text('<img src=x onerror="window.pwned = 1">')
        expect(body).to_contain_text("<script>window.pwned = 2</script>")
        assert body.locator("img, script").count() == 0 and body.locator("a").count() == 0
        expect(body.locator("strong")).to_have_text("bold")  # Markdown still renders
        assert page.evaluate("window.pwned") is None
        opened.close()


def test_a_server_with_keys_asks_for_one_until_one_works(browser, tiny_llama_dir):
    """Escape does not close the dialog (the page is of no use without a key), a refused key says so, and a
    message a 401 refused mid-session is answered once a key works."""
    settings_ = tiny_settings(tiny_llama_dir, keys=(ApiKey("sk-page", "pager"),))
    with LiveServer(settings_) as live:
        opened = Opened(browser, live.url + "/")
        page = opened.page
        expect(page.locator("#key-dialog")).to_be_visible()
        page.keyboard.press("Escape")
        expect(page.locator("#key-dialog")).to_be_visible()
        page.keyboard.press("Escape")  # (a second one closed it: Chromium lets it, the page opens it again)
        expect(page.locator("#key-dialog")).to_be_visible()
        page.fill("#key-input", "sk-page\u2014")  # a key pasted with a long dash: no header can hold it
        page.press("#key-input", "Enter")
        expect(page.locator("#key-error")).to_contain_text("printable ASCII")
        expect(page.locator("#key-dialog")).to_be_visible()
        page.fill("#key-input", "sk-wrong")
        page.press("#key-input", "Enter")
        expect(page.locator("#key-error")).to_contain_text("refused")
        page.fill("#key-input", "sk-page")
        page.press("#key-input", "Enter")
        expect(page.locator("#model-name")).to_have_text(live.state.model_name)
        expect(page.locator("#cache-tenant")).to_have_text("pager")
        page.evaluate("localStorage.setItem('prefixgate.key', 'sk-revoked')")  # a key that stops working
        settings(page, max_tokens="2")
        send(page, "still there?")
        expect(page.locator("#key-error")).to_contain_text("refused")
        page.fill("#key-input", "sk-page")
        page.press("#key-input", "Enter")
        answer_stats(page, 0)  # the refused message, answered once a key works
        expect(page.locator(".message")).to_have_count(2)
        opened.errors.clear()  # the browser logs the 401s that asked for the key
        opened.close()


def test_a_phone_layout_folds_the_chat_list_and_the_cache_panel_behind_buttons(opened):
    page = opened(viewport={"width": 390, "height": 844}).page
    expect(page.locator("#model-name")).not_to_be_empty()
    expect(page.locator("#sidebar")).to_be_hidden()  # the chat gets the screen
    composer = page.locator("#composer").bounding_box()
    assert composer["y"] + composer["height"] == pytest.approx(844, abs=1)
    assert page.locator("#messages").bounding_box()["height"] > 500
    page.click("#toggle-sidebar")
    expect(page.locator("#chats")).to_be_visible()
    expect(page.locator("#cache-panel")).to_be_hidden()
    expect(page.locator("#toggle-cache")).to_be_visible()  # the top bar stays reachable over the panel
    page.locator("#chats li button.open").first.click()  # opening a chat folds the list away
    expect(page.locator("#sidebar")).to_be_hidden()
    page.click("#toggle-cache")
    expect(page.locator("#cache-panel")).to_be_visible()
    expect(page.locator("#chats")).to_be_hidden()
    page.click("#toggle-cache")
    expect(page.locator("#sidebar")).to_be_hidden()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen


MARKDOWN_REPLY = """Two capitals:

| country | capital |
|:--|--:|
| France | **Paris** |
| Italy | Rome |
| <b>Evil</b> | <img src=x onerror="window.pwned = 3"> |

```python
def capital(country):  # looked up
    return {"France": "Paris"}.get(country, 42)
```
"""
CODE = 'def capital(country):  # looked up\n    return {"France": "Paris"}.get(country, 42)'


@pytest.fixture(scope="module")
def markdown_server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir), engine=InstantEngine(Path(tiny_llama_dir), MARKDOWN_REPLY)) as live:
        yield live


def clipboard(page: Page) -> str:
    return page.evaluate("navigator.clipboard.readText()")


def test_tables_and_highlighted_code_render_and_copy_buttons_copy_them(opened, markdown_server):
    page = opened(markdown_server.url + "/", permissions=["clipboard-read", "clipboard-write"]).page
    send(page, "capitals?")
    body = page.locator(".message.assistant .body").first
    expect(body.locator("table")).to_have_count(1)
    assert body.locator("th").all_inner_texts() == ["country", "capital"]
    assert body.locator("td").all_inner_texts() == ["France", "Paris", "Italy", "Rome", "<b>Evil</b>",
                                                    '<img src=x onerror="window.pwned = 3">']
    assert body.locator("img, b").count() == 0 and page.evaluate("window.pwned") is None  # model HTML stays text
    expect(body.locator("td strong")).to_have_text("Paris")
    assert body.locator("td").nth(1).evaluate("el => el.style.textAlign") == "right"
    code = body.locator("pre code")
    expect(code).to_have_attribute("data-language", "python")
    assert code.locator(".tok-keyword").all_inner_texts() == ["def", "return"]
    assert code.locator(".tok-string").all_inner_texts() == ['"France"', '"Paris"']
    assert code.locator(".tok-comment").all_inner_texts() == ["# looked up"]
    assert code.locator(".tok-number").all_inner_texts() == ["42"]
    assert code.inner_text() == CODE  # highlighting only wraps the text
    body.locator("pre .copy-code").click()
    assert clipboard(page) == CODE
    page.locator(".message.assistant .actions .copy").click()
    assert clipboard(page) == MARKDOWN_REPLY
    expect(page.locator(".message.assistant .actions .copy")).to_have_text("Copied")
    page.locator(".message.user .actions .copy").click()
    assert clipboard(page) == "capitals?"


@pytest.fixture(scope="module")
def scripted_server(tiny_llama_dir):
    """The tiny model, whose answers are `scripted.script`'s pieces (one a token) while it is set."""
    from engine.async_engine import AsyncEngine
    from tests.gateway.test_tools_api import ScriptedEngine

    settings_ = tiny_settings(tiny_llama_dir)
    engine = ScriptedEngine(AsyncEngine.from_config(settings_.engine))
    with LiveServer(settings_, engine) as live:
        live.scripted = engine
        yield live


def test_a_click_inside_an_answer_that_streams_is_not_lost_to_its_repaints(opened, scripted_server):
    """The streaming answer is drawn in place: a code block it has finished keeps its element, so a press and a
    release on its Copy button a repaint apart still copy (the whole message was drawn anew at each frame)."""
    scripted_server.scripted.script = [f"```python\n{CODE}\n```\n\n", *["Paris "] * 400]
    try:
        with slowed(scripted_server, 0.05):
            page = opened(scripted_server.url + "/", permissions=["clipboard-read", "clipboard-write"]).page
            send(page, "capitals?")
            answer = page.locator(".message.assistant .body")
            expect(answer.locator("p")).not_to_be_empty(timeout=30_000)  # past the code block
            copy = answer.locator("pre .copy-code")
            pressed = copy.element_handle()
            copy.hover()
            page.mouse.down()
            for _ in range(2):  # the answer grows between the press and the release
                before = answer.inner_text()
                expect(answer).not_to_have_text(before)
            page.mouse.up()
            expect(copy).to_have_text("Copied")
            assert clipboard(page) == CODE and pressed.evaluate("el => el.isConnected")
            expect(page.locator("#stop")).to_be_visible()  # (all of it while the answer streamed)
            page.click("#stop")
            scripted_server.wait_idle(timeout=10)
    finally:
        scripted_server.scripted.script = None


def test_code_indented_under_a_list_item_is_code_and_a_list_goes_on_at_its_number(opened):
    """Models put a step's code under its list item, fence indented: it was read as paragraph text (`*args` lost
    to emphasis, indentation gone), and the list after it started at 1 again."""
    page = opened().page
    rendered = page.evaluate("""async (text) => {
        const { renderMarkdown } = await import("/static/markdown.js");
        const div = document.createElement("div");
        div.append(renderMarkdown(text));
        return { code: div.querySelector("pre code")?.textContent ?? null,
                 lists: [...div.querySelectorAll("ol")].map((ol) => [ol.start, ol.textContent]) };
    }""", "1. Write it:\n   ```python\n   def f(*args, **kwargs):\n       return 2*3*4\n   ```\n2. Run it")
    assert rendered == {"code": "def f(*args, **kwargs):\n    return 2*3*4", "lists": [[1, "Write it:"], [2, "Run it"]]}


def test_regenerate_answers_the_last_message_again_in_place(opened, server):
    page = opened().page
    system = f"[{uuid.uuid4().hex}] " + "You are a helpful assistant who answers about capitals. " * 3
    settings(page, max_tokens="6", system=system)  # (a system prompt of its own: no earlier test's blocks)
    send(page, "the capital of France?")
    first = answer_stats(page, 0)
    assert cached(first) == 0
    expect(page.locator(".message.user .actions .regenerate")).to_have_count(0)  # answers only
    page.locator(".message.assistant .actions .regenerate").click()
    expect(page.locator(".message")).to_have_count(2)  # replaced, not added
    expect(page.locator(".message.assistant .stats")).not_to_have_text(first)
    assert cached(answer_stats(page, 0)) > 0  # the same prompt again: its blocks were cached


def test_editing_a_message_replaces_it_and_what_followed(opened, server):
    page = opened().page
    settings(page, max_tokens="4")
    send(page, "first question")
    answer_stats(page, 0)
    send(page, "second question")
    answer_stats(page, 1)
    page.locator(".message.user .actions .edit").first.click()
    page.fill(".edit-box textarea", "never sent")
    page.press(".edit-box textarea", "Escape")  # cancels
    expect(page.locator(".edit-box")).to_have_count(0)
    expect(page.locator(".message")).to_have_count(4)
    page.locator(".message.user .actions .edit").first.click()
    page.fill(".edit-box textarea", "a better first question")
    page.press(".edit-box textarea", "Control+Enter")  # Save & send
    expect(page.locator(".message")).to_have_count(2)
    expect(page.locator(".message.user .body")).to_have_text("a better first question")
    expect(page.locator("#input")).to_be_focused()
    answer_stats(page, 0)
    page.reload()  # the edit is kept
    expect(page.locator(".message.user .body")).to_have_text("a better first question")


def test_a_setting_that_cannot_be_sent_leaves_the_chat_as_it_was(opened, server):
    """Regenerate and Save & send with a settings field the page cannot send (1e309): the error is said and the
    answer, or the messages after the edited one, stay; both took them out first, before (lost at the next save)."""
    page = opened().page
    settings(page, max_tokens="3")
    send(page, "first question")
    answer_stats(page, 0)
    settings(page, temperature="1e309")
    page.locator(".message.assistant .actions .regenerate").click()
    expect(page.locator("#error")).to_contain_text("temperature must be a number")
    page.locator(".message.user .actions .edit").first.click()
    page.fill(".edit-box textarea", "an edit that cannot be sent")
    page.press(".edit-box textarea", "Control+Enter")
    page.press(".edit-box textarea", "Escape")
    settings(page, temperature="")
    send(page, "second question")  # (saves the chat as it is now)
    answer_stats(page, 1)
    page.reload()  # what was stored
    expect(page.locator(".message")).to_have_count(4)
    expect(page.locator(".message.user .body")).to_have_text(["first question", "second question"])


def test_the_chats_show_while_the_server_is_away_and_a_renamed_model_is_answered(opened, server):
    """A page opened while the server is away shows the chats this browser keeps (it showed none until the server
    answered); a server restarted under another model name answers the page's next message (it sent the name it
    read at load: a 404 until a reload)."""
    tab = opened()
    page = tab.page
    settings(page, max_tokens="2")
    send(page, "kept in this browser")
    answer_stats(page, 0)
    page.route("**/v1/models", lambda route: route.abort())  # the server away
    page.reload()
    expect(page.locator("#error")).to_contain_text("not ready")
    expect(page.locator(".message.user .body")).to_have_text("kept in this browser")
    page.unroute("**/v1/models")
    card = {"object": "list", "data": [{"id": "renamed-model", "object": "model", "owned_by": "prefixgate"}]}
    page.route("**/v1/models", lambda route: route.fulfill(status=200, content_type="application/json",
                                                           body=json.dumps(card)))
    page.reload()
    expect(page.locator("#model-name")).to_have_text("renamed-model")
    send(page, "still answered")
    answer_stats(page, 1)
    expect(page.locator("#error")).to_be_hidden()
    tab.errors.clear()  # the browser logs the aborted fetches


def test_a_chat_is_renamed_exported_and_imported(opened, server, tmp_path):
    page = opened().page
    settings(page, max_tokens="4")
    send(page, "a chat worth keeping")
    answer_stats(page, 0)
    page.locator("#chats li.current button.rename").click()
    page.press("#chats li .title-input", "Escape")  # the title as it was, its button back
    expect(page.locator("#chats li.current button.open")).to_have_text("a chat worth keeping")
    page.locator("#chats li.current button.rename").click()
    page.fill("#chats li .title-input", "Kept chat")
    page.press("#chats li .title-input", "Enter")
    expect(page.locator("#chats li.current button.open")).to_have_text("Kept chat")
    with page.expect_download() as download:
        page.click("#export")
    path = tmp_path / "chat.json"
    download.value.save_as(path)
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], download.value.suggested_filename) == ("prefixgate.chats", 1,
                                                                                   "Kept_chat.json")
    (chat,) = data["chats"]
    assert chat["title"] == "Kept chat"
    assert [(m["role"], m["content"]) for m in chat["messages"]][0] == ("user", "a chat worth keeping")
    page.click("#new-chat")
    page.set_input_files("#import-file", str(path))
    expect(page.locator("#chats li")).to_have_count(3)
    expect(page.locator("#chats li.current button.open")).to_have_text("Kept chat")
    expect(page.locator(".message")).to_have_count(2)
    path.write_text('{"chats": "nope"}')
    page.set_input_files("#import-file", str(path))
    expect(page.locator("#error")).to_have_text("Import failed: not a chat exported from this page")
    expect(page.locator("#chats li")).to_have_count(3)


def test_settings_are_kept_across_a_reload_and_the_server_default_is_shown(opened, server):
    page = opened().page
    cap = server.state.sampling_defaults["max_tokens"]
    expect(page.locator("#max_tokens")).to_have_attribute("placeholder", f"server default {cap}")
    settings(page, temperature="0.3", max_tokens="7", seed="5")
    page.reload()
    assert [page.input_value(f"#{name}") for name in ("temperature", "top_p", "max_tokens", "seed")] == \
        ["0.3", "", "7", "5"]


def test_two_tabs_keep_each_others_chats(browser, server):
    """Each chat is its own entry in localStorage: a tab saving its chat never writes over another tab's."""
    opened = Opened(browser, server.url + "/")
    first = opened.page
    second = opened.context.new_page()
    settings(first, max_tokens="3")
    send(first, "from the first tab")
    answer_stats(first, 0)
    second.goto(server.url + "/")
    settings(second, max_tokens="3")
    second.click("#new-chat")
    send(second, "from the second tab")
    answer_stats(second, 0)
    send(first, "the first tab again")
    answer_stats(first, 1)
    expect(first.locator("#chats li")).to_have_count(2)  # the other tab's chat shows up here too
    third = opened.context.new_page()
    third.goto(server.url + "/")
    for title in ("from the first tab", "from the second tab"):
        third.locator("#chats li button.open", has_text=title).click()
        expect(third.locator(".message")).to_have_count(4 if title.startswith("from the first") else 2)
    opened.close()


def two_tabs(browser, server) -> tuple[Opened, Page, Page]:
    """The page open in one tab, and a second tab (not opened yet) of the same browser: they share localStorage."""
    opened = Opened(browser, server.url + "/")
    return opened, opened.page, opened.context.new_page()


def an_edit_open_beside_another_tab(browser, server) -> tuple[Opened, Page, Page]:
    """A tab with one answered question whose edit box is open, and a second tab (not opened yet) of the same
    browser."""
    opened, page, other = two_tabs(browser, server)
    settings(page, max_tokens="2")
    send(page, "a question to edit")
    answer_stats(page, 0)
    page.locator(".message.user .actions .edit").click()
    return opened, page, other


def test_another_tabs_saves_leave_an_open_edit_alone_and_an_older_store_moves_over(browser, server):
    opened, first, second = an_edit_open_beside_another_tab(browser, server)
    first.fill(".edit-box textarea", "half typed")
    second.goto(server.url + "/")
    settings(second, max_tokens="2")
    second.click("#new-chat")
    send(second, "meanwhile in another tab")
    answer_stats(second, 0)
    expect(first.locator("#chats li")).to_have_count(2)  # the list took the other tab's chat ...
    assert first.input_value(".edit-box textarea") == "half typed"  # ... and the edit stayed open as it was
    older = [{"id": f"old-{i}", "title": f"old chat {i}", "system": "", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "", "stats": "answer 0 tokens"}]}
        for i in range(3)]
    second.evaluate("""older => { for (const key of Object.keys(localStorage)) {
                                      if (key.startsWith('prefixgate.chat.')) localStorage.removeItem(key); }
                                  localStorage.setItem('prefixgate.chats', JSON.stringify(older)); }""", older)
    second.reload()  # the page before kept one list: each chat gets its own entry, in the same order
    expect(second.locator("#chats li button.open")).to_have_text(["old chat 0", "old chat 1", "old chat 2"])
    assert second.evaluate("localStorage.getItem('prefixgate.chats')") is None
    second.locator("#chats li button.open", has_text="old chat 1").click()
    expect(second.locator(".message")).to_have_count(1)  # the refused empty answer is not kept
    expect(second.locator(".message.user .actions .regenerate")).to_have_text("Answer")
    settings(second, max_tokens="2")
    second.locator(".message.user .actions .regenerate").click()  # the question left unanswered, answered
    answer_stats(second, 0)
    opened.close()


def test_an_edit_open_while_another_tab_renames_the_chat_is_still_saved(browser, server):
    opened, page, other = an_edit_open_beside_another_tab(browser, server)
    other.goto(server.url + "/")
    other.locator("#chats li.current button.rename").click()
    other.fill("#chats li .title-input", "Renamed there")
    other.press("#chats li .title-input", "Enter")
    expect(page.locator("#chats li.current button.open")).to_have_text("Renamed there")  # this tab took the save
    page.fill(".edit-box textarea", "the question, edited")
    page.click(".edit-box .save")
    answer_stats(page, 0)
    page.reload()  # the edit and its answer were stored, under the other tab's title
    expect(page.locator(".message.user .body")).to_have_text("the question, edited")
    expect(page.locator(".message")).to_have_count(2)
    expect(page.locator("#chats li.current button.open")).to_have_text("Renamed there")
    opened.close()


def test_another_tabs_save_that_changes_no_message_draws_none_here(browser, server):
    """A rename or a system prompt set in another tab leaves the messages here as they are drawn (a long chat was
    drawn anew at each of that tab's saves); a message added there is drawn."""
    opened, page, other = two_tabs(browser, server)
    settings(page, max_tokens="2")
    send(page, "a chat open in two tabs")
    answer_stats(page, 0)
    other.goto(server.url + "/")
    drawn = other.locator(".message.assistant").element_handle()
    page.locator("#chats li.current button.rename").click()
    page.fill("#chats li .title-input", "Renamed")
    page.press("#chats li .title-input", "Enter")
    settings(page, system="You are terse.")
    page.click("#input")  # (the field is saved as it loses focus)
    expect(other.locator("#topbar-title")).to_have_text("Renamed")  # both saves reached the other tab
    expect(other.locator("#system")).to_have_value("You are terse.")
    assert drawn.evaluate("el => el.isConnected")
    send(page, "a second question")
    answer_stats(page, 1)
    expect(other.locator(".message")).to_have_count(4)
    opened.close()


def test_a_reader_keeps_their_place_when_an_answer_ends_and_a_delete_elsewhere_stops_it(browser, server):
    with slowed(server, 0.05):
        opened, page, other = two_tabs(browser, server)
        settings(page, temperature="0")
        start_streaming(page, "count to a thousand", 40)
        page.locator("#messages").evaluate("el => { el.style.height = '120px'; }")
        page.wait_for_timeout(300)
        page.locator("#messages").evaluate("el => { el.scrollTop = 0; }")
        expect(page.locator("#stop")).to_be_hidden(timeout=30_000)  # the answer ended ...
        assert page.locator("#messages").evaluate("el => el.scrollTop") == 0  # ... and the reader is where they were
        start_streaming(page, "count to a thousand again", 400)
        other.goto(server.url + "/")
        other.locator("#chats li.current button.delete").click()  # the chat streaming in the first tab
        expect(page.locator("#stop")).to_be_hidden()  # its answer stopped there
        server.wait_idle(timeout=10)
        page.wait_for_timeout(300)
        assert page.evaluate("Object.keys(localStorage).filter(k => k.startsWith('prefixgate.chat.')).length") <= 1
        expect(page.locator("#chats li", has_text="count to a thousand")).to_have_count(0)  # not brought back
        opened.close()


def test_an_answer_streams_into_its_own_chat_and_a_reader_who_scrolls_up_stays(opened, server):
    with slowed(server, 0.05):
        page = opened().page
        settings(page, max_tokens="3", temperature="0")  # greedy: the long answer below runs its whole length
        send(page, "a short chat")
        answer_stats(page, 0)
        short = page.locator(".message.assistant .body").first.inner_text()
        page.click("#new-chat")
        start_streaming(page, "a long answer " * 40, 400)
        page.locator("#messages").evaluate("el => { el.style.height = '120px'; }")
        page.wait_for_timeout(300)
        page.locator("#messages").evaluate("el => { el.scrollTop = 0; }")
        page.wait_for_timeout(500)  # tokens kept coming: the view stayed where the reader put it
        assert page.locator("#messages").evaluate("el => el.scrollTop") == 0
        expect(page.locator("#stop")).to_be_visible()  # (still streaming)
        page.locator("#chats li button.open", has_text="a short chat").click()
        page.wait_for_timeout(500)
        expect(page.locator(".message.assistant .body").first).to_have_text(short)
        page.locator("#chats li", has_text="a long answer").locator("button.delete").click()  # stops its answer
        expect(page.locator("#stop")).to_be_hidden()
        server.wait_idle(timeout=10)
        expect(page.locator(".message.assistant .body").first).to_have_text(short)


def test_two_chats_stream_at_once_each_with_its_own_stop_and_export(opened, server, tmp_path):
    with slowed(server, 0.2):  # the first answer (457 tokens) outlasts the steps below
        page = opened().page
        settings(page, temperature="0")
        start_streaming(page, "count to a thousand", 2000)
        page.click("#new-chat")  # the first chat goes on streaming; this one is free to send
        expect(page.locator("#stop")).to_be_hidden()
        send(page, "and count to ten")
        expect(page.locator("#stop")).to_be_visible()
        expect(page.locator(".message.assistant .body")).not_to_be_empty(timeout=30_000)
        with page.expect_download() as download:  # taken mid-answer: the export says so
            page.click("#export")
        download.value.save_as(tmp_path / "chat.json")
        (chat,) = json.loads((tmp_path / "chat.json").read_text())["chats"]
        assert chat["messages"][-1]["stats"] == "unfinished: exported while it streamed"
        page.click("#stop")  # this chat's answer only
        expect(page.locator(".message.assistant .stats")).to_contain_text("stopped")
        page.locator("#chats li button.open", has_text="count to a thousand").click()
        expect(page.locator("#stop")).to_be_visible()  # still streaming there
        expect(page.locator(".message.assistant .stats")).to_have_count(0)  # (stats come when it ends)
        page.click("#stop")
        expect(page.locator(".message.assistant .stats")).to_contain_text("stopped")
        server.wait_idle(timeout=10)


def test_a_chat_answering_in_another_tab_is_not_sent_into_and_a_rename_there_reaches_it(browser, server):
    with slowed(server, 0.05):
        opened, page, other = two_tabs(browser, server)
        other.goto(server.url + "/")  # the same chat, open before its answer starts streaming in the first tab
        settings(page, temperature="0")
        start_streaming(page, "count to a thousand", 400)
        expect(other.locator(".message.assistant .stats")).to_have_text("answering in another tab")
        expect(other.locator(".message.assistant .body")).not_to_be_empty()  # the answer so far, as it is saved
        send(other, "a second answer at once would write over the first")
        expect(other.locator("#error")).to_contain_text("This chat is answering in another tab")
        assert other.input_value("#input").startswith("a second answer")  # the text stays
        expect(other.locator(".message")).to_have_count(2)
        other.locator("#chats li.current button.rename").click()
        other.fill("#chats li .title-input", "Counting")
        other.press("#chats li .title-input", "Enter")
        expect(page.locator("#chats li.current button.open")).to_have_text("Counting")  # taken while it streams
        expect(page.locator("#stop")).to_be_visible()
        with other.expect_download() as download:  # exported from the watching tab: marked as unfinished too
            other.click("#export")
        (exported,) = json.loads(Path(download.value.path()).read_text())["chats"]
        assert exported["messages"][-1] == {"role": "assistant", "content": exported["messages"][-1]["content"],
                                            "stats": "unfinished: exported while it streamed"}
        page.click("#stop")
        expect(other.locator(".message.assistant .stats")).to_contain_text("stopped")  # drawn when it ended
        expect(other.locator("#error")).to_be_hidden()  # the refusal's message went with the answer
        settings(other, max_tokens="2")
        other.press("#input", "Enter")  # now it is sent
        expect(other.locator(".message.assistant .stats").nth(1)).to_contain_text("prompt", timeout=30_000)
        expect(other.locator("#chats li.current button.open")).to_have_text("Counting")
        opened.close()


def test_a_click_on_the_list_is_not_lost_to_another_tabs_saves_of_an_answer(browser, server):
    """Another tab saves its streaming answer every second; the list here keeps its buttons (nothing it shows
    changed), so a press and a release a save apart still open the chat."""
    with slowed(server, 0.05):
        opened, page, other = two_tabs(browser, server)
        settings(page, max_tokens="2")
        send(page, "an older chat")
        answer_stats(page, 0)
        page.click("#new-chat")
        settings(page, temperature="0")
        start_streaming(page, "count to a thousand", 400)
        other.goto(server.url + "/")
        other.locator("#chats li button.open", has_text="count to a thousand").click()
        answer = other.locator(".message.assistant .body")
        expect(answer).not_to_be_empty()
        older = other.locator("#chats li button.open", has_text="an older chat")
        button = older.element_handle()
        older.hover()
        other.mouse.down()
        for _ in range(2):  # two saves of the answer reach this tab between the press and the release
            before = answer.inner_text()
            expect(answer).not_to_have_text(before, timeout=5_000)
        assert button.evaluate("el => el.isConnected")  # (the click's own redraw, opening the chat, comes after)
        other.mouse.up()
        expect(other.locator(".message.user .body")).to_have_text(["an older chat"])
        page.click("#stop")
        opened.close()


def test_a_chat_streaming_here_takes_another_tabs_system_prompt_and_stays_busy_there_when_renamed(browser, server):
    with slowed(server, 0.05):
        opened, page, other = two_tabs(browser, server)
        other.goto(server.url + "/")
        settings(page, temperature="0")
        start_streaming(page, "count to a thousand", 400)
        settings(other, system="You are a pirate.")
        other.click("#input")  # (the field is saved as it loses focus)
        page.wait_for_timeout(2500)  # past two of the streaming tab's saves
        stored = other.evaluate("Object.keys(localStorage).filter(k => k.startsWith('prefixgate.chat.'))"
                                ".map(k => JSON.parse(localStorage.getItem(k)).system)")
        assert stored == ["You are a pirate."] and other.input_value("#system") == "You are a pirate."
        page.locator("#chats li.current button.rename").click()  # a rename in the streaming tab ...
        page.fill("#chats li .title-input", "Counting here")
        page.press("#chats li .title-input", "Enter")
        send(other, "not now")  # ... still tells the other tab that it answers
        expect(other.locator("#error")).to_contain_text("This chat is answering in another tab")
        page.click("#stop")
        expect(other.locator("#chats li.current button.open")).to_have_text("Counting here")
        opened.close()


def test_a_title_being_typed_outlives_an_answer_ending_in_another_chat(opened, server):
    with slowed(server, 0.05):
        page = opened().page
        settings(page, max_tokens="2")
        send(page, "a chat to rename")
        answer_stats(page, 0)
        page.click("#new-chat")
        start_streaming(page, "a short answer", 30)
        page.locator("#chats li button.open", has_text="a chat to rename").click()
        page.locator("#chats li.current button.rename").click()
        page.fill("#chats li .title-input", "Half typed")
        server.wait_idle(timeout=30)  # the other chat's answer ended meanwhile (its list redrawn)
        page.wait_for_timeout(300)
        assert page.input_value("#chats li .title-input") == "Half typed"
        page.press("#chats li .title-input", "End")
        page.keyboard.type(" and finished")
        page.press("#chats li .title-input", "Enter")
        expect(page.locator("#chats li.current button.open")).to_have_text("Half typed and finished")


def test_a_cut_answer_says_so_and_a_refused_request_leaves_no_empty_answer(opened, server):
    tab = opened()
    page = tab.page
    settings(page, max_tokens="3", temperature="0")
    send(page, "tell me everything")
    expect(page.locator(".message.assistant .stats").first).to_contain_text("cut at max_tokens")
    settings(page, temperature="7")  # out of range: a 400
    send(page, "and more")
    expect(page.locator("#error")).to_contain_text("temperature")
    expect(page.locator(".message")).to_have_count(3)  # the question stays, no empty answer after it
    tab.errors.clear()  # the browser logs the 400
    settings(page, temperature="1e309")  # not a finite number: refused here, the text kept
    page.fill("#input", "kept text")
    page.press("#input", "Enter")
    expect(page.locator("#error")).to_contain_text("temperature must be a number")
    assert page.input_value("#input") == "kept text"
    settings(page, temperature="0")
    page.locator(".message.user .actions .edit").last.click()
    page.click(".edit-box .save")
    expect(page.locator(".message.assistant .stats").nth(1)).to_contain_text("prompt")
    expect(page.locator(".message")).to_have_count(4)


def test_a_reload_while_it_streams_keeps_what_came(opened, server):
    with slowed(server, 0.05):
        page = opened().page
        settings(page, temperature="0")  # greedy: the same long answer every run (sampled, one ended at once)
        start_streaming(page, "count to a thousand", 200)
        expect(page.locator("#stop")).to_be_visible()
        page.wait_for_timeout(1500)  # past one periodic save
        page.reload()  # (the unload may still abort the fetch and save it as stopped: either keeps it)
        expect(page.locator(".message.assistant .stats").first).to_have_text(re.compile("interrupted|stopped"))
        assert page.locator(".message.assistant .body").first.inner_text()
    server.wait_idle(timeout=30)


def test_a_server_not_ready_is_retried_and_full_storage_is_said(opened, server):
    tab = opened(url="about:blank")
    page = tab.page
    refused = []

    def first_refused(route):
        if not refused:
            refused.append(route.request.url)
            route.fulfill(status=503, content_type="application/json", body='{"error": {"message": "draining"}}')
        else:
            route.continue_()
    page.route("**/v1/models", first_refused)
    page.goto(server.url + "/")
    expect(page.locator("#model-name")).to_have_text(server.state.model_name, timeout=10_000)
    assert refused and page.locator("#error").is_hidden()
    tab.errors.clear()  # the browser logs the 503
    page.evaluate("""() => {  // to the brim: chunks of 1 MB, then ever smaller ones
        let i = 0;
        for (let size = 1 << 20; size >= 1; size >>= 1) {
            try { for (;;) localStorage.setItem('filler' + i++, 'x'.repeat(size)); } catch (error) {}
        }
    }""")
    settings(page, max_tokens="2")
    send(page, "no room left")
    expect(page.locator("#error")).to_contain_text("storage for the page is full")
    answer_stats(page, 0)  # the request is sent all the same
    page.set_input_files("#import-file", files=[{"name": "chat.json", "mimeType": "application/json",
                                                 "buffer": json.dumps({"format": "prefixgate.chats", "version": 1,
                                                                       "chats": [{"title": "big", "messages": [
                                                                           {"role": "user", "content": "x" * 20000}]}]}
                                                                      ).encode()}])
    expect(page.locator("#chats li.current button.open")).to_have_text("big")
    expect(page.locator("#error")).to_contain_text("storage for the page is full")  # said, not cleared


def test_the_page_follows_the_systems_dark_theme(opened):
    dark = opened(color_scheme="dark").page
    light = opened(color_scheme="light").page
    background = "getComputedStyle(document.body).backgroundColor"
    expect(dark.locator("#model-name")).not_to_be_empty()
    assert (dark.evaluate(background), light.evaluate(background)) == ("rgb(27, 28, 31)", "rgb(250, 250, 250)")


@pytest.mark.default_model
@pytest.mark.server
def test_the_default_model_in_the_page_and_the_readme_screenshot(browser, tmp_path):
    """The page as a newcomer sees it after `make serve`: the real default model, its sampling defaults, two
    turns of one chat (the second hits the cache). Its screenshot becomes docs/images/chat-page.png, which the
    README shows, when PREFIXGATE_UPDATE_SCREENSHOTS=1."""
    # fixed thread counts: the start-up probe of each count (test_threads.py's) is not this test's point
    with served("--model", "default", "--kv-cache-memory-mb", "256", "--threads", "1", "--threads-batch", "2") \
            as server:
        # the start-up log names the page beside the API, and that address serves it
        page_url = re.search(r"the chat page is at (http://\S+/)$", "".join(server.log_lines), re.M).group(1)
        assert page_url == server.base_url.removesuffix("v1")
        opened = Opened(browser, page_url, viewport={"width": 1200, "height": 720})
        page = opened.page
        expect(page.locator("#model-name")).to_have_text("SmolLM2-135M-Instruct", timeout=30_000)
        settings(page, seed="1")  # the model's own sampling defaults, reproducibly
        page.click("#settings summary")  # closed again for the picture
        send(page, "What is the capital of France?")
        answer_stats(page, 0)
        assert "Paris" in page.locator(".message.assistant .body").first.inner_text()
        send(page, "And the capital of Italy?")
        assert cached(answer_stats(page, 1)) > 0
        shot = SCREENSHOT if UPDATE_SCREENSHOTS else tmp_path / SCREENSHOT.name
        page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        opened.close()
